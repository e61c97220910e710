"""The default draft length on simulated batch-1 serving: requests one after another, each
draft accepted with a request's own probability, step times from a host-bound GPU's cost shape
(SmolLM2-135M on an H100: a pipelined plain step 1, a synchronous drafting step ~2, the
verify-only step after drafting 1.8, the two plain steps refilling the pipeline 1.3 each;
3% noise; `--shape device-bound`: a large target's, a drafting step ~1.17 plain ones and no
cost to switching). Prints the chooser's tokens per unit of time against plain decoding's for
each acceptance scenario and probe budget: for weighing a change to the chooser before the GPU.

    python benchmarks/chooser_sim.py [--seeds 20] [--requests 6] [--tokens 128]
        [--probe-budgets 0.02 0.01] [--fixed 7 15] [--slow-phases 0.3]
        [--slow-factor 2.5] [--shape {host-bound,device-bound,cpu}]

`--slow-phases F`: the host runs every step `--slow-factor` times slower (SLOW_FACTOR) in
stretches of SLOW_STRETCH steps, a share F of them (a noisy neighbour; plain decoding's time is
taken through the same stretches). `--shape cpu`: a CPU's step costs and cost prior.

`--fixed N...` adds engines that draft N every step (the issue's yardstick where the drafter
is good: the default should match the best fixed N).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import print_table  # noqa: E402
from blockdraft.spec_decode.draft_length import (  # noqa: E402
    PROBE_BUDGET,
    AcceptanceEstimate,
    DraftLengthChooser,
)
from blockdraft.spec_decode.draft_schedule import DraftSchedule  # noqa: E402

# The GPU's default schedule at batch 1: N in 0..15, the chooser's allowed values.
SCHEDULE = DraftSchedule((1,), (15,), (0, 1, 2, 3, 7, 15))
Acceptance = Callable[[int], float]  # a request's acceptance probability at an output position
SLOW_FACTOR = 1.5  # `--slow-factor`
SLOW_STRETCH = 40


@dataclass(frozen=True)
class StepShape:
    """Step times in plain decode steps: a drafting step (`drafting` + `per_draft` * N), the
    verify-only plain step right after drafting, and the two plain steps refilling the decode
    pipeline after it."""

    drafting: float
    per_draft: float
    verify_only: float
    refill: float
    device: str = "cuda"  # whose cost prior the chooser starts from


SHAPES = {
    # SmolLM2-135M on an H100: the host launches every step, the GPU idles most of it.
    "host-bound": StepShape(drafting=2.0, per_draft=0.01, verify_only=1.8, refill=1.3),
    # Qwen3.5-27B shapes on an H100 (`gpu_bench --shape qwen3.5-27b`, p = 0.8): decode 18.86 ms,
    # verify + draft 22.1-22.6 ms whatever N; the GPU hides the host's switches.
    "device-bound": StepShape(drafting=1.17, per_draft=0.0003, verify_only=1.0, refill=1.0),
    # SmolLM2-135M on 2 CPU threads, open chat at T = 1: decode ~38 ms, drafting 1 / 2 / 3
    # tokens 56-60 ms, the step after drafts verifies them (~1.1), nothing pipelined.
    "cpu": StepShape(drafting=1.45, per_draft=0.03, verify_only=1.1, refill=1.0, device="cpu"),
}


class StepClock:
    """The step times of a `StepShape`, in plain decode steps: a step's time depends on the step
    before it (a verify-only step after drafting) and on whether the decode pipeline is still
    refilling (two plain steps after a verify)."""

    def __init__(self, r: random.Random, shape: StepShape = SHAPES["host-bound"]) -> None:
        self.r = r
        self.shape = shape
        self.previous = 0  # the last step's N
        self.refill = 0  # plain steps still refilling the pipeline

    def step(self, num_drafts: int) -> float:
        """The time of a step that drafts `num_drafts` (3% noise)."""
        shape = self.shape
        if num_drafts:
            t = shape.drafting + shape.per_draft * num_drafts
        elif self.previous:
            t = shape.verify_only
        else:
            t = shape.refill if self.refill else 1.0
        if self.previous and not num_drafts:
            self.refill = 2
        elif not num_drafts:
            self.refill = max(self.refill - 1, 0)
        self.previous = num_drafts
        return t * self.r.uniform(0.97, 1.03)


def serve(
    requests: list[Acceptance],
    tokens: int,
    budget: float,
    r: random.Random,
    fixed: int = -1,
    slow_share: float = 0.0,
    shape: StepShape = SHAPES["host-bound"],
    slow_factor: float = SLOW_FACTOR,
) -> tuple[float, float]:
    """(tokens per unit of time against plain decoding's, share of steps drafting) of one
    engine serving `requests` one at a time, `tokens` each: the default chooser at probe
    budget `budget`, or N = `fixed` every step; a share `slow_share` of the steps in slow
    stretches (plain decoding's time: one step a token, through the same stretches)."""
    # The phases' own stream, drawn only with slow phases: runs without them stay as they were.
    phases = random.Random(r.random()) if slow_share else None
    slow, plain = False, 0.0
    chooser = DraftLengthChooser.for_device(SCHEDULE, shape.device)
    chooser.probe_budget = budget
    clock = StepClock(r, shape)
    elapsed, steps, drafting = 0.0, 0, 0
    for acceptance in requests:
        estimate, done, pending = AcceptanceEstimate(), 0, 0
        while done < tokens:
            n = chooser.choose([estimate], 1) if fixed < 0 else fixed
            got = 1
            if pending:  # this step verifies the drafts proposed at the last one
                accepted = 0
                while accepted < pending and r.random() < acceptance(done):
                    accepted += 1
                chooser.observe(estimate, accepted, pending)
                got += accepted
            if phases is not None and steps % SLOW_STRETCH == 0:
                slow = phases.random() < slow_share
            scale = slow_factor if slow else 1.0
            t = clock.step(n) * scale
            chunks = [SimpleNamespace(num_drafts=pending, token_ids=[0] * (pending + 1))]
            chooser.record_if_uniform(chunks, n, t * 1e-3)
            elapsed += t
            plain += got * scale
            done += got
            steps += 1
            drafting += n > 0
            pending = n
    return plain / elapsed, drafting / steps


def steady(alpha: float) -> Acceptance:
    return lambda position: alpha


def stretches(r: random.Random, high: float, low: float, length: int) -> Acceptance:
    """Acceptance `high` or `low` (even odds) in stretches of `length` output tokens."""
    chosen: dict[int, float] = {}

    def acceptance(position: int) -> float:
        stretch = position // length
        if stretch not in chosen:
            chosen[stretch] = high if r.random() < 0.5 else low
        return chosen[stretch]

    return acceptance


SCENARIOS: dict[str, Callable[[random.Random], Acceptance]] = {
    "T = 1-like: alpha 0.15-0.4": lambda r: steady(r.uniform(0.15, 0.4)),
    "T = 0 maths-like: 0.85 / 0.3 in stretches of 24": lambda r: stretches(r, 0.85, 0.3, 24),
    "T = 0, a good drafter: alpha 0.7": lambda r: steady(0.7),
    "the published DFlash2 acceptance: alpha 0.8": lambda r: steady(0.8),
    "drafts never land: alpha 0": lambda r: steady(0.0),
}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--requests", type=int, default=6)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--probe-budgets", type=float, nargs="+", default=[PROBE_BUDGET])
    p.add_argument("--fixed", type=int, nargs="*", default=[], help="fixed-N engines too")
    p.add_argument("--slow-phases", type=float, default=0.0, help="share of slow stretches")
    p.add_argument("--slow-factor", type=float, default=SLOW_FACTOR,
                   help="how much slower every step of a slow stretch is")  # fmt: skip
    p.add_argument("--shape", choices=sorted(SHAPES), default="host-bound",
                   help="step-time model (module docstring)")  # fmt: skip
    args = p.parse_args(argv)
    if min(args.seeds, args.requests, args.tokens) < 1:
        raise SystemExit("--seeds, --requests and --tokens must be >= 1")
    if not 0 <= args.slow_phases <= 1:
        raise SystemExit("--slow-phases must lie in [0, 1]")
    if args.slow_factor < 1:
        raise SystemExit("--slow-factor must be >= 1")
    if bad := [n for n in args.fixed if n not in SCHEDULE.all_num_drafts]:
        raise SystemExit(f"--fixed {bad}: N must be one of {SCHEDULE.all_num_drafts}")
    engines = [("default", b, -1) for b in args.probe_budgets]
    engines += [(f"N = {n}", None, n) for n in args.fixed]
    rows = []
    for name, scenario in SCENARIOS.items():
        for engine, budget, fixed in engines:
            runs = []
            for seed in range(args.seeds):
                r = random.Random(seed)
                runs.append(serve([scenario(r) for _ in range(args.requests)], args.tokens,
                                  budget or PROBE_BUDGET, r, fixed, args.slow_phases,
                                  SHAPES[args.shape], args.slow_factor))  # fmt: skip
            rows.append({
                "scenario": name, "engine": engine, "probe_budget": budget,
                "vs_plain": statistics.mean(v for v, _ in runs),
                "drafting_steps": statistics.mean(d for _, d in runs),
            })  # fmt: skip
    print_table(
        f"the default draft length, simulated batch-1 serving ({args.requests} requests x "
        f"{args.tokens} tokens, {args.seeds} seeds, {args.shape} steps)",
        ["scenario", "engine", "probe budget", "vs plain decoding", "steps drafting"],
        [[r["scenario"], r["engine"], f"{r['probe_budget']:g}" if r["probe_budget"] else "",
          f"{r['vs_plain']:.3f}",
          f"{r['drafting_steps']:.1%}"] for r in rows],
    )  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
