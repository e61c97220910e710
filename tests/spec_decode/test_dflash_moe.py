"""DFlash on Qwen3-MoE targets: the drafter reads features captured from MoE layers' outputs as
transformers' `output_hidden_states` gives them (first-draft logits, tokens and per-step
acceptance lengths equal to z-lab's `dflash_generate`), and speculation stays lossless against
plain decoding, greedy and sampled."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from blockdraft import LLM, SamplingParams

from checkpoints import (
    make_dflash_drafter,
    make_predictable_target,
    make_qwen3_moe_checkpoint,
    zlab_first_draft_logits,
    zlab_full_block_steps,
    zlab_generate,
)
from sampling_checks import assert_same_token_law, seeded_samples


def spec(drafter: Path, n: int) -> dict:
    # Drafts at every batch size: the CPU's "auto" schedule would stop them from 4 requests on.
    return {
        "method": "dflash",
        "model": str(drafter),
        "num_speculative_tokens": n,
        "num_speculative_tokens_by_batch": None,
    }


def random_prompts(target: Path, rng: torch.Generator, lengths: list[int]) -> list[list[int]]:
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    return [torch.randint(4, vocab, (n,), generator=rng).tolist() for n in lengths]


@pytest.mark.parametrize("kind", ["random", "varying-acceptance"])
def test_matches_zlab_reference(tmp_path: Path, kind: str, rng) -> None:
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))
    if kind == "random":  # features of a sparse and a dense layer, and the final-normed last
        target = make_qwen3_moe_checkpoint(
            tmp_path / "target", num_layers=4, top_k=3, mlp_only_layers=(1,), seed=seed
        )
        drafter_kw = dict(target_layer_ids=[0, 1, 3])
    else:
        target = make_predictable_target(tmp_path / "target", arch="qwen3_moe", num_layers=4)
        drafter_kw = dict(agree_with_target=True, draft_error_rate=0.15)
    prompt = random_prompts(target, rng, [19])[0]
    max_new = 30
    for attempt in range(5):
        drafter = make_dflash_drafter(
            tmp_path / f"drafter{attempt}", target, block_size=8, seed=seed + attempt, **drafter_kw
        )
        ref_tokens, ref_lengths = zlab_generate(target, drafter, prompt, max_new_tokens=max_new)
        # A drafter whose wrong drafts all miss this short run accepts every block whole:
        # take the next seed.
        if kind == "random" or len(set(ref_lengths[:-1])) > 1:
            break
    ref_logits = zlab_first_draft_logits(target, drafter, prompt)
    llm = LLM(str(target), speculative_config=spec(drafter, 7), block_size=4)
    seen: list[torch.Tensor] = []
    drafter_model = llm.engine.proposer.drafter
    original = drafter_model.compute_logits
    drafter_model.compute_logits = lambda h, **kw: seen.append(original(h, **kw)) or seen[-1]
    params = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert (seen[0] - ref_logits).abs().max() / ref_logits.abs().max() < 1e-4
    assert out.outputs[0].token_ids == ref_tokens
    full_steps = zlab_full_block_steps(ref_lengths, max_new, block_size=8)
    assert full_steps >= 3
    assert out.spec_accept_lengths[:full_steps] == ref_lengths[:full_steps]
    if kind == "varying-acceptance":
        assert len(set(ref_lengths[:-1])) > 1 and max(ref_lengths) > 4


@pytest.mark.parametrize("kind", ["random", "agreeing"])
def test_greedy_lossless(moe_pairs, kind: str, rng) -> None:
    """Prompts of several lengths in one batch, chunked prefill among verifies."""
    target, drafter = moe_pairs[kind]
    prompts = random_prompts(target, rng, [1, 5, 16, 27])
    params = SamplingParams(temperature=0, max_tokens=29, ignore_eos=True)
    kw = dict(max_num_batched_tokens=24)
    ar = LLM(str(target), **kw).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(target), speculative_config=spec(drafter, 7), **kw)
    sd = llm.generate(prompts, params, use_tqdm=False)
    assert [s.outputs[0].token_ids for s in sd] == [a.outputs[0].token_ids for a in ar]
    if kind == "agreeing":
        assert llm.engine.spec_stats.mean_acceptance_length > 0.8 * 8


def test_sampling_is_lossless(moe_pairs) -> None:
    """Seeded samples of the first tokens agree between speculative and plain decoding
    (two-sample chi-square on the tokens that come from verifies)."""
    target, drafter = moe_pairs["random"]
    prompt, num = [5, 17, 33, 8], 1500
    kw = dict(max_num_seqs=512, max_model_len=32)
    ar = seeded_samples(LLM(str(target), **kw), prompt, num, top_k=6)
    llm = LLM(str(target), speculative_config=spec(drafter, 3), **kw)
    sd = seeded_samples(llm, prompt, num, top_k=6)
    assert llm.engine.spec_stats.num_drafts > 0
    assert_same_token_law(ar, sd, (1, 2))
