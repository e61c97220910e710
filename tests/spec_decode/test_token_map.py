"""Token maps (SGLang's speculative_token_map): a full-vocabulary drafter cut to a set of target
tokens proposes the full drafter's argmax over them, stays lossless greedy and sampled, and a
bad map or an unusable combination is refused with a message that names it."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from blockdraft import LLM, SamplingParams
from blockdraft.cli import _speculative_config, build_parser
from blockdraft.config import SpeculativeConfig
from blockdraft.engine.model_loader import apply_token_map
from blockdraft.models.draft_vocab import TOKEN_MAP_FILE, read_token_map

from checkpoints import (
    make_dflash_drafter,
    make_predictable_target,
    make_qwen3_checkpoint,
    make_speculators_drafter,
)
from dflash2_checkpoints import make_dflash2_drafter
from sampling_checks import assert_same_token_law, seeded_samples
from spies import spy_proposals

VOCAB = 128


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("token-map")
    random_target = make_qwen3_checkpoint(root / "random", vocab_size=VOCAB)
    agreeing_target = make_predictable_target(root / "agreeing", vocab_size=64)
    return {
        "random": (random_target, make_dflash_drafter(root / "rd", random_target, block_size=8)),
        "agreeing": (
            agreeing_target,
            make_dflash_drafter(root / "ad", agreeing_target, block_size=8, agree_with_target=True),
        ),
    }


def spec(drafter: Path, n: int, token_map: str | None) -> dict:
    return {
        "method": "dflash",
        "model": str(drafter),
        "num_speculative_tokens": n,
        "num_speculative_tokens_by_batch": None,
        "token_map": token_map,
    }


def write_map(path: Path, ids: list[int]) -> str:
    if path.suffix == ".json":
        path.write_text(json.dumps(ids))
    else:
        torch.save(torch.tensor(ids, dtype=torch.int32), path)
    return str(path)


def random_map(rng: torch.Generator, vocab: int, size: int) -> list[int]:
    """Distinct ids in a random order (the map file need not be sorted)."""
    return torch.randperm(vocab, generator=rng)[:size].tolist()


def spy_logits(llm: LLM) -> list[torch.Tensor]:
    drafter, seen = llm.engine.proposer.drafter, []
    original = drafter.compute_logits
    drafter.compute_logits = lambda h, **kw: seen.append(original(h, **kw)) or seen[-1]
    return seen


@pytest.mark.parametrize("suffix", [".pt", ".json"])
def test_proposals_are_the_full_drafters_argmax_over_the_map(pairs, tmp_path, suffix, rng):
    target, drafter = pairs["random"]
    prompt = torch.randint(4, VOCAB, (17,), generator=rng).tolist()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    full_llm = LLM(str(target), speculative_config=spec(drafter, 7, None))
    full_logits = spy_logits(full_llm)
    full_llm.generate([prompt], params, use_tqdm=False)
    full = full_logits[0]  # the first proposal: the same context in both engines
    assert full_llm.engine.proposer.drafter.lm_head is full_llm.engine.model.lm_head
    # 40 random tokens without the full drafter's first pick, so the map changes a draft.
    others = [t for t in random_map(rng, VOCAB, VOCAB) if t != int(full[0].argmax())]
    ids = others[:40]
    path = write_map(tmp_path / f"map{suffix}", ids)
    llm = LLM(str(target), speculative_config=spec(drafter, 7, path))
    cut_logits = spy_logits(llm)
    llm.generate([prompt], params, use_tqdm=False)
    assert llm.engine.proposer.drafter.lm_head is not llm.engine.model.lm_head
    index = torch.tensor(sorted(ids))
    cut = cut_logits[0]
    torch.testing.assert_close(cut[:, index], full[:, index], rtol=1e-5, atol=1e-5)
    outside = torch.ones(VOCAB, dtype=torch.bool).index_fill_(0, index, False)
    assert torch.isneginf(cut[:, outside]).all()
    assert torch.equal(cut.argmax(-1), index[full[:, index].argmax(-1)])
    assert cut[0].argmax() != full[0].argmax()


def test_greedy_lossless_with_a_map(pairs, tmp_path, rng) -> None:
    """A map without some of the tokens the target produces: those drafts cannot land, the
    others do, and the output is plain decoding's."""
    target, drafter = pairs["agreeing"]
    path = write_map(tmp_path / "map.pt", random_map(rng, 64, 44))
    prompts = [torch.randint(4, 64, (n,), generator=rng).tolist() for n in (1, 6, 17, 30)]
    params = SamplingParams(temperature=0, max_tokens=29, ignore_eos=True)
    ar = LLM(str(target)).generate(prompts, params, use_tqdm=False)
    full = LLM(str(target), speculative_config=spec(drafter, 7, None))
    cut = LLM(str(target), speculative_config=spec(drafter, 7, path))
    sd_full = full.generate(prompts, params, use_tqdm=False)
    sd_cut = cut.generate(prompts, params, use_tqdm=False)
    for a, f, c in zip(ar, sd_full, sd_cut, strict=True):
        assert c.outputs[0].token_ids == f.outputs[0].token_ids == a.outputs[0].token_ids
    stats_full, stats_cut = full.engine.spec_stats, cut.engine.spec_stats
    assert stats_cut.mean_acceptance_length < stats_full.mean_acceptance_length
    assert max(k for s in sd_cut for k in s.spec_accept_lengths) > 2


@pytest.mark.slow
def test_sampling_is_lossless_with_a_map(pairs, tmp_path, rng) -> None:
    """Seeded samples of the tokens that come from verify agree in distribution with plain
    decoding (two-sample chi-square): q is zero outside the map, the residual covers it."""
    target, drafter = pairs["random"]
    path = write_map(tmp_path / "map.pt", random_map(rng, VOCAB, 40))
    prompt, num = [5, 17, 33, 8], 3000
    kw = dict(max_num_seqs=512, max_model_len=32)
    ar = seeded_samples(LLM(str(target), **kw), prompt, num, top_k=8)
    llm = LLM(str(target), speculative_config=spec(drafter, 3, path), **kw)
    sd = seeded_samples(llm, prompt, num, top_k=8)
    assert llm.engine.spec_stats.num_drafts > 0
    assert_same_token_law(ar, sd, (1, 2))


def test_auto_takes_the_map_a_drafter_directory_ships(pairs, tmp_path, rng) -> None:
    target, drafter = pairs["random"]
    shipped = tmp_path / "drafter"
    shutil.copytree(drafter, shipped)
    ids = random_map(rng, VOCAB, 50)
    write_map(shipped / TOKEN_MAP_FILE, ids)
    for path, token_map, rows in (
        (shipped, "auto", 50),
        (shipped, None, VOCAB),
        (drafter, "auto", VOCAB),  # nothing shipped: the whole vocabulary
    ):
        llm = LLM(str(target), speculative_config=spec(path, 3, token_map))
        d = llm.engine.proposer.drafter
        assert d.lm_head.weight.shape[0] == rows
        if rows == 50:
            assert d.draft_token_ids.tolist() == sorted(ids)
        llm.shutdown()


def test_auto_leaves_the_head_whole_under_tensor_parallelism(pairs, tmp_path, rng) -> None:
    target, drafter = pairs["random"]
    shipped = tmp_path / "drafter"
    shutil.copytree(drafter, shipped)
    write_map(shipped / TOKEN_MAP_FILE, random_map(rng, VOCAB, 50))
    llm = LLM(str(target), speculative_config=spec(drafter, 3, None))
    d = llm.engine.proposer.drafter
    head = d.lm_head
    apply_token_map(d, SpeculativeConfig(**spec(shipped, 3, "auto")), tp_size=2)
    assert d.lm_head is head and d.draft_token_ids is None
    apply_token_map(d, SpeculativeConfig(**spec(shipped, 3, "auto")), tp_size=1)
    assert d.lm_head.weight.shape[0] == 50


def test_default_drafter_ships_a_map() -> None:
    """The shipped drafter drafts from its 16,384-token map unless told otherwise."""
    auto = LLM(device="cpu", speculative_config={"method": "dflash", "model": "default"})
    d = auto.engine.proposer.drafter
    assert d.lm_head.weight.shape[0] == 16384 < auto.engine.model.cfg.vocab_size
    out = auto.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
    ar = LLM(device="cpu", speculative_config=None)
    ref = ar.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
    assert out[0].outputs[0].token_ids == ref[0].outputs[0].token_ids
    whole = LLM(speculative_config={"method": "dflash", "model": "default", "token_map": None})
    assert whole.engine.proposer.drafter.lm_head is whole.engine.model.lm_head


@pytest.mark.parametrize(
    "content, message",
    [
        ([3, 9, 3], "lists token 3 twice"),
        ([3, 200], "outside the target's vocabulary of 128"),
        ([-1, 4], "outside"),
        ([], "at least one integer token id"),
        (torch.tensor([1.0, 2.0]), "1-D list or tensor of integer token ids"),
        (torch.tensor([[1, 2]]), "1-D list or tensor"),
        (torch.tensor([True, False]), "at least one integer token id"),
        ({"ids": [1, 2]}, "1-D list or tensor"),
        (["a", "b"], "1-D list or tensor"),
        (b"\x00garbage", "cannot be read"),
    ],
)
def test_bad_maps_are_named(tmp_path, content, message) -> None:
    suffix = ".pt" if isinstance(content, torch.Tensor | bytes) else ".json"
    path = tmp_path / f"map{suffix}"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif suffix == ".pt":
        torch.save(content, path)
    else:
        path.write_text(json.dumps(content))
    with pytest.raises(ValueError, match=message):
        read_token_map(str(path), VOCAB)


def test_bad_configs_are_named(pairs, tmp_path) -> None:
    target, drafter = pairs["random"]
    path = write_map(tmp_path / "map.pt", [4, 5, 6])
    cases = [
        (spec(drafter, 3, str(tmp_path / "missing.pt")), {}, "does not exist"),
        (spec(drafter, 3, str(tmp_path / "map.txt")), {}, "must be a .pt"),
        (spec(drafter, 3, 7), {}, "must be a file path, 'auto' or None"),
        (spec(drafter, 3, path), {"tensor_parallel_size": 2}, "not supported with tensor_paral"),
    ]
    for config, kw, message in cases:
        with pytest.raises(ValueError, match=message):
            LLM(str(target), speculative_config=config, **kw)


def test_a_map_over_a_reduced_vocabulary_is_refused(pairs, tmp_path) -> None:
    target, drafter = pairs["random"]
    reduced = make_speculators_drafter(tmp_path / "spec", drafter, target, list(range(40)))
    path = write_map(tmp_path / "map.pt", [4, 5, 6])
    with pytest.raises(ValueError, match="already scores a reduced vocabulary"):
        LLM(str(target), speculative_config=spec(reduced, 3, path))


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--speculative-token-map", "none"], {"model": "default", "token_map": None}),
        (["--speculative-token-map", "m.pt"], {"model": "default", "token_map": "m.pt"}),
        (["--draft", "d", "--speculative-token-map", "m.pt"], {"model": "d", "token_map": "m.pt"}),
        ([], "auto"),
    ],
)
def test_cli_flag(args: list[str], expected) -> None:
    parsed = build_parser().parse_args(["generate", "hi", *args])
    got = _speculative_config(parsed)
    if isinstance(expected, dict):
        assert {k: got[k] for k in expected} == expected
    else:
        assert got == expected


@pytest.mark.parametrize(
    "args, message",
    [
        (["--draft", "none", "--speculative-token-map", "m.pt"], "--draft none turns"),
        (["--model", "x", "--speculative-token-map", "m.pt"], "--speculative-token-map needs a"),
    ],
)
def test_cli_flag_without_a_drafter(args: list[str], message: str) -> None:
    parsed = build_parser().parse_args(["generate", "hi", *args])
    with pytest.raises(ValueError, match=message):
        _speculative_config(parsed)


def test_dflash2_drafts_only_from_the_map(tmp_path, rng) -> None:
    """The candidate selector picks among the map's tokens, greedy and sampled (its proposal
    probabilities span the target's vocabulary, not the cut head's rows)."""
    target = make_qwen3_checkpoint(tmp_path / "target", vocab_size=VOCAB)
    drafter = make_dflash2_drafter(tmp_path / "drafter", target, block_size=8, seed=5)
    ids = random_map(rng, VOCAB, 40)
    path = write_map(tmp_path / "map.pt", ids)
    prompts = [torch.randint(4, VOCAB, (n,), generator=rng).tolist() for n in (5, 19)]
    llm = LLM(str(target), speculative_config=spec(drafter, 7, path))
    seen = spy_proposals(llm)
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ar = LLM(str(target)).generate(prompts, greedy, use_tqdm=False)
    sd = llm.generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in sd] == [o.outputs[0].token_ids for o in ar]
    sampled = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True, seed=3)
    assert all(
        len(o.outputs[0].token_ids) == 20 for o in llm.generate(prompts, sampled, use_tqdm=False)
    )
    drafted = torch.cat([t.flatten() for t in seen])
    assert drafted.numel() > 0 and torch.isin(drafted, torch.tensor(ids)).all()
