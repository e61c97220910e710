"""Async decode (EngineConfig.async_decode): the next plain decode step is launched before the
current one is read back, so the GPU is not idle while the host reads step t, does its
bookkeeping and launches step t+1.

Step t+1 runs the same requests, in the same order, one row each at the position of the token
step t samples, whose id it takes from step t's sampled tokens on the device. It is only
launched when it is exactly the step the scheduler would pick next whatever step t samples:
nothing waits to be admitted, every running request is in step t and each one samples a token
there, and none can reach max_tokens or max_model_len with that token. A request that stops
anyway (eos, a stop token or string) or is aborted has its row of step t+1 discarded. Anything
else drains the pipeline: the engine schedules as usual. A speculative engine pipelines its
steps the same way while its batch drafts nothing (`DecodeAheadHooks`): N = 0 then costs what
plain decoding costs, host time included.

Outputs, including the prefix cache's state, are those of the synchronous engine: step t+1's
blocks are only taken where the scheduler would take them (never a block holding a cached
prefix), and a discarded row's new blocks go back to the front of the free list, where they
were taken from.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Protocol

from blockdraft.engine.block_manager import BlockManager
from blockdraft.engine.model_runner import LaunchedStep, ModelRunner, StepOutput
from blockdraft.engine.scheduler import ScheduledChunk, Scheduler
from blockdraft.engine.sequence import DRAFT_PLACEHOLDER, Sequence


@dataclass
class InflightDecode:
    """A decode step launched ahead, not read back yet."""

    launched: LaunchedStep
    # Blocks allocated for this step, per request: a request that finishes before the step is
    # read back gives them back to the front of the free list.
    new_blocks: dict[Sequence, list[int]]

    @property
    def has_live_rows(self) -> bool:
        return any(not c.seq.is_finished for c in self.launched.chunks)


def plan_decode_ahead(
    launched: LaunchedStep, scheduler: Scheduler, max_model_len: int
) -> list[ScheduledChunk] | None:
    """The decode step after `launched` (launched, not read back), or None when it cannot be
    known before the readback."""
    chunks = launched.chunks
    if scheduler.waiting:  # a new or preempted request: the scheduler admits it next step
        return None
    if launched.verify or len(launched.decode) != len(chunks):  # a prefill chunk or a verify
        return None
    seqs = [c.seq for c in chunks]
    if seqs != scheduler.running:  # a request finished, or the token budget left one out
        return None
    for seq in seqs:
        # The token being sampled is not appended yet: it ends the request by length when it
        # is the last one room is left for (OutputProcessor's rule).
        room = min(seq.max_tokens - seq.num_output_tokens, max_model_len - seq.num_tokens)
        if room < 2:
            return None
    # One row per request (never more than the step being read, so within the token budget),
    # at the position of the token being sampled; its id is only on the device (placeholder).
    return [ScheduledChunk(seq, seq.num_tokens, [DRAFT_PLACEHOLDER], 0) for seq in seqs]


def reserve_blocks(
    block_manager: BlockManager, seqs: list[Sequence], lookahead: int = 0
) -> dict[Sequence, list[int]] | None:
    """Gives each request the block capacity the scheduler would for the row it decodes ahead
    (and the `lookahead` a speculative engine keeps past it); returns the new blocks per
    request, or None (and nothing allocated) when that would differ from what the synchronous
    engine does: the pool is short (the scheduler would preempt), or a block to take holds a
    cached prefix (a request that stops at the current token would not have evicted it)."""
    block_size = block_manager.block_size
    needs = [
        max(0, -(-(s.num_tokens + 1 + lookahead) // block_size) - len(s.block_table)) for s in seqs
    ]
    total = sum(needs)
    if total > block_manager.num_free_blocks:
        return None
    to_take = itertools.islice(block_manager.free_blocks, total)  # ensure_capacity's order
    if any(block_id in block_manager.block_key for block_id in to_take):
        return None
    new_blocks = {}
    for seq, need in zip(seqs, needs, strict=True):
        if need:
            allocated = block_manager.ensure_capacity(seq, seq.num_tokens + 1 + lookahead)
            assert allocated, "checked above"
            new_blocks[seq] = seq.block_table[-need:]
    return new_blocks


def return_blocks_of_finished(inflight: InflightDecode, block_manager: BlockManager) -> None:
    """Puts the blocks allocated for finished requests' rows (their blocks are freed) back at
    the front of the free list, where the allocation took them: the free list is then as if
    they had never been taken. Their rows' KV writes, queued earlier, land before any later
    step's use of those blocks."""
    for seq in [s for s in inflight.new_blocks if s.is_finished]:
        for block_id in reversed(inflight.new_blocks.pop(seq)):
            assert block_manager.ref_counts[block_id] == 0
            block_manager.free_blocks.move_to_end(block_id, last=False)


class DecodeAheadHooks(Protocol):
    """A speculative engine's say in the pipeline: it runs only the steps whose batch drafts
    nothing (N = 0), and keeps their rows for the drafter's context."""

    def allow_decode_ahead(self, seqs: list[Sequence]) -> bool:
        """Whether the step after the one being read back drafts nothing (asked once a step,
        just before it would be launched ahead)."""
        ...

    def decode_ahead_launched(self, step: LaunchedStep) -> None:
        """The step was launched ahead, its blocks reserved."""
        ...


def launch_decode_ahead(
    launched: LaunchedStep,
    runner: ModelRunner,
    scheduler: Scheduler,
    block_manager: BlockManager,
    max_model_len: int,
    hooks: DecodeAheadHooks | None = None,
) -> InflightDecode | None:
    """Launches the decode step after `launched`, or None (drain) when it is not known."""
    chunks = plan_decode_ahead(launched, scheduler, max_model_len)
    if chunks is None:
        return None
    seqs = [c.seq for c in chunks]
    if hooks is not None and not hooks.allow_decode_ahead(seqs):
        return None
    new_blocks = reserve_blocks(block_manager, seqs, scheduler.num_lookahead_tokens)
    if new_blocks is None:
        return None
    step = runner.launch_decode_ahead(chunks, launched)
    if hooks is not None:
        hooks.decode_ahead_launched(step)
    return InflightDecode(step, new_blocks)


def live_rows(
    launched: LaunchedStep, result: StepOutput
) -> tuple[list[ScheduledChunk], StepOutput]:
    """The chunks and results of a step launched ahead, less the rows of requests that stopped
    or were aborted after it was launched."""
    live = [i for i, c in enumerate(launched.chunks) if not c.seq.is_finished]
    tokens, accepted = result.new_tokens, result.num_accepted
    return [launched.chunks[i] for i in live], StepOutput(
        [tokens[i] for i in live], [accepted[i] for i in live]
    )


class DecodePipeline:
    """The engine's steps under async_decode: holds the decode step launched ahead and not read
    back yet (`inflight`), and reads back one step per `advance`, which the engine processes as
    any step."""

    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        max_model_len: int,
        hooks: DecodeAheadHooks | None = None,
    ) -> None:
        self.runner, self.scheduler, self.max_model_len = runner, scheduler, max_model_len
        self.block_manager = scheduler.block_manager
        self.hooks = hooks
        self.inflight: InflightDecode | None = None

    def launch_ahead(self, launched: LaunchedStep) -> None:
        """Launches the decode step after `launched` (just launched, not read back) when it is
        known: the next `advance` reads `launched` back."""
        self.inflight = launch_decode_ahead(
            launched, self.runner, self.scheduler, self.block_manager, self.max_model_len,
            self.hooks,
        )  # fmt: skip

    def advance(self) -> tuple[list[ScheduledChunk], StepOutput] | None:
        """Reads back the step launched ahead last call (or launches a scheduled one), first
        launching the next decode step when it is known; None when nothing is scheduled."""
        inflight, self.inflight = self.inflight, None
        if inflight is not None:
            launched = inflight.launched
        else:
            chunks = self.scheduler.schedule()
            if not chunks:
                return None
            launched = self.runner.launch(chunks)
        self.launch_ahead(launched)
        result = self.runner.finish(launched)  # still the step's one device-to-host read
        return live_rows(launched, result)

    def drop_finished_rows(self) -> None:
        """Gives back the blocks of the in-flight rows of requests that finished; forgets the
        in-flight step when no row is left (its queued work needs no readback)."""
        if self.inflight is None:
            return
        return_blocks_of_finished(self.inflight, self.block_manager)
        if not self.inflight.has_live_rows:
            self.inflight = None
