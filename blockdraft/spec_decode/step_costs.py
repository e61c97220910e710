"""What a step costs, for the draft-length chooser (blockdraft/spec_decode/draft_length.py):
seconds per uniform step by (batch bucket, N), measured where the engine has run such steps
and scaled from an analytic prior where it has not."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

# Step times kept per (bucket, N); the estimate is their (lower) median.
COST_WINDOW = 5
# How far below the best rate the GPU's prior explores (`CostPrior.explore_margin`; exploring:
# EXPLORE_STEPS in draft_length.py): there the prior is one line through every N where a real
# step's cost is not (a 27B verify of 32 x 4 rows still reads weights where 32 x 8 computes),
# and an N never drafted is never timed. On the CPU the prior is a fit of measured steps (cost
# grows with rows) and every N up to the cap is allowed: no exploring.
CUDA_EXPLORE_MARGIN = 0.2


@dataclass(frozen=True)
class CostPrior:
    """cost(b, N) / decode(b) before any step is timed: 1 + drafter_overhead * (N > 0) +
    per_row * b * N. On the CPU every verify row costs compute (SmolLM2-135M with its drafter at
    batch 1: N = 1 / 3 / 7 ran at 1.21 / 1.16 / 1.60 decode steps on 2 cores, 1.42 / 1.38 / 2.08
    on one thread, where a decode step's GEMVs read the weights at one core's bandwidth and the
    drafter's small operations gain nothing from a second core); on an H200 the verify rows
    are nearly free at small batches (Qwen3-8B: a 16-row DFlash step 1.42 decode steps at batch
    1, ~3.4 at 32 requests). A prior that flatters drafting costs the first steps of every
    engine: they draft at a loss until their times are measured."""

    drafter_overhead: float
    per_row: float
    # How far below the best rate (a share of it) an N priced by this prior alone is explored.
    explore_margin: float = 0.0
    # Whether a drafting N timed in a few steps is timed again where this prior, scaled from the
    # chosen N's timing, prices it above the chosen N (DRAFT_RETIME_SPACING in draft_length.py):
    # on the CPU, where the prior is a fit of measured steps. The GPU's, one line through every
    # N, prices large N too low, and re-timing them there only cost steps (`chooser_replay`).
    retime: bool = False

    @classmethod
    def for_device(cls, device_type: str, num_threads: int = 2) -> CostPrior:
        if device_type == "cuda":
            return cls(drafter_overhead=0.35, per_row=0.005, explore_margin=CUDA_EXPLORE_MARGIN)
        if num_threads == 1:
            return cls(drafter_overhead=0.3, per_row=0.11, retime=True)
        return cls(drafter_overhead=0.1, per_row=0.07, retime=True)

    def __call__(self, batch: int, num_drafts: int) -> float:
        if not num_drafts:
            return 1.0
        return 1.0 + self.drafter_overhead + self.per_row * batch * num_drafts


def lower_median(window: deque[float]) -> float:
    """The lower median of a window of times (step times are only ever inflated)."""
    return sorted(window)[(len(window) - 1) // 2]


class StepCostModel:
    """Seconds per uniform step by (batch bucket, N): measured where the engine has run such
    steps, else the prior scaled by the bucket's measured decode-step unit.

    Batches with a sampled request (T > 0) have buckets of their own (`sampled`, set by the
    chooser for the batch it weighs): their steps sample and rejection-sample, and on a
    host-bound target cost ~1.25x a greedy batch's at every N (a tiny target on one CPU
    thread: decode 1.23x, N = 3 1.28x). With one table for both, an engine whose greedy and
    sampled requests take turns prices one kind's drafting against the other kind's decode
    steps: greedy drafting looks dearer than it is after sampled decode steps, and sampled
    drafting cheaper after greedy ones."""

    def __init__(self, prior: CostPrior) -> None:
        self.prior = prior
        self.sampled = False  # the batch priced or timed now has a sampled request
        self.measured: dict[tuple[int, int], float] = {}  # (bucket, N) -> seconds
        self.samples: dict[tuple[int, int], deque[float]] = {}  # their last COST_WINDOW times
        self.unit: dict[int, float] = {}  # bucket -> seconds per prior unit (a decode step)
        self.fastest_decode: dict[int, float] = {}  # bucket -> the fastest decode step timed

    def bucket(self, batch: int) -> int:
        """Power-of-two buckets: 1, 2-3, 4-7, 8-15, ...; a sampled batch's are their negatives."""
        return -batch.bit_length() if self.sampled else batch.bit_length()

    def record(self, batch: int, num_drafts: int, seconds: float) -> None:
        bucket = self.bucket(batch)
        key = (bucket, num_drafts)
        window = self.samples.get(key)
        if window is None:
            window = self.samples[key] = deque(maxlen=COST_WINDOW)
        window.append(seconds)
        if not num_drafts and seconds < self.fastest_decode.get(bucket, math.inf):
            self.fastest_decode[bucket] = seconds
        median = lower_median(window)
        self.measured[key] = median
        self.unit[bucket] = median / self.prior(batch, num_drafts)

    def has(self, batch: int, num_drafts: int) -> bool:
        return (self.bucket(batch), num_drafts) in self.measured

    def cost(self, batch: int, num_drafts: int) -> float:
        bucket = self.bucket(batch)
        measured = self.measured.get((bucket, num_drafts))
        if measured is not None:
            return measured
        return self.unit.get(bucket, 1.0) * self.prior(batch, num_drafts)
