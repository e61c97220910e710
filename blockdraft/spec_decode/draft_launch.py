"""Queues a speculative step's drafter work right behind the target's, before the step's one
readback: context K/V of the committed rows, the drafter's forward over the proposing requests'
blocks, and draft sampling. Everything data-dependent (how many drafts each verify accepted,
the new anchor tokens) is taken from the device results of the target step, so the GPU runs
the drafter while the host waits for the readback and does the step's bookkeeping.

Every request whose chunk completes (a decode, a last prefill chunk, a verify) proposes, even
if the tokens it is about to read back finish it: the host only learns that after the readback,
and such a request simply drops its drafts. Its drafter block p .. p+N lies in blocks the
scheduler reserved for a caught-up request (`Scheduler._capacity_needed`), so it writes only
the request's own slots. A chunk that does not complete (mid-prefill) writes its context and
drafts nothing.

While the batch drafts nothing (N = 0, chosen when drafts would not pay), the committed rows'
context K/V is deferred: their features are kept and written in one batched pass when drafting
resumes or DEFERRED_CONTEXT_MAX_BYTES of them wait. A step at N = 0 then costs what plain
decoding costs: the drafter's projections of one row each step are weight-bound, while a
batched write of many rows reads the same weights once. Under async decode such steps are
launched one ahead like an engine without a drafter's (blockdraft/engine/async_decode.py);
theirs and any plain decode step's rows are kept from the host's positions and slots (one row
a request), with no drafter inputs built, and their features where the decode graph itself
copied them (blockdraft/runtime/feature_ring.py): such a step keeps no tensor of its own.
Deferred rows are written before any later context write and before any drafter forward (the
only reader), and before rows of a block they lie in are deferred for its next owner (a
finished request's freed block taken by another request), so the cache ends as if written at
once: one write never holds two rows for one slot. A finished request's rows may thus wait: a
later request may still read them through the prefix cache, and a write of many requests'
rows costs what a write of one's does.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from blockdraft.kernels.dflash_inputs import DFlashInputs
from blockdraft.kernels.host_tensors import int64_tensors
from blockdraft.runtime.feature_ring import FeatureRing
from blockdraft.runtime.host_batch import decode_slots, padded_block_tables
from blockdraft.runtime.sampling_cache import SamplingRequest, SamplingTensorCache
from blockdraft.spec_decode.drafts import DraftBatch, PendingDrafts
from blockdraft.spec_decode.proposer import DFlashProposer

# Deferred context is written at once at the latest when its features reach
# DEFERRED_CONTEXT_MAX_BYTES (~11,600 rows of SmolLM2-135M's 5 x 576 bf16 features, ~1,300 of
# a 27B target's 5 x 5120), and never held back for fewer than DEFERRED_CONTEXT_MIN_ROWS. A
# write costs ~15 eager launches however many rows it takes, which a small host-bound target
# pays in full: at 256 rows a batch of 16 paid a ~1.8 ms write every 16th ~1.1 ms step on an
# H200, at 64 rows every 4th (host_ops.py: 40 ops a step at N = 0 against plain decoding's 25).
DEFERRED_CONTEXT_MAX_BYTES = 64 << 20
DEFERRED_CONTEXT_MIN_ROWS = 256


@dataclass
class TargetStep:
    """A target step launched and not read back, as the drafter sees it: the chunks' layout on
    the host, the step's results on the device."""

    starts: list[int]  # [C] first position each chunk computes
    query_lens: list[int]  # [C] its rows
    row_ends: list[int]  # [C] flat row after its last row
    completes: list[bool]  # [C] whether it leaves its request with logits for a next token
    block_tables: list[list[int]]  # [C] its request's blocks
    requests: list[SamplingRequest]  # [C] its request, for the drafts' sampling parameters
    decode: list[int]  # chunks that sampled a next token (decode, last prefill chunk)
    verify: list[int]  # chunks that verified drafts
    sampled: torch.Tensor | None  # [len(decode)] int64 next tokens
    verify_tokens: torch.Tensor | None  # [len(verify), N+1] int64, -1 past the bonus token
    num_accepted: torch.Tensor | None  # [len(verify)] int64 accepted drafts
    features: torch.Tensor  # [num_tokens, K * hidden] target features
    feature_ring_start: int | None = None  # where a decode graph also left them (FeatureRing)


@dataclass
class DeferredContext:
    """Committed rows whose drafter context K/V is not written yet: rows of a step's context
    inputs (positions and slots on the device, PAD where not committed), and rows of plain
    decode steps (one a request) as the host has them: positions and block tables (a table
    only grows while its request holds it; a freed request gets a new list), whose slots and
    blocks are worked out only when the rows are written or checked, and features cloned
    (eager steps) or left in the feature ring by the decode graph."""

    features: list[torch.Tensor] = field(default_factory=list)  # [rows, K * hidden] each
    positions: list[torch.Tensor] = field(default_factory=list)  # [rows] int64 each
    slots: list[torch.Tensor] = field(default_factory=list)  # [rows] int64 each
    blocks: set[int] = field(default_factory=set)  # KV blocks the rows may lie in (`lies_in`)
    # (features [rows, K * hidden] or the unwrapped feature ring row of the first, positions
    # [rows], block tables [rows]) of each decode step
    decode_steps: list[tuple[torch.Tensor | int, list[int], list[list[int]]]] = field(
        default_factory=list
    )
    first_ring_row: int | None = None  # of the first decode step whose features the ring holds
    num_rows: int = 0
    blocks_seen: int = 0  # decode steps whose blocks `blocks` holds

    def add(self, features: torch.Tensor, inputs: DFlashInputs, blocks: set[int]) -> None:
        # Copies: the features and index buffers are reused by the next step.
        self.features.append(features.clone())
        self.positions.append(inputs.context_positions.clone())
        self.slots.append(inputs.context_slot_mapping.clone())
        self.num_rows += features.shape[0]
        self.blocks |= blocks

    def add_decode_rows(
        self,
        features: torch.Tensor | int,  # [rows, K * hidden] (copied), or a ring row (FeatureRing)
        positions: list[int],  # [rows]
        block_tables: list[list[int]],  # [rows]
    ) -> None:
        if isinstance(features, int):
            if self.first_ring_row is None:
                self.first_ring_row = features
        else:
            features = features.clone()
        self.decode_steps.append((features, positions, block_tables))
        self.num_rows += len(positions)

    def lies_in(self, blocks: set[int], block_size: int) -> bool:
        """Whether some row may lie in one of `blocks`. The decode steps' blocks are added to
        `blocks` here, each step's once: nothing a step while no block changes hands."""
        if not blocks:
            return False
        for _, positions, tables in self.decode_steps[self.blocks_seen :]:
            self.blocks.update([t[p // block_size] for p, t in zip(positions, tables, strict=True)])
        self.blocks_seen = len(self.decode_steps)
        return not blocks.isdisjoint(self.blocks)

    def tensors(
        self, device: torch.device, ring: FeatureRing | None, block_size: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # features, positions, slots
        """Every row: those of context inputs, then those of decode steps with features of
        their own, then those whose features the feature `ring` holds."""
        positions, slots = list(self.positions), list(self.slots)
        cloned = [step for step in self.decode_steps if not isinstance(step[0], int)]
        in_ring = [step for step in self.decode_steps if isinstance(step[0], int)]
        features = self.features + [f for f, _, _ in cloned]
        if in_ring:
            features.append(ring.gather([(start, len(rows)) for start, rows, _ in in_ring]))
        if self.decode_steps:
            steps = cloned + in_ring
            decode = int64_tensors(
                device,
                [p for _, rows, _ in steps for p in rows],
                [s for _, rows, tables in steps for s in decode_slots(tables, rows, block_size)],
            )
            positions.append(decode[0])
            slots.append(decode[1])
        return torch.cat(features), torch.cat(positions), torch.cat(slots)


@dataclass
class LaunchedDrafts:
    batch: DraftBatch  # on the device, one row per proposer
    proposers: list[int]  # the chunk of each row

    def pending(self) -> Iterator[tuple[int, PendingDrafts]]:
        """(chunk, the drafts its request holds for its next verify) of each row."""
        for row, chunk in enumerate(self.proposers):
            yield chunk, PendingDrafts(self.batch, row)


class DraftLauncher:
    def __init__(
        self,
        proposer: DFlashProposer,
        sampling: SamplingTensorCache,
        device: torch.device,
        defer_context: bool = True,
    ) -> None:
        self.proposer, self.sampling, self.device = proposer, sampling, device
        self.defer_context = defer_context
        self.deferred = DeferredContext()
        # Where the target's decode graphs keep their features (set with the graphs).
        self.feature_ring: FeatureRing | None = None
        # Rows deferred at most besides DEFERRED_CONTEXT_MAX_BYTES of features (None: no other
        # bound). A drafter with a sliding window sets its window less a block: older rows'
        # pages may be reused.
        self.max_deferred_rows: int | None = None

    def deferred_row_limit(self, row_bytes: int) -> int:
        """How many rows of features of `row_bytes` bytes each may wait at most."""
        limit = max(DEFERRED_CONTEXT_MIN_ROWS, DEFERRED_CONTEXT_MAX_BYTES // row_bytes)
        if self.max_deferred_rows is not None:
            limit = min(limit, self.max_deferred_rows)
        return limit

    def _fits(self, features: torch.Tensor, rows: int) -> bool:
        """Whether `rows` more rows of `features`' width may wait with those deferred."""
        row_bytes = features.shape[-1] * features.element_size()
        return self.deferred.num_rows + rows <= self.deferred_row_limit(row_bytes)

    def write_deferred(self) -> None:
        """Writes the deferred context rows in one pass (nothing when none wait)."""
        if not self.deferred.num_rows:
            return
        deferred = self.deferred.tensors(self.device, self.feature_ring, self.proposer.block_size)
        self.proposer.drafter.write_context(*deferred)
        self.deferred = DeferredContext()

    def defer_decode_rows(
        self,
        features: torch.Tensor,  # [>= rows, K * hidden], row i request i's
        positions: list[int],  # [rows] each request's one row
        block_tables: list[list[int]],  # [rows]
        write_deferred_first: bool = False,
        ring_start: int | None = None,  # where the decode graph left the features (FeatureRing)
    ) -> None:
        """Keeps a plain decode step's rows (one a request, its position and slot known on the
        host) for the deferred write; builds no drafter inputs. Called every step of a batch
        that drafts nothing, so it takes the host's lists as they are (no `TargetStep`, built
        for one row a request): on a small target the host's time per step is the step's."""
        rows = len(positions)
        if write_deferred_first or not self._fits(features, rows):
            self.write_deferred()
        deferred = self.deferred
        if ring_start is None:
            deferred.add_decode_rows(features[:rows], positions, block_tables)
        else:
            deferred.add_decode_rows(ring_start, positions, block_tables)
            # Before the next replay could wrap onto rows kept.
            if self.feature_ring.would_overwrite(deferred.first_ring_row):
                self.write_deferred()

    def deferred_rows_lie_in(self, blocks: set[int]) -> bool:
        """Whether a deferred row may lie in one of `blocks` (KV blocks)."""
        return self.deferred.lies_in(blocks, self.proposer.block_size)

    def _blocks_written(self, step: TargetStep) -> set[int]:
        """The KV blocks `step`'s rows lie in (a verify's rejected rows' too)."""
        size = self.proposer.block_size
        return {
            b
            for start, n, table in zip(step.starts, step.query_lens, step.block_tables, strict=True)
            for b in table[start // size : (start + n - 1) // size + 1]
        }

    def launch(
        self, step: TargetStep, num_drafts: int, write_deferred_first: bool = False
    ) -> LaunchedDrafts | None:
        """Queues context K/V for every committed row of `step`, then N drafts for each request
        whose chunk completes; None when none does (or N = 0: the context only). Reads nothing
        back. `write_deferred_first`: a block some deferred row lies in passed to another
        request, whose rows must land after it (`LLMEngine.deferred_rows_may_be_overwritten`)."""
        verify = set(step.verify)
        num_chunks = len(step.starts)
        rows = step.row_ends[-1]
        defer = self.defer_context and not num_drafts
        if defer and rows == num_chunks and not step.verify:
            # A plain decode step (one row a request), synchronous or launched ahead by async
            # decode: no drafter inputs (on one CPU thread they cost a tiny target's
            # never-drafting step ~0.2 ms over plain decoding's).
            self.defer_decode_rows(
                step.features,
                step.starts,
                step.block_tables,
                write_deferred_first,
                step.feature_ring_start,
            )
            return None
        if not defer or write_deferred_first or not self._fits(step.features, rows):
            self.write_deferred()
        proposers = [i for i, done in enumerate(step.completes) if done] if num_drafts else []
        tables = padded_block_tables(step.block_tables)
        # Committed rows known on the host: a prefill chunk's all, a verify's anchor (its
        # accepted drafts are added on the device).
        host_num_ctx = [1 if i in verify else n for i, n in enumerate(step.query_lens)]
        row_start, num_ctx, starts, decode_idx, verify_idx, proposers_gpu, flat_tables = (
            int64_tensors(
                self.device,
                [end - n for end, n in zip(step.row_ends, step.query_lens, strict=True)],
                host_num_ctx,
                step.starts,
                step.decode,
                step.verify,
                proposers,
                [b for t in tables for b in t],
            )
        )
        block_tables = flat_tables.view(num_chunks, -1)  # [C, W]
        anchor_tokens = torch.zeros(num_chunks, dtype=torch.int64, device=self.device)
        if step.decode:
            anchor_tokens.index_copy_(0, decode_idx, step.sampled)
        if step.verify:
            accepted = step.num_accepted  # [V]
            num_ctx = num_ctx.index_add(0, verify_idx, accepted)
            # The bonus / corrected token sits right after the accepted drafts.
            bonus = step.verify_tokens.gather(1, accepted[:, None]).squeeze(1)
            anchor_tokens.index_copy_(0, verify_idx, bonus)
        anchor_positions = starts + num_ctx  # [C]: right after the committed rows

        inputs = self.proposer.prepare_inputs(
            anchor_tokens,
            anchor_positions,
            row_start,
            num_ctx,
            proposers_gpu,
            block_tables,
            max(num_drafts, 1),  # N = 0 has no proposers: no block rows to lay out
            step.row_ends[-1],
        )
        num_props, q = len(proposers), num_drafts + 1
        # A uniform step (every request verified N and proposes N): its context rows are the
        # block rows, and the block run writes them (inside the drafter graph when captured).
        uniform = num_props == len(step.verify) == num_chunks and all(
            n == q for n in step.query_lens
        )
        if defer:
            self.deferred.add(step.features[:rows], inputs, self._blocks_written(step))
        elif not uniform:
            self.proposer.write_context(step.features, inputs)
        if not proposers:
            return None
        if num_props < num_chunks:
            block_tables = block_tables.index_select(0, proposers_gpu)
        # A drafting chunk's anchor is at most one past its last row (a decode's exactly), so
        # its block's keys end by start + len + Q, which its block table covers (the scheduler
        # reserves the lookahead of a chunk that completes).
        max_seq_len = max(step.starts[i] + step.query_lens[i] for i in proposers) + q
        positions = inputs.positions.view(num_props, q)[:, 0] + 1  # first draft positions
        st = self.sampling.get([step.requests[i] for i in proposers], positions)
        tokens, probs = self.proposer.propose(
            inputs, block_tables, max_seq_len, st, num_drafts, step.features if uniform else None
        )
        return LaunchedDrafts(DraftBatch(tokens, probs), proposers)
