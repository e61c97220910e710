"""How many tokens to draft per step, by batch size: the N itself (an explicit schedule), or the
most the acceptance-aware chooser may pick ("auto", blockdraft/spec_decode/draft_length.py).

A verify of 1+N rows per request is nearly free at small batches (the target's weight reads
dominate) but becomes compute-bound at large ones: on an H200 with Qwen3-8B shapes, 16 rows x
32 requests cost ~3.4 decode steps. Drafting fewer tokens there trades a shorter accepted run
for a cheaper verify, and a block-16 drafter runs well at block 8 (the DFlash paper). N = 0
drafts nothing: the step is a plain decode, and the drafter only writes its context (the
target's features of the new tokens), so that it can draft again once the batch shrinks.

The batch size is the number of running requests when the drafts are proposed: those are the
requests the next step verifies (a request only gets drafts by proposing, so a step never
verifies more requests with some N than ran when N was chosen). Drafts are proposed before the
step's tokens are read back, so requests that the step finishes still count; any N is lossless.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

# "auto" on CUDA: the N the chooser picks from (those with CUDA graphs; 0 replays decode's),
# besides num_speculative_tokens itself. The cost of a step grows slowly with N there, so a few
# lengths cover the range; each one costs a capture of the verify and drafter graphs.
AUTO_CUDA_CHOICES = (0, 3, 7)
# "auto" on CUDA: from this many running requests on, draft at most AUTO_NUM_DRAFTS tokens.
AUTO_MIN_BATCH = 24
AUTO_NUM_DRAFTS = 7
# "auto" on the CPU: from this many running requests on, no drafts (N = 0). There a batch of a
# few requests already keeps the cores busy, so verify rows only add compute: at a steady batch
# of 4 / 16 open-chat requests the shipped drafter with 3 drafts a step ran at 0.56 / 0.47x plain
# decoding on two threads, with none at 1.05 / 1.00x (BENCHMARKS.md).
AUTO_CPU_STOP_BATCH = 4
# num_speculative_tokens left unset on the CPU: at most this many. There every verify row
# costs compute, so only the first drafts, the likeliest to be accepted, pay for their rows: with
# the shipped drafter on 2 cores, fixed N = 2 / 3 / 4 gave 1.44 / 1.65 / 1.60x plain decoding on
# GSM8K, 1.37 / 1.65 / 1.55x on HumanEval (a step of 1 + 3 rows costs ~1.2 decode steps there,
# four rows being the BLAS's cheapest few-row product; N = 7 1.6). On a GPU the verify rows
# are nearly free at small batches: the whole block.
CPU_DEFAULT_NUM_DRAFTS = 3


def default_num_drafts(block_size: int, device_type: str) -> int:
    """num_speculative_tokens when the config leaves it unset: the drafter's block_size - 1,
    at most CPU_DEFAULT_NUM_DRAFTS on the CPU."""
    if device_type != "cuda":
        return min(block_size - 1, CPU_DEFAULT_NUM_DRAFTS)
    return block_size - 1


def is_int_at_least(value: object, minimum: int) -> bool:
    """An int (not a bool) >= minimum."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def is_positive_int(value: object) -> bool:
    return is_int_at_least(value, 1)


def check_draft_schedule(schedule: object, num_speculative_tokens: int | None) -> None:
    """SpeculativeConfig.num_speculative_tokens_by_batch is 'auto', None or {batch: N} with
    positive keys and 0 <= N <= num_speculative_tokens (unchecked while that is None: it may
    come from the drafter's block size, and DraftSchedule.resolve checks again then)."""
    name = "num_speculative_tokens_by_batch"
    if schedule is None or schedule == "auto":
        return
    if not isinstance(schedule, dict) or not schedule:
        raise ValueError(
            f"{name} must be a non-empty dict {{min batch size: draft tokens}}, 'auto' or None; "
            f"got {schedule!r}"
        )
    for batch, n in schedule.items():
        if not is_positive_int(batch):
            raise ValueError(f"{name} keys are batch sizes (positive integers), got {batch!r}")
        if not is_int_at_least(n, 0):
            raise ValueError(
                f"{name}[{batch}] must be a number of draft tokens >= 0 (0: none), got {n!r}"
            )
        if num_speculative_tokens is not None and n > num_speculative_tokens:
            raise ValueError(
                f"{name}[{batch}] = {n} exceeds num_speculative_tokens ({num_speculative_tokens})"
            )


@dataclass(frozen=True)
class DraftSchedule:
    """Draft tokens per step as a step function of the batch size: from min_batches[i] running
    requests on (up to the next key), draft num_drafts_at[i] tokens. min_batches[0] == 1."""

    min_batches: tuple[int, ...]
    num_drafts_at: tuple[int, ...]
    # "auto": the N the chooser may pick, ascending, 0 first; num_drafts(batch) is then the
    # most it may pick at that batch size. None: num_drafts(batch) is N.
    choices: tuple[int, ...] | None = None

    @classmethod
    def resolve(
        cls,
        by_batch: dict[int, int] | str | None,  # SpeculativeConfig.num_speculative_tokens_by_batch
        num_speculative_tokens: int,
        device_type: str,
    ) -> DraftSchedule:
        """The schedule a config asks for, once num_speculative_tokens is resolved (it may come
        from the drafter's block size). Every N is checked to lie in 0..num_speculative_tokens."""
        check_draft_schedule(by_batch, num_speculative_tokens)
        choices = None
        if by_batch == "auto":
            by_batch = cls.auto(num_speculative_tokens, device_type)
            choices = cls.auto_choices(num_speculative_tokens, device_type)
        steps = {1: num_speculative_tokens, **(by_batch or {})}
        keys = sorted(steps)
        # Drop keys that do not change N, so each N has as few batch ranges as possible.
        kept = [k for i, k in enumerate(keys) if i == 0 or steps[k] != steps[keys[i - 1]]]
        return cls(tuple(kept), tuple(steps[k] for k in kept), choices)

    @staticmethod
    def auto(num_speculative_tokens: int, device_type: str) -> dict[int, int]:
        # On the CPU every verify row costs compute, at any batch, so below AUTO_CPU_STOP_BATCH
        # the best N follows the drafter's acceptance (the user's N), and from it on drafting
        # does not pay.
        if device_type != "cuda":
            return {AUTO_CPU_STOP_BATCH: 0}
        return {AUTO_MIN_BATCH: min(num_speculative_tokens, AUTO_NUM_DRAFTS)}

    @staticmethod
    def auto_choices(num_speculative_tokens: int, device_type: str) -> tuple[int, ...]:
        """The N "auto" chooses from: every one on the CPU (no graphs), a few on CUDA."""
        if device_type != "cuda":
            return tuple(range(num_speculative_tokens + 1))
        picks = {n for n in AUTO_CUDA_CHOICES if n < num_speculative_tokens}
        return tuple(sorted(picks | {num_speculative_tokens}))

    @property
    def is_adaptive(self) -> bool:
        """N is chosen each step from acceptance (below the schedule's cap)."""
        return self.choices is not None

    @property
    def is_fixed(self) -> bool:
        return not self.is_adaptive and len(self.num_drafts_at) == 1

    def allowed(self, cap: int) -> tuple[int, ...]:
        """The N a step may draft when the schedule gives `cap` at its batch size."""
        if self.choices is None:
            return (cap,)
        return tuple(n for n in self.choices if n <= cap) + (() if cap in self.choices else (cap,))

    @property
    def all_num_drafts(self) -> list[int]:
        """Every N the schedule may pick, 0 (no drafts) included."""
        return sorted({n for cap in self.num_drafts_at for n in self.allowed(cap)})

    def num_drafts(self, batch_size: int) -> int:
        """N for a step that proposes while `batch_size` requests run (host only: a lookup)."""
        return self.num_drafts_at[bisect.bisect_right(self.min_batches, batch_size) - 1]

    def graph_batch_sizes(self, num_drafts: int, batch_sizes: list[int]) -> list[int]:
        """The CUDA-graph batch buckets (of `batch_sizes`, ascending, the last being the most
        requests that run) that steps drafting `num_drafts` tokens can replay: for each batch
        range that may pick that N, from the bucket of its smallest batch to that of its
        largest. A smaller batch with that N (some running requests had no drafts) pads up to
        the first."""
        largest = batch_sizes[-1]
        ends = list(self.min_batches[1:]) + [largest + 1]
        chosen: set[int] = set()
        for lo, end, n in zip(self.min_batches, ends, self.num_drafts_at, strict=True):
            if num_drafts not in self.allowed(n) or lo > largest:
                continue
            first, last = bucket_of(lo, batch_sizes), bucket_of(min(end - 1, largest), batch_sizes)
            chosen.update(b for b in batch_sizes if first <= b <= last)
        return sorted(chosen)


def bucket_of(batch: int, batch_sizes: list[int]) -> int:
    """The smallest bucket that holds `batch` requests (the largest if none does)."""
    return next((b for b in batch_sizes if b >= batch), batch_sizes[-1])
