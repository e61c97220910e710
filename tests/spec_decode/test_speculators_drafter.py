"""vLLM speculators-format drafters with a reduced draft vocabulary: lossless against plain
decoding, and proposing exactly the full-vocabulary drafter's argmax over the draft vocabulary."""

from pathlib import Path

import pytest
import torch

from blockdraft import LLM, SamplingParams

from checkpoints import (
    make_dflash_drafter,
    make_predictable_target,
    make_qwen3_checkpoint,
    make_speculators_drafter,
)
from sampling_checks import assert_same_token_law, seeded_samples
from spies import spy_draft_logits

VOCAB = 128


def draft_vocab(seed: int, vocab: int, size: int) -> list[int]:
    """A sorted random subset of the target's tokens (the mask token 3 embeds with the
    target's embedding, so it need not be among them)."""
    g = torch.Generator().manual_seed(seed)
    return sorted(torch.randperm(vocab, generator=g)[:size].tolist())


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> dict[str, tuple[Path, Path, Path, list[int]]]:
    """name -> (target, z-lab drafter, the same drafter in speculators format, draft vocab)."""
    root = tmp_path_factory.mktemp("speculators")
    out = {}
    for name, make_target, kw, vocab, size in (
        ("random", make_qwen3_checkpoint, {}, VOCAB, 40),
        ("agreeing", make_predictable_target, {"agree_with_target": True}, 64, 48),
    ):
        target = make_target(root / name, vocab_size=vocab)
        zlab = make_dflash_drafter(root / f"{name}-zlab", target, block_size=8, **kw)
        ids = draft_vocab(len(name), vocab, size)
        spec_dir = make_speculators_drafter(root / f"{name}-spec", zlab, target, ids)
        out[name] = (target, zlab, spec_dir, ids)
    return out


def spec(drafter: Path, n: int) -> dict:
    return {
        "method": "dflash",
        "model": str(drafter),
        "num_speculative_tokens": n,
        "num_speculative_tokens_by_batch": None,
    }


def prompts(rng: torch.Generator, vocab: int = VOCAB) -> list[list[int]]:
    return [torch.randint(4, vocab, (n,), generator=rng).tolist() for n in (1, 6, 17, 30)]


@pytest.mark.parametrize("name", ["random", "agreeing"])
def test_greedy_lossless(pairs, name: str, rng) -> None:
    target, _, drafter, _ = pairs[name]
    ps = prompts(rng, VOCAB if name == "random" else 64)
    params = SamplingParams(temperature=0, max_tokens=29, ignore_eos=True)
    ar = LLM(str(target)).generate(ps, params, use_tqdm=False)
    llm = LLM(str(target), speculative_config=spec(drafter, 7))
    sd = llm.generate(ps, params, use_tqdm=False)
    for a, s in zip(ar, sd, strict=True):
        assert s.outputs[0].token_ids == a.outputs[0].token_ids
        assert 1 + sum(s.spec_accept_lengths) == 29
    if name == "agreeing":
        # Drafts right where the target's token has a draft row, wrong where it has none.
        lengths = [k for s in sd for k in s.spec_accept_lengths]
        assert max(lengths) > 2 and min(lengths) < 8, lengths


def test_proposals_are_the_full_drafters_argmax_over_the_draft_vocab(pairs, rng) -> None:
    """Same layers (aux ids map back to z-lab's target_layer_ids), so the reduced drafter's
    logits are the full drafter's on its rows and -inf elsewhere."""
    target, zlab, drafter, ids = pairs["random"]
    seen, drafters = {}, {}
    prompt = prompts(rng)[2]
    for kind, path in (("full", zlab), ("reduced", drafter)):
        llm = LLM(str(target), speculative_config=spec(path, 7))
        drafters[kind], seen[kind] = llm.engine.proposer.drafter, spy_draft_logits(llm)
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        llm.generate([prompt], params, use_tqdm=False)
    assert drafters["reduced"].cfg.target_layer_ids == drafters["full"].cfg.target_layer_ids
    assert drafters["reduced"].draft_token_ids.tolist() == ids
    # The first proposal (later ones follow different acceptances): the same context.
    full, reduced = seen["full"][0], seen["reduced"][0]
    index = torch.tensor(ids)
    torch.testing.assert_close(reduced[:, index], full[:, index], rtol=1e-5, atol=1e-5)
    outside = torch.ones(VOCAB, dtype=torch.bool).index_fill_(0, index, False)
    assert torch.isneginf(reduced[:, outside]).all()
    assert torch.equal(reduced.argmax(-1), index[full[:, index].argmax(-1)])


@pytest.mark.slow
def test_sampling_is_lossless(pairs) -> None:
    """Seeded samples of the tokens that come from verify agree in distribution between plain
    decoding and a reduced-vocabulary drafter (two-sample chi-square): q is zero outside the
    draft vocabulary and the residual covers those tokens."""
    target, _, drafter, _ = pairs["random"]
    prompt, num = [5, 17, 33, 8], 3000
    kw = dict(max_num_seqs=512, max_model_len=32)
    ar = seeded_samples(LLM(str(target), **kw), prompt, num, top_k=8)
    llm = LLM(str(target), speculative_config=spec(drafter, 3), **kw)
    sd = seeded_samples(llm, prompt, num, top_k=8)
    assert llm.engine.spec_stats.num_drafts > 0
    assert_same_token_law(ar, sd, (1, 2))


def test_dummy_weights_with_a_reduced_vocab(pairs) -> None:
    """load_format="dummy" builds the reduced head from config.json alone."""
    target, _, drafter, ids = pairs["random"]
    llm = LLM(str(target), load_format="dummy", speculative_config=spec(drafter, 3))
    d = llm.engine.proposer.drafter
    assert d.lm_head.weight.shape == (len(ids), 64) and d.lm_head is not llm.engine.model.lm_head
    # ignore_eos: the dummy weights are random, so a greedy token can be eos (CI stopped at one).
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    out = llm.generate([[5, 6, 7]], params, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8
