"""DFlash on hybrid (Gated DeltaNet) targets: the same tokens and per-step acceptance lengths as
z-lab's `dflash_generate` on transformers' `Qwen3_5ForCausalLM`, every bonus token the target's
own choice after partially accepted blocks (the linear-attention state committed at the
accepted length), and lossless against plain decoding, greedy and sampled."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest
import torch
from transformers import DynamicCache

from blockdraft import LLM, SamplingParams
from blockdraft.kernels import triton_gated_deltanet_verify, triton_gated_deltanet_verify_chunk
from blockdraft.kernels.policy import KernelPolicy
from blockdraft.kernels.triton_env import triton_interpreting
from blockdraft.layers import gated_deltanet

from checkpoints import (
    load_hf_target,
    make_dflash_drafter,
    make_predictable_target,
    make_qwen3_5_checkpoint,
    zlab_full_block_steps,
    zlab_generate,
)
from sampling_checks import assert_same_token_law, seeded_samples
from spies import spy_draft_logits

# z-lab's published drafters for hybrid targets: sliding-window layers and a final full one.
DRAFTER_LAYERS = dict(
    num_layers=3,
    sliding_window=6,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"],
)


def spec(drafter: Path, n: int, **extra: object) -> dict:
    return {
        "method": "dflash",
        "model": str(drafter),
        "num_speculative_tokens": n,
        "num_speculative_tokens_by_batch": None,
        **extra,
    }


@pytest.fixture(scope="module")
def random_pair(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("hybrid-random")
    target = make_qwen3_5_checkpoint(root / "target", num_layers=6)
    return target, make_dflash_drafter(root / "drafter", target, block_size=8, **DRAFTER_LAYERS)


@pytest.fixture(scope="module")
def agreeing_pair(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("hybrid-agreeing")
    target = make_predictable_target(root / "target", arch="qwen3_5", num_layers=6)
    drafter = make_dflash_drafter(
        root / "drafter", target, block_size=8, agree_with_target=True, **DRAFTER_LAYERS
    )
    return target, drafter


def zlab_hybrid_cache(block: int):
    """A patch of z-lab's cache for linear-attention targets: z-lab 0.1.0 activates past
    recording without `recurrent_states_to_keep`, which transformers 5.25 needs."""
    import dflash.model as zlab

    def make_cache(config):
        cache = DynamicCache(config=config)
        cache.activate_past_recording(recurrent_states_to_keep=block)
        return cache

    return mock.patch.object(zlab, "_make_cache", make_cache)


def zlab_on_hybrid(target: Path, drafter: Path, prompt: list[int], max_new: int, block: int):
    """`zlab_generate` on a hybrid target (`zlab_hybrid_cache`)."""
    with zlab_hybrid_cache(block):
        return zlab_generate(target, drafter, prompt, max_new_tokens=max_new)


def assert_first_drafts_match_zlab(target: Path, drafter: Path, prompt: list[int]) -> None:
    """The drafter's first logits (block 8) on the hybrid target's captured features equal
    z-lab's on transformers' model."""
    from checkpoints import zlab_first_draft_logits

    with zlab_hybrid_cache(8):
        ref = zlab_first_draft_logits(target, drafter, prompt)
    llm = LLM(str(target), speculative_config=spec(drafter, 7), block_size=4)
    seen = spy_draft_logits(llm)
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert ((seen[0] - ref).abs().max() / ref.abs().max()).item() < 1e-4


@pytest.mark.parametrize("kind", ["varying-acceptance", "random"])
def test_matches_zlab_reference(tmp_path: Path, kind: str, rng) -> None:
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))
    prompt = torch.randint(4, 64, (21,), generator=rng).tolist()
    max_new, block = 30, 8
    if kind == "random":
        target = make_qwen3_5_checkpoint(tmp_path / "target", num_layers=6, seed=seed)
        drafter = make_dflash_drafter(tmp_path / "d", target, block_size=block, **DRAFTER_LAYERS)
        ref_tokens, ref_lengths = zlab_on_hybrid(target, drafter, prompt, max_new, block)
    else:
        target = make_predictable_target(tmp_path / "target", arch="qwen3_5", num_layers=6)
        for attempt in range(5):
            drafter = make_dflash_drafter(
                tmp_path / f"d{attempt}", target, block_size=block, seed=seed + attempt,
                agree_with_target=True, draft_error_rate=0.15, **DRAFTER_LAYERS,
            )  # fmt: skip
            ref_tokens, ref_lengths = zlab_on_hybrid(target, drafter, prompt, max_new, block)
            # Wrong drafts that all miss this short run: take the next seed.
            if len(set(ref_lengths[:-1])) > 1:
                break
        assert len(set(ref_lengths[:-1])) > 1 and max(ref_lengths) > 3
    llm = LLM(str(target), speculative_config=spec(drafter, block - 1), block_size=4)
    params = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ref_tokens
    full_steps = zlab_full_block_steps(ref_lengths, max_new, block_size=block)
    assert full_steps >= 3
    assert out.spec_accept_lengths[:full_steps] == ref_lengths[:full_steps]


def test_bonus_tokens_follow_the_target_after_partial_acceptance(random_pair, rng) -> None:
    """Synthetic acceptance keeps a random prefix of each block of random drafts: the token
    after it (the bonus) must be the target's greedy choice given everything committed before,
    which only holds when the linear-attention states end exactly at the accepted drafts.
    Requests share steps with other requests' prefill chunks and verifies."""
    target, drafter = random_pair
    n = 5
    prompts = [torch.randint(4, 128, (k,), generator=rng).tolist() for k in (3, 19, 30)]
    llm = LLM(
        str(target), speculative_config=spec(drafter, n, synthetic_acceptance_rate=0.6),
        block_size=4, max_num_batched_tokens=16,
    )  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    hf = load_hf_target(target)
    partial = 0
    for prompt, out in zip(prompts, outs, strict=True):
        tokens, lengths = out.outputs[0].token_ids, out.spec_accept_lengths
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + tokens])).logits[0]
        bonus = [0]  # the prefill's token, then the last token of every complete step
        for length in lengths[:-1]:  # the last step may stop inside its accepted drafts
            bonus.append(bonus[-1] + length)
        for i in bonus:
            row = logits[len(prompt) + i - 1]
            # The target's choice, up to a tie within float32 noise (the engine's chunked and
            # recurrent rules round differently from transformers'): a state that ends at the
            # wrong row picks from different logits altogether.
            gap = (row.max() - row[tokens[i]]).item()
            assert gap <= 1e-5 * row.abs().max().item(), (i, lengths, gap)
        partial += sum(1 < k < n + 1 for k in lengths[:-1])
    assert partial >= 3


@pytest.mark.parametrize(
    "setup",
    [
        pytest.param({}, id="plain"),
        pytest.param(dict(max_num_batched_tokens=16), id="chunked-prefill", marks=pytest.mark.slow),
        pytest.param(
            dict(block_size=4, num_kv_blocks=30, max_model_len=80),
            id="preemption",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_greedy_lossless(random_pair, agreeing_pair, setup: dict, rng) -> None:
    prompts = [torch.randint(4, 64, (k,), generator=rng).tolist() for k in (1, 9, 23, 40)]
    params = SamplingParams(temperature=0, max_tokens=29, ignore_eos=True)
    for target, drafter in (random_pair, agreeing_pair):
        ar = LLM(str(target), **setup).generate(prompts, params, use_tqdm=False)
        llm = LLM(str(target), speculative_config=spec(drafter, 7), **setup)
        sd = llm.generate(prompts, params, use_tqdm=False)
        for a, s in zip(ar, sd, strict=True):
            assert s.outputs[0].token_ids == a.outputs[0].token_ids
        manager = llm.engine.block_manager
        assert len(manager.free_state_slots) == llm.engine.config.max_num_seqs
    assert llm.engine.spec_stats.mean_acceptance_length > 4  # the agreeing pair's
    if "num_kv_blocks" in setup:
        assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.slow
def test_sampling_is_lossless(random_pair) -> None:
    """Seeded samples of the first tokens agree between speculative and plain decoding
    (two-sample chi-square on the tokens that come from verify)."""
    target, drafter = random_pair
    prompt, num = [5, 17, 33, 8], 1500
    kw = dict(max_num_seqs=256, max_model_len=32)
    ar = seeded_samples(LLM(str(target), **kw), prompt, num, top_k=6)
    llm = LLM(str(target), speculative_config=spec(drafter, 3), **kw)
    sd = seeded_samples(llm, prompt, num, top_k=6)
    assert llm.engine.spec_stats.num_drafts > 0
    assert_same_token_law(ar, sd, (1, 2))


def test_one_host_readback_per_step(random_pair, monkeypatch, rng) -> None:
    """State slots, step batches and commits at the accepted length need no host readback:
    a speculative step on a hybrid target reads the device back once (its tokens)."""
    from test_dflash_lossless import run_counting_readbacks

    target, drafter = random_pair
    llm = LLM(
        str(target), speculative_config=spec(drafter, 3, synthetic_acceptance_rate=0.6),
        max_num_batched_tokens=16,
    )  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [torch.randint(4, 128, (k,), generator=rng).tolist() for k in (5, 30, 12)]
    arrivals = {0: [("a", prompts[0], params), ("b", prompts[1], params)],
                3: [("c", prompts[2], params)]}  # fmt: skip
    outs = run_counting_readbacks(llm.engine, arrivals, monkeypatch)
    assert sorted(outs) == ["a", "b", "c"]


def test_first_drafts_match_zlab(random_pair, tmp_path: Path, rng) -> None:
    """The sliding-window drafter's first logits on a hybrid target's features equal z-lab's;
    a config whose sliding layers have their window turned off (`use_sliding_window: false`,
    with which transformers builds no cache for them) is refused at load."""
    import json
    import shutil

    target, drafter = random_pair
    prompt = torch.randint(4, 128, (21,), generator=rng).tolist()
    assert_first_drafts_match_zlab(target, drafter, prompt)
    off = shutil.copytree(drafter, tmp_path / "unwindowed")
    cfg = json.loads((off / "config.json").read_text())
    (off / "config.json").write_text(json.dumps({**cfg, "use_sliding_window": False}))
    with pytest.raises(ValueError, match="use_sliding_window not false"):
        LLM(str(target), speculative_config=spec(off, 7))


@pytest.mark.skipif(not triton_interpreting(), reason="the Triton interpreter on the CPU")
@pytest.mark.parametrize("chunked", [False, True])
def test_fused_verify_keeps_greedy_tokens(tmp_path: Path, monkeypatch, rng, chunked) -> None:
    """With `fuse_gated_deltanet_verify` a hybrid target's Gated DeltaNet layer runs its verify
    forwards and commits through the one-launch kernels (interpreted; every other kernel the
    torch one, and one linear layer of two, to keep the run short; the verify's chunked form
    with `chunked`): two requests, partial acceptance, a prefill chunk beside a verify; the
    same tokens and acceptance lengths as with the option off."""
    calls = []
    for step in ("verify", "commit"):
        name = f"triton_gated_deltanet_{step}"
        kernel = getattr(triton_gated_deltanet_verify, name)
        if chunked and step == "verify":
            kernel = triton_gated_deltanet_verify_chunk.triton_gated_deltanet_verify_chunked

        def spy(*args, _name=name, _kernel=kernel, **kwargs):
            return calls.append(_name) or _kernel(*args, **kwargs)

        getter = f"get_gated_deltanet_{step}_backend"
        monkeypatch.setattr(gated_deltanet, getter, lambda device, _spy=spy: _spy)
    target = make_qwen3_5_checkpoint(
        tmp_path / "target", num_layers=2, layer_types=("linear_attention", "full_attention"),
        linear_heads=(1, 2),
    )  # fmt: skip
    drafter = make_dflash_drafter(tmp_path / "drafter", target, num_layers=1, block_size=4)
    prompts = [torch.randint(4, 128, (k,), generator=rng).tolist() for k in (5, 19)]
    # ~16 verify steps: that none keeps just 1 or 2 of its 3 drafts has odds of about 1 in 2,000.
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))

    def generate(fuse: bool) -> list[tuple[list[int], list[int]]]:
        torch.manual_seed(seed)  # the synthetic acceptance's coins
        llm = LLM(
            str(target), speculative_config=spec(drafter, 3, synthetic_acceptance_rate=0.6),
            kernel_policy=KernelPolicy(backend="torch", fuse_gated_deltanet_verify=fuse),
            max_num_batched_tokens=16,
        )  # fmt: skip
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.spec_accept_lengths) for o in outs]

    fused = generate(True)
    assert "triton_gated_deltanet_verify" in calls and "triton_gated_deltanet_commit" in calls
    calls.clear()
    assert fused == generate(False)
    assert not calls
    assert any(1 < k < 4 for _, lengths in fused for k in lengths[:-1])  # partial acceptance
