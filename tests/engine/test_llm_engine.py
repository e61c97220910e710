"""Greedy output of the batched engine equals transformers' greedy generate, token for token,
under chunked prefill, preemption and prefix caching."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from blockdraft import LLM, SamplingParams

from checkpoints import make_llama_checkpoint, make_qwen3_checkpoint

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
            torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )
        outs.append(ids[0, len(p):].tolist())
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
