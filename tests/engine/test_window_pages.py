"""The drafter's sliding-window pool: pages follow each request's window (given within reach,
taken back behind it, never shared between live blocks), and an engine that frees them drafts
exactly what one that keeps every block drafts."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from blockdraft import LLM, SamplingParams
from blockdraft.engine.block_manager import BlockManager
from blockdraft.engine.sequence import Sequence
from blockdraft.engine.window_pages import DrafterWindowPages, window_pages_per_seq

from checkpoints import make_dflash_drafter, make_predictable_target
from spies import spy_draft_logits

WINDOW, LOOKAHEAD = 6, 4


def make_seq(tokens: list[int]) -> Sequence:
    return Sequence("r", None, tokens, SamplingParams(), seed=0, max_tokens=1000)


def check_pages(pages: DrafterWindowPages, seqs: list[Sequence], block_size: int) -> None:
    """Every block a request may still read holds a page, no two blocks the same one, and each
    request at most a window's worth."""
    held = []
    for seq in seqs:
        first_key = max(0, seq.num_tokens - WINDOW)
        mine = [pages.page_of[b] for b in seq.block_table]
        for j, page in enumerate(mine):
            if (j + 1) * block_size > first_key:
                assert page != pages.pad_page, (j, seq.num_tokens)
        mine = [p for p in mine if p != pages.pad_page]
        assert len(mine) <= window_pages_per_seq(WINDOW, LOOKAHEAD, block_size)
        held += mine
    assert sorted(held + pages.free_pages) == list(range(pages.num_pages))


def test_pages_follow_each_window(py_rng: random.Random) -> None:
    """Requests grow by prompt chunks and verify steps of random lengths, some are preempted
    (freed, then computed again) and finish; the device map ends equal to the host's."""
    block_size, max_seqs = py_rng.choice([2, 4, 8]), 3
    num_pages = max_seqs * window_pages_per_seq(WINDOW, LOOKAHEAD, block_size)
    pages = DrafterWindowPages(200, num_pages, WINDOW, block_size, torch.device("cpu"))
    manager = BlockManager(200, block_size, False, window_pages=pages)
    seqs = [make_seq([1] * py_rng.randint(1, 30)) for _ in range(max_seqs)]
    for _ in range(60):
        seq = py_rng.choice(seqs)
        action = py_rng.random()
        if action < 0.1:  # preempted, or finished and replaced by a new request
            manager.free(seq)
            seq.num_computed_tokens = 0
            if action < 0.05:
                seqs[seqs.index(seq)] = seq = make_seq([1] * py_rng.randint(1, 30))
        chunk = py_rng.randint(1, 12)
        end = min(seq.num_computed_tokens + chunk, seq.num_tokens)
        caught_up = end >= seq.num_tokens
        assert manager.ensure_capacity(seq, end + (LOOKAHEAD if caught_up else 0))
        seq.num_computed_tokens = end
        if caught_up:  # a verify commits 1 .. LOOKAHEAD tokens
            seq.token_ids += [1] * py_rng.randint(1, LOOKAHEAD)
        check_pages(pages, seqs, block_size)
    pages.apply(*pages.take_updates())
    assert pages.page_map.tolist() == pages.page_of
    assert pages.take_updates() == ([], [])


def test_a_pool_too_small_is_an_engine_error() -> None:
    pages = DrafterWindowPages(10, 1, WINDOW, 4, torch.device("cpu"))
    manager = BlockManager(10, 4, False, window_pages=pages)
    with pytest.raises(RuntimeError, match="window pool ran out of its 1 pages"):
        manager.ensure_capacity(make_seq([1] * 3), 8)


def count_held_pages(llm: LLM) -> list[int]:
    """After each engine step, the pages each running request holds (appended to the list)."""
    held, pages, step = [], llm.engine.block_manager.window_pages, llm.engine.step

    def counting_step():
        outputs = step()
        for seq in llm.engine.scheduler.running:
            held.append(sum(pages.page_of[b] != pages.pad_page for b in seq.block_table))
        return outputs

    llm.engine.step = counting_step
    return held


@pytest.fixture(scope="module")
def dense_pair(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("window-pages")
    target = make_predictable_target(root / "target", arch="qwen3", num_layers=4)
    drafter = make_dflash_drafter(
        root / "drafter", target, block_size=LOOKAHEAD, num_layers=3, sliding_window=WINDOW,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    )  # fmt: skip
    return target, drafter


def test_freed_pages_draft_what_kept_blocks_draft(dense_pair, rng) -> None:
    """With prefix caching the drafter's sliding layers keep every block (shared blocks must
    keep theirs); without, they hold a window's pages per request. The same draft logits at
    every step (a random drafter: they follow its whole window), tokens and accepted lengths,
    greedy and seeded; prompts longer than the window and than a prefill chunk; every request
    within its pages at every step, all pages back at the end."""
    target, drafter = dense_pair
    prompts = [torch.randint(4, 64, (n,), generator=rng).tolist() for n in (5, 23, 41)]
    params = [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=int(torch.randint(0, 2**31, (1,), generator=rng)),
                       max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=33, ignore_eos=True),
    ]  # fmt: skip
    spec = {
        "model": str(drafter),
        "num_speculative_tokens": LOOKAHEAD - 1,
        "num_speculative_tokens_by_batch": None,
    }
    results = []
    for prefix_caching in (True, False):
        llm = LLM(
            str(target), speculative_config=spec, block_size=4, max_num_batched_tokens=16,
            enable_prefix_caching=prefix_caching, num_threads=1,
        )  # fmt: skip
        pages = llm.engine.block_manager.window_pages
        assert (pages is None) == prefix_caching
        if pages is not None:
            held = count_held_pages(llm)
        logits = spy_draft_logits(llm)
        outs = llm.generate(prompts, params, use_tqdm=False)
        results.append([(o.outputs[0].token_ids, o.spec_accept_lengths) for o in outs])
        results.append(logits)
    kept_outputs, kept_logits, freed_outputs, freed_logits = results
    assert freed_outputs == kept_outputs
    assert len(freed_logits) == len(kept_logits) > 10
    for freed, kept in zip(freed_logits, kept_logits, strict=True):
        torch.testing.assert_close(freed, kept, rtol=1e-5, atol=1e-5)
    assert 0 < max(held) <= window_pages_per_seq(WINDOW, LOOKAHEAD, 4) < 80 // 4
    assert pages.num_free_pages == pages.num_pages
