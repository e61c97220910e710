"""The start-up warm-up (blockdraft/engine/warmup.py): it runs one eager step of every shape it
lists and leaves no trace (the KV pool, the prefix cache and later outputs are those of an
engine that never ran it)."""

import json
from pathlib import Path

import pytest
import torch

from blockdraft import LLM, SamplingParams
from blockdraft.engine import warmup
from blockdraft.engine.warmup import CONTEXT_LENS, DECODE_BATCHES, QUERY_LENS, warmup_shapes
from blockdraft.spec_decode.rejection_sampler import rejection_sample

from checkpoints import make_dflash_drafter, make_qwen3_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.mark.parametrize(("max_model_len", "max_num_seqs"), [(20, 4), (1000, 256), (40960, 8)])
def test_warmup_shapes(max_model_len: int, max_num_seqs: int) -> None:
    shapes = warmup_shapes(max_model_len, max_num_seqs)
    assert len(shapes) == len(set(shapes))
    singles = [(q, ctx) for n, q, ctx in shapes if n == 1]
    assert {q for q, _ in singles} == {q for q in QUERY_LENS if q <= max_model_len}
    # One-row decodes batched up to max_num_seqs.
    assert {(n, q) for n, q, _ in shapes if n > 1} == {
        (b, 1) for b in DECODE_BATCHES if b <= max_num_seqs
    }
    for _, q, ctx in shapes:
        assert 0 <= ctx and q + ctx <= max_model_len
    for n, q in {(n, q) for n, q, _ in shapes}:
        contexts = {c for nn, qq, c in shapes if (nn, qq) == (n, q)}
        # No context, the longest one, and each threshold context where it fits.
        assert {0, max_model_len - q} <= contexts
        assert {c for c in CONTEXT_LENS if c + q <= max_model_len} <= contexts


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("warmup")
    target = make_qwen3_checkpoint(root / "target")
    return target, make_dflash_drafter(root / "drafter", target)


@pytest.mark.parametrize("speculative", [False, True])
def test_warm_up_runs_each_shape_and_leaves_no_trace(
    pair, rng, monkeypatch, speculative: bool
) -> None:
    target, drafter = pair
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    prompts = [torch.randint(4, vocab, (n,), generator=rng).tolist() for n in (3, 9, 21)]
    spec = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": 3,
            "num_speculative_tokens_by_batch": None} if speculative else None  # fmt: skip
    kw = dict(max_model_len=48, block_size=4, enable_prefix_caching=True, speculative_config=spec)
    expected = LLM(str(target), **kw).generate(prompts, GREEDY, use_tqdm=False)

    llm = LLM(str(target), **kw)
    engine = llm.engine
    free = engine.block_manager.num_free_blocks
    launched = []
    launch = engine.runner.launch
    engine.runner.launch = lambda chunks: launched.append(chunks) or launch(chunks)
    verified = []
    monkeypatch.setattr(
        warmup, "rejection_sample", lambda *a: verified.append(a) or rejection_sample(*a)
    )
    engine.warm_up()
    assert [[(len(c.token_ids), c.start) for c in chunks] for chunks in launched] == [
        [(q, ctx)] * n for n, q, ctx in warmup_shapes(48, engine.config.max_num_seqs)
    ]
    # One request samples at a temperature (the sampler's kernels), the rest are greedy; a
    # DFlash engine also runs one sampled verify of N = 3 drafts.
    assert [chunks[0].seq.params.temperature > 0 for chunks in launched].count(True) == 1
    assert [tuple(a[1].shape) for a in verified] == ([(1, 3)] if speculative else [])
    assert engine.warmup_time_s > 0
    assert engine.block_manager.num_free_blocks == free
    assert not engine.block_manager.block_key  # nothing registered in the prefix cache
    assert not engine.has_unfinished_requests()

    got = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    if speculative:
        assert [o.spec_accept_lengths for o in got] == [o.spec_accept_lengths for o in expected]


def test_warm_up_drafts_each_n_that_auto_may_pick(pair, monkeypatch) -> None:
    """With "auto" (N picked step by step) every warm-up step drafts each N it may pick (0-3 on the
    CPU here), and a sampled verify runs for each N that drafts."""
    target, drafter = pair
    spec = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": 3}
    llm = LLM(str(target), max_model_len=48, block_size=4, speculative_config=spec)
    engine = llm.engine
    assert engine.draft_schedule.all_num_drafts == [0, 1, 2, 3]
    drafted = []
    launch = engine.draft_launcher.launch
    engine.draft_launcher.launch = lambda step, n: drafted.append(n) or launch(step, n)
    verified = []
    monkeypatch.setattr(
        warmup, "rejection_sample", lambda *a: verified.append(a) or rejection_sample(*a)
    )
    engine.warm_up()
    num_steps = len(warmup_shapes(48, engine.config.max_num_seqs))
    assert drafted == [0, 1, 2, 3] * num_steps
    assert [tuple(a[1].shape) for a in verified] == [(1, 1), (1, 2), (1, 3)]
