"""Verify-input preparation and verification (blockdraft/spec_decode/verify.py) on their own:
which rows a verify batch reads, the drafts it gathers from one or several propose steps, and
the synthetic acceptance of the benchmark mode."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from blockdraft.runtime.sampling_cache import SamplingTensorCache
from blockdraft.sampling_params import SamplingParams
from blockdraft.spec_decode.drafts import DraftBatch, PendingDrafts
from blockdraft.spec_decode.verify import Verifier, shared_draft_batch, synthetic_verify

CPU = torch.device("cpu")
VOCAB = 11


def draft_batch(rng: torch.Generator, rows: int, n: int, sampled: bool) -> DraftBatch:
    tokens = torch.randint(0, VOCAB, (rows, n), generator=rng)
    probs = torch.rand(rows, n, VOCAB, generator=rng) if sampled else None
    return DraftBatch(tokens, probs)


@dataclass(eq=False)  # hashed by identity, as the engine's Sequence
class Request:
    params: SamplingParams
    seed: int


def requests(temperatures: list[float]) -> list[Request]:
    return [Request(SamplingParams(temperature=t), i) for i, t in enumerate(temperatures)]


def test_prepare_reads_each_request_anchor_and_draft_rows(rng) -> None:
    """Request r's anchor and N draft rows end at ends[r]: logits are read at all N+1, the
    drafts are written over the last N, and sampling starts at the first draft's position."""
    n = 3
    batch = draft_batch(rng, 3, 5, sampled=False)
    pending = [PendingDrafts(batch, row) for row in range(3)]
    ends, starts = [4, 9, 13], [7, 20, 2]  # a prefill chunk of 1 row sits before request 1
    v = Verifier(SamplingTensorCache(CPU), CPU).prepare(
        pending, requests([0.0] * 3), starts, ends, n
    )
    assert v.logit_rows.tolist() == [0, 1, 2, 3, 5, 6, 7, 8, 9, 10, 11, 12]
    assert v.draft_rows.tolist() == [1, 2, 3, 6, 7, 8, 10, 11, 12]
    assert torch.equal(v.drafts, batch.tokens[:, :n])
    assert v.draft_probs is None  # greedy verification never reads them
    assert v.st.position.tolist() == [8, 21, 3]


def test_drafts_come_whole_indexed_or_stacked(rng) -> None:
    """The usual step takes last step's batch whole; a subset or another order indexes it;
    drafts from several steps are stacked, a greedy step's as one-hot probabilities."""
    n = 2
    first, second = draft_batch(rng, 3, 4, sampled=True), draft_batch(rng, 2, 3, sampled=False)
    verifier = Verifier(SamplingTensorCache(CPU), CPU)

    def prepare(pending: list[PendingDrafts]):
        k = len(pending)
        return verifier.prepare(
            pending, requests([1.0] * k), [0] * k, [(n + 1) * (i + 1) for i in range(k)], n
        )

    whole = [PendingDrafts(first, r) for r in range(3)]
    assert shared_draft_batch(whole) == (first, [])
    v = prepare(whole)
    assert torch.equal(v.drafts, first.tokens[:, :n])
    assert torch.equal(v.draft_probs, first.probs[:, :n])

    indexed = [PendingDrafts(first, 2), PendingDrafts(first, 0)]
    assert shared_draft_batch(indexed) == (first, [2, 0])
    v = prepare(indexed)
    assert torch.equal(v.drafts, first.tokens[[2, 0], :n])
    assert torch.equal(v.draft_probs, first.probs[[2, 0], :n])

    stacked = [PendingDrafts(second, 1), PendingDrafts(first, 1)]
    assert shared_draft_batch(stacked) == (None, [])
    v = prepare(stacked)
    assert torch.equal(v.drafts, torch.stack([second.tokens[1, :n], first.tokens[1, :n]]))
    one_hot = torch.nn.functional.one_hot(second.tokens[1, :n], VOCAB).float()
    assert torch.equal(v.draft_probs[0], one_hot)
    assert torch.equal(v.draft_probs[1], first.probs[1, :n])


@pytest.mark.parametrize("rate", [0.0, 0.5, 1.0])
def test_synthetic_verify_accepts_a_prefix_then_the_target_token(rng, rate: float) -> None:
    """Each request keeps a prefix of its drafts (none at rate 0, all at rate 1), then the
    target's argmax at the row after them."""
    num_rows, n = 64, 4
    logits = torch.randn(num_rows, n + 1, VOCAB, generator=rng)
    drafts = torch.randint(0, VOCAB, (num_rows, n), generator=rng)
    tokens, accepted = synthetic_verify(logits, drafts, rate)
    if rate in (0.0, 1.0):
        assert accepted.eq(int(rate) * n).all()
    else:
        assert 0 < accepted.float().mean() < n
    argmax = logits.argmax(-1)
    for r, a in enumerate(accepted.tolist()):
        assert tokens[r, :a].tolist() == drafts[r, :a].tolist()
        assert tokens[r, a] == argmax[r, a]
