"""Continuous batching under a per-step token budget.

Running requests go first, oldest first: a caught-up request computes its last token (plus its
drafts when speculating), one still in prefill computes the next chunk that fits the budget.
When the pool runs out of blocks the newest running request is preempted: its blocks are freed
and it will be recomputed from its tokens later. Waiting requests are admitted with what is
left, reusing cached prefix blocks.

Every request verified in a step verifies the same number of drafts N (one [R, 1+N] verify,
one CUDA graph). Drafts proposed at different steps can differ in number when N depends on
the batch size (a request whose verify did not fit the budget keeps older ones): the step
verifies the smallest pending count, and a request holding more verifies its first N. That
is lossless: verifying a prefix of the drafts is speculative decoding with fewer drafts.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from blockdraft.engine.block_manager import BlockManager
from blockdraft.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledChunk:
    seq: Sequence
    start: int  # first position computed this step
    # Tokens at positions start .. start+len-1, verify rows included (as DRAFT_PLACEHOLDER).
    token_ids: list[int]
    num_drafts: int  # trailing rows that are drafts to verify

    @property
    def completes(self) -> bool:
        """After this chunk the request has logits for its next token."""
        return self.start + len(self.token_ids) == self.seq.num_tokens + self.num_drafts


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        num_lookahead_tokens: int,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # Positions past the committed tokens that the drafter writes (anchor + N masks).
        self.num_lookahead_tokens = num_lookahead_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _capacity_needed(self, seq: Sequence, num_new: int) -> int:
        end = seq.num_computed_tokens + num_new
        caught_up = end >= seq.num_tokens
        return end + (self.num_lookahead_tokens if caught_up else 0)

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _verify_width(self) -> int:
        """Drafts every request verifies this step: the fewest any running request holds."""
        return min((s.num_drafts for s in self.running if s.drafts is not None), default=0)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted = False
        num_drafts = self._verify_width()
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            seq_drafts = num_drafts if seq.drafts is not None else 0
            pending = seq.tokens_to_compute(seq_drafts)
            num_new = len(pending)
            if seq.drafts is not None:
                if num_new > budget:  # a verify block is never split
                    break
            else:
                num_new = min(num_new, budget)
            while not self.block_manager.ensure_capacity(seq, self._capacity_needed(seq, num_new)):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                chunks.append(
                    ScheduledChunk(
                        seq,
                        seq.num_computed_tokens,
                        pending[:num_new],
                        seq_drafts,
                    )
                )
                budget -= num_new
                i += 1
        while (
            self.waiting and budget > 0 and not preempted and len(self.running) < self.max_num_seqs
        ):
            seq = self.waiting[0]
            if not seq.block_table:
                seq.num_computed_tokens = self.block_manager.allocate_cached_prefix(seq)
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.block_manager.ensure_capacity(seq, self._capacity_needed(seq, num_new)):
                self.block_manager.free(seq)
                seq.reset_for_recompute()
                break
            self.waiting.popleft()
            # Counted when admitted (a failed attempt's hits are given back), prompt only: a
            # preempted request's hits on readmission include its own output's blocks.
            seq.num_cached_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chunks.append(
                ScheduledChunk(seq, seq.num_computed_tokens, seq.tokens_to_compute()[:num_new], 0)
            )
            budget -= num_new
        return chunks

    def finish(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.FINISHED
        self.block_manager.free(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
