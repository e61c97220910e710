"""Verification of a step's drafts: the verify rows' device inputs (the drafts each request
holds, gathered on the device: the host never reads them), then lossless rejection sampling of
the target's logits at the anchor and draft rows, or the synthetic acceptance of the benchmark
mode."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockdraft.kernels.host_tensors import int64_tensors
from blockdraft.layers.sampler import SamplingTensors
from blockdraft.runtime.sampling_cache import SamplingRequest, SamplingTensorCache
from blockdraft.spec_decode.drafts import DraftBatch, PendingDrafts
from blockdraft.spec_decode.rejection_sampler import rejection_sample


@dataclass
class VerifyInputs:
    """A verify batch's device inputs, prepared before the forward: its drafts are input ids
    that only the device holds."""

    logit_rows: torch.Tensor  # [R * (N+1)] int64: flat rows of each anchor and its drafts
    draft_rows: torch.Tensor  # [R * N] int64: flat rows whose input id is a draft
    drafts: torch.Tensor  # [R, N] int64
    draft_probs: torch.Tensor | None  # [R, N, V] float32; None => drafts are one-hot
    st: SamplingTensors  # one row per request; position = first draft position


def shared_draft_batch(pending: list[PendingDrafts]) -> tuple[DraftBatch | None, list[int]]:
    """The one DraftBatch holding every request's drafts (None when they span several), and
    the rows to take from it ([] when it is taken whole, in order: the usual step, where the
    requests proposed last step are verified now)."""
    batch = pending[0].batch
    if any(d.batch is not batch for d in pending):
        return None, []
    rows = [d.row for d in pending]
    return batch, [] if rows == list(range(batch.tokens.shape[0])) else rows


def gather_drafts(
    pending: list[PendingDrafts],
    batch: DraftBatch | None,  # shared by every request, from shared_draft_batch
    rows: torch.Tensor | None,  # [R] int64 on the device: rows of `batch`; None => all, in order
    num_drafts: int,  # N verified this step: each request's first N (it may hold more)
    need_probs: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # drafts [R, N] int64, probs [R, N, V] f32
    """Each request's drafts to verify, gathered on the device (no sync)."""
    if batch is None:
        return stack_drafts(pending, num_drafts, need_probs)
    tokens = batch.tokens[:, :num_drafts]
    probs = batch.probs[:, :num_drafts] if need_probs and batch.probs is not None else None
    if rows is None:
        return tokens, probs
    return tokens.index_select(0, rows), None if probs is None else probs.index_select(0, rows)


def stack_drafts(
    pending: list[PendingDrafts], num_drafts: int, need_probs: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:  # drafts [R, N] int64, probs [R, N, V] f32
    """Drafts from several propose steps: a request whose verify did not fit the token budget
    kept the drafts of an earlier step (possibly more than N, when the batch was smaller)."""
    tokens = torch.stack([d.batch.tokens[d.row, :num_drafts] for d in pending])
    if not need_probs or all(d.batch.probs is None for d in pending):
        return tokens, None
    vocab = next(d.batch.probs.shape[-1] for d in pending if d.batch.probs is not None)
    # A request proposed in an all-greedy batch has no probabilities: its drafts are one-hot.
    probs = [
        d.batch.probs[d.row, :num_drafts] if d.batch.probs is not None else one_hot_f32(t, vocab)
        for d, t in zip(pending, tokens, strict=True)
    ]
    return tokens, torch.stack(probs)


def one_hot_f32(tokens: torch.Tensor, vocab: int) -> torch.Tensor:  # tokens [N] -> [N, V] f32
    # By scatter: F.one_hot checks its values on the host (a sync) on some devices.
    out = torch.zeros(len(tokens), vocab, dtype=torch.float32, device=tokens.device)
    return out.scatter_(1, tokens[:, None], 1.0)


def synthetic_verify(
    logits: torch.Tensor,  # [R, N+1, V]
    drafts: torch.Tensor,  # [R, N] int64
    acceptance_rate: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # tokens [R, N+1], accepted [R]
    """Benchmark mode: each draft is accepted with a fixed probability (the cost of real
    verification is still paid, by computing the target's argmax)."""
    num_rows, n = drafts.shape
    coin = torch.rand(num_rows, n, device=drafts.device) < acceptance_rate
    accepted = coin.long().cumprod(dim=1).sum(dim=1)
    out = torch.cat([drafts, logits[:, -1:].argmax(-1)], dim=1)
    out.scatter_(1, accepted[:, None], logits.argmax(-1).gather(1, accepted[:, None]))
    return out, accepted


class Verifier:
    """Prepares a verify batch's inputs before the target forward and verifies its logits
    after it, all on the device."""

    def __init__(
        self,
        sampling: SamplingTensorCache,
        device: torch.device,
        synthetic_acceptance_rate: float | None = None,
    ) -> None:
        self.sampling, self.device = sampling, device
        self.synthetic_acceptance_rate = synthetic_acceptance_rate

    def prepare(
        self,
        pending: list[PendingDrafts],  # each verifying request's drafts
        requests: list[SamplingRequest],  # the same requests, for their sampling parameters
        starts: list[int],  # first position each request computes (its anchor's)
        ends: list[int],  # flat row after each request's last (verify) row
        num_drafts: int,  # N verified this step
    ) -> VerifyInputs:
        n = num_drafts
        batch, batch_rows = shared_draft_batch(pending)
        # One transfer for the host-built indices. The first draft sits one past the anchor,
        # the last committed token.
        logit_rows, draft_rows, positions, rows = int64_tensors(
            self.device,
            [e - n - 1 + j for e in ends for j in range(n + 1)],
            [e - n + j for e in ends for j in range(n)],
            [s + 1 for s in starts],
            batch_rows,
        )
        st = self.sampling.get(requests, positions)
        # Greedy verification and the synthetic benchmark mode never read draft probabilities.
        need_probs = not st.all_greedy and self.synthetic_acceptance_rate is None
        drafts, probs = gather_drafts(pending, batch, rows if batch_rows else None, n, need_probs)
        return VerifyInputs(logit_rows, draft_rows, drafts.to(torch.int64), probs, st)

    def verify(
        self,
        v: VerifyInputs,
        logits: torch.Tensor,  # [R, N+1, V] the target's at each anchor and draft row
    ) -> tuple[torch.Tensor, torch.Tensor]:  # tokens [R, N+1], accepted [R], on the device
        if self.synthetic_acceptance_rate is not None:
            return synthetic_verify(logits, v.drafts, self.synthetic_acceptance_rate)
        return rejection_sample(logits, v.drafts, v.draft_probs, v.st)
