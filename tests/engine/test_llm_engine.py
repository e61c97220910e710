"""Greedy output of the batched engine equals transformers' greedy generate, token for token,
under chunked prefill, preemption and prefix caching; with every Triton kernel on, the same
greedy tokens as the torch path."""

import dataclasses
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from blockdraft import LLM, SamplingParams
from blockdraft.kernels import triton_attention, triton_rope
from blockdraft.kernels.dflash_inputs import DFlashInputs
from blockdraft.kernels.policy import KernelPolicy
from blockdraft.kernels.triton_activation import triton_silu_mul
from blockdraft.kernels.triton_attention import triton_paged_attention
from blockdraft.kernels.triton_dflash_inputs import prepare_dflash_inputs
from blockdraft.kernels.triton_rmsnorm import triton_rms_norm
from blockdraft.kernels.triton_rope import triton_qk_norm_rope, triton_qk_norm_rope_store

from checkpoints import make_dflash_drafter, make_llama_checkpoint, make_qwen3_checkpoint
from kernel_inputs import DEVICE, needs_triton

MAX_TOKENS = 12


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def target(request, tmp_path_factory) -> Path:
    builder = make_qwen3_checkpoint if request.param == "qwen3" else make_llama_checkpoint
    return builder(tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def batch(target: Path) -> tuple[list[list[int]], list[list[int]]]:
    """Eight fresh prompts of different lengths and transformers' greedy continuations."""
    rng = torch.Generator().manual_seed(torch.seed() % 2**31)
    prompts = random_prompts(rng, [1, 3, 8, 15, 16, 17, 33, 49])
    return prompts, reference_greedy(target, prompts, MAX_TOKENS)


def reference_greedy(target: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    outs = []
    for p in prompts:
        ids = model.generate(
            torch.tensor([p]),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        outs.append(ids[0, len(p) :].tolist())
    return outs


def random_prompts(rng: torch.Generator, lengths: list[int], vocab: int = 128) -> list[list[int]]:
    return [torch.randint(4, vocab, (n,), generator=rng).tolist() for n in lengths]


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)

SETUPS = {
    "plain": {},
    "chunked-prefill-16": dict(max_num_batched_tokens=16),
    # 12 blocks of 8 tokens for 8 requests of up to 61 tokens: they cannot all stay resident.
    "preemption": dict(block_size=8, num_kv_blocks=12, max_model_len=90),
}


@pytest.mark.parametrize("setup", list(SETUPS))
def test_batched_greedy_equals_transformers(target: Path, batch, setup: str) -> None:
    prompts, expected = batch
    llm = LLM(str(target), **SETUPS[setup])
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for out, ref in zip(outs, expected, strict=True):
        assert out.outputs[0].token_ids == ref
        assert out.outputs[0].finish_reason == "length"
    if setup == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_prefix_caching_shares_blocks_and_keeps_output(target: Path, rng) -> None:
    shared = random_prompts(rng, [40])[0]
    prompts = [shared + tail for tail in random_prompts(rng, [1, 5, 9, 20])]
    llm = LLM(str(target), block_size=8, enable_prefix_caching=True)
    first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    outs = first + rest
    # The later requests found the shared 40-token prefix (5 full blocks) in the cache.
    assert all(o.num_cached_tokens == 40 for o in rest)
    expected = reference_greedy(target, prompts, MAX_TOKENS)
    assert [o.outputs[0].token_ids for o in outs] == expected


# --- every Triton kernel in the engine ----------------------------------------------------


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("kernels-engine")
    target = make_qwen3_checkpoint(root / "target", num_layers=2)
    # One sliding causal layer, one non-causal layer: both drafter attention modes.
    drafter = make_dflash_drafter(
        root / "drafter",
        target,
        target_layer_ids=[0, 1],
        sliding_window=6,
        layer_types=["sliding_attention", "full_attention"],
    )
    return target, drafter


@pytest.mark.slow
@needs_triton
@pytest.mark.parametrize(
    ("speculative", "rope_rows"),
    [(False, None), (True, None), (True, 16)],
    ids=["plain", "dflash", "dflash-rope-in-block-attention"],
)
def test_engine_greedy_same_with_triton_kernels(
    tiny_pair, rng, monkeypatch, speculative: bool, rope_rows: int | None
) -> None:
    """Greedy outputs with every Triton kernel equal the torch path's; with rope_rows, verify
    and drafter blocks also norm, rotate and store their step in the attention kernel."""
    target, drafter = tiny_pair
    prompts = [torch.randint(4, 128, (n,), generator=rng).tolist() for n in (3, 13)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    # A small pool: the interpreter copies every tensor argument on each launch. Chunked
    # prefill puts prefill chunks and decode/verify rows in the same batch.
    engine_args: dict = dict(
        block_size=4,
        num_kv_blocks=24,
        max_model_len=48,
        max_num_batched_tokens=8,
        device=str(DEVICE),
    )
    if speculative:
        engine_args["speculative_config"] = {
            "method": "dflash",
            "model": str(drafter),
            "num_speculative_tokens": 3,
            # Pinned: "auto" may pick N = 0 throughout on the CPU, deferring the drafter's
            # context K/V (whose kernels this test counts) past the end of the run.
            "num_speculative_tokens_by_batch": None,
        }

    def generate(policy: KernelPolicy) -> list[list[int]]:
        llm = LLM(str(target), dtype="float32", kernel_policy=policy, **engine_args)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    expected = generate(KernelPolicy(backend="torch"))
    calls: dict[str, int] = {"attention": 0, "norm": 0, "fused norm": 0, "rope": 0, "silu": 0}
    triton_policy = KernelPolicy(backend="triton")
    if rope_rows is not None:
        triton_policy = dataclasses.replace(
            triton_policy, rope_in_attention_max_query_len=rope_rows
        )
        del calls["rope"]  # every launch here (chunks of <= 8 rows) fits the attention kernel
    if not speculative or rope_rows is not None:  # (DFlash steps verify: no decode forward)
        # Decode forwards (and blocks, with rope_rows) norm, rotate and store the step's
        # q/k/v in the attention kernel.
        calls["rope in attention"] = 0
    if speculative:
        calls["rope keys only"] = 0  # the drafter's context K (project_kv)
        calls["dflash inputs"] = 0  # the drafter's inputs, built from the step's results

        def counting_dflash_inputs(*args: object, **kwargs: object) -> DFlashInputs:
            calls["dflash inputs"] += 1
            return prepare_dflash_inputs(*args, **kwargs)

        monkeypatch.setattr(
            "blockdraft.kernels.triton_dflash_inputs.prepare_dflash_inputs",
            counting_dflash_inputs,
        )

    def counting_attention(*args: object, **kwargs: object) -> torch.Tensor:
        calls["attention"] += 1
        if kwargs.get("step_kv") is not None:  # (on CUDA the warm-up also runs decodes)
            calls["rope in attention"] = calls.get("rope in attention", 0) + 1
        return triton_paged_attention(*args, **kwargs)

    def counting_norm(*args: object, **kwargs: object) -> object:
        fused = len(args) > 3 and args[3] is not None
        calls["fused norm" if fused else "norm"] += 1
        return triton_rms_norm(*args, **kwargs)

    monkeypatch.setattr(
        "blockdraft.kernels.triton_attention.triton_paged_attention", counting_attention
    )

    def counting_rope(*args: object, **kwargs: object) -> object:
        name = "rope" if args[0] is not None else "rope keys only"
        calls[name] = calls.get(name, 0) + 1  # (on CUDA the warm-up also runs long prefills)
        return triton_qk_norm_rope(*args, **kwargs)

    def counting_rope_store(*args: object, **kwargs: object) -> object:
        # fuse_kv_store_into_rope: the same norm + RoPE, storing K/V as it goes
        name = "rope" if args[0] is not None else "rope keys only"
        calls[name] = calls.get(name, 0) + 1
        return triton_qk_norm_rope_store(*args, **kwargs)

    def counting_silu_mul(*args: object, **kwargs: object) -> torch.Tensor:
        calls["silu"] += 1
        return triton_silu_mul(*args, **kwargs)

    monkeypatch.setattr("blockdraft.kernels.triton_rmsnorm.triton_rms_norm", counting_norm)
    monkeypatch.setattr("blockdraft.kernels.triton_rope.triton_qk_norm_rope", counting_rope)
    for module in (triton_rope, triton_attention):  # the drafter's context path, the layers'
        monkeypatch.setattr(module, "triton_qk_norm_rope_store", counting_rope_store)
    monkeypatch.setattr("blockdraft.kernels.triton_activation.triton_silu_mul", counting_silu_mul)
    got = generate(triton_policy)
    # Plain norms (the first input norm), residual-fused ones, the q/k norms fused with RoPE,
    # the MLP activations (and the drafter's inputs) all ran in Triton.
    assert all(calls.values()), f"the engine skipped a Triton backend: {calls}"
    assert got == expected
