"""DFlash on hybrid MoE targets (Qwen3.5-MoE, Qwen3-Next): the first drafts equal z-lab's on
transformers' model; greedy speculative decoding gives plain decoding's tokens, with verify
blocks routed through the experts and the linear-attention states committed at the accepted
length (synthetic acceptance keeps random prefixes)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_dflash_hybrid import DRAFTER_LAYERS, assert_first_drafts_match_zlab, spec

from blockdraft import LLM, SamplingParams

from checkpoints import load_hf_target, make_dflash_drafter, make_hybrid_moe_checkpoint
from sampling_checks import assert_same_token_law, seeded_samples


@pytest.mark.parametrize(
    "family,moe",
    [
        ("qwen3_5_moe", {}),
        ("qwen3_next", {}),
        # As published: the shared expert as wide as the routed ones, stacked after them.
        ("qwen3_5_moe", {"shared_expert_intermediate_size": 16}),
    ],
    ids=["qwen3_5_moe", "qwen3_next", "qwen3_5_moe-shared-stacked"],
)
def test_greedy_lossless_and_bonus_tokens(tmp_path: Path, family: str, moe: dict, rng) -> None:
    """Speculative greedy output equals plain decoding's; under synthetic acceptance (random
    prefixes of random drafts kept) every bonus token is the target's greedy choice given
    everything committed before, which only holds when the states end at the kept drafts."""
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))
    target = make_hybrid_moe_checkpoint(tmp_path / "target", family, num_layers=4, seed=seed, **moe)
    drafter = make_dflash_drafter(tmp_path / "drafter", target, block_size=8, **DRAFTER_LAYERS)
    prompts = [torch.randint(4, 128, (k,), generator=rng).tolist() for k in (1, 9, 23)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    setup = dict(block_size=4, max_num_batched_tokens=16)
    ar = LLM(str(target), **setup).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(target), speculative_config=spec(drafter, 5), **setup)
    stacked = [layer.mlp._stacked is not None for layer in llm.engine.model.model.layers]
    assert all(stacked) == bool(moe) and any(stacked) == bool(moe)
    sd = llm.generate(prompts, params, use_tqdm=False)
    assert [s.outputs[0].token_ids for s in sd] == [a.outputs[0].token_ids for a in ar]
    assert len(llm.engine.block_manager.free_state_slots) == llm.engine.config.max_num_seqs

    synthetic = spec(drafter, 5, synthetic_acceptance_rate=0.6)
    outs = LLM(str(target), speculative_config=synthetic, **setup).generate(
        prompts, params, use_tqdm=False
    )
    hf, partial = load_hf_target(target), 0
    for prompt, out in zip(prompts, outs, strict=True):
        tokens, lengths = out.outputs[0].token_ids, out.spec_accept_lengths
        with torch.no_grad():
            greedy = hf(torch.tensor([prompt + tokens])).logits[0].argmax(-1).tolist()
        bonus = [0]  # the prefill's token, then the last token of every complete step
        for length in lengths[:-1]:  # the last step may stop inside its accepted drafts
            bonus.append(bonus[-1] + length)
        assert [tokens[i] for i in bonus] == [greedy[len(prompt) + i - 1] for i in bonus]
        partial += sum(1 < k < 6 for k in lengths[:-1])
    assert partial >= 2


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
def test_first_drafts_match_zlab(tmp_path: Path, family: str, rng) -> None:
    """The drafter's first logits on the MoE target's captured features equal z-lab's (on
    transformers' model): the features come from the right layers through the experts."""
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))
    target = make_hybrid_moe_checkpoint(tmp_path / "target", family, num_layers=4, seed=seed)
    drafter = make_dflash_drafter(tmp_path / "drafter", target, block_size=8, **DRAFTER_LAYERS)
    prompt = torch.randint(4, 128, (13,), generator=rng).tolist()
    assert_first_drafts_match_zlab(target, drafter, prompt)


@pytest.mark.slow
def test_sampling_is_lossless(tmp_path: Path) -> None:
    """Seeded samples of the tokens that come from verify agree in distribution between plain
    decoding and speculation on a Qwen3.5-MoE target (two-sample chi-square)."""
    target = make_hybrid_moe_checkpoint(tmp_path / "target", "qwen3_5_moe", num_layers=4)
    drafter = make_dflash_drafter(tmp_path / "drafter", target, block_size=4, **DRAFTER_LAYERS)
    prompt, num = [5, 17, 33, 8], 1500
    kw = dict(max_num_seqs=256, max_model_len=32)
    ar = seeded_samples(LLM(str(target), **kw), prompt, num, top_k=6)
    llm = LLM(str(target), speculative_config=spec(drafter, 3), **kw)
    sd = seeded_samples(llm, prompt, num, top_k=6)
    assert llm.engine.spec_stats.num_drafts > 0
    assert_same_token_law(ar, sd, (1, 2))
