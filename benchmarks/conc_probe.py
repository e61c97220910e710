"""Per-pass DFlash throughput at one concurrency on a model shape (random bf16 weights, a GPU),
with the step times of each pass and where a pass's time goes: for telling a configuration's
rate from a stalled pass, and steady steps from admission, the batch's tail and the host.

    python benchmarks/conc_probe.py [--shape qwen3-8b] [--concurrency 32] [--new-tokens 256]
        [--passes 4] [--accept 0.86]

Runs the default draft schedule and fixed N = 7 (block 8) with synthetic acceptance. The
breakdown sorts each step by what it ran: "admit" (requests waiting before it: their prefill),
"N = k, full" (every request of the pass running, k drafts), "N = k, tail" (some finished),
and "host" (the pass's time outside the engine's steps).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import TritonCompileLog, now, print_table  # noqa: E402
from benchmarks.gpu_bench import dflash_llm  # noqa: E402
from benchmarks.shapes import SHAPES  # noqa: E402
from blockdraft import SamplingParams  # noqa: E402
from blockdraft.spec_decode.draft_length import ALPHA_BINS  # noqa: E402


@dataclass
class StepRecord:
    ms: float
    running: int  # requests running before the step
    admitting: bool  # requests waiting before it (their prefill runs in it)
    num_drafts: int | None  # the N it drafted; None: a step that recorded none
    chooser: dict | None = None  # what the draft-length chooser weighed before it (`weighed`)
    # The step times the chooser was handed in it: [batch, N, ms, pipelined] per call.
    timed: list = dataclasses.field(default_factory=list)


def weighed(engine: object) -> dict | None:
    """The chooser's inputs for the running batch: its requests' mean alpha (never verified:
    the prior of its kind), whether it samples, the engine-wide prior of its kind (a batch
    with a sampled request: sampled requests'), cost(b, N) of its kind per allowed N
    and a probe's cost in ms, the rates it compares (tokens a second, drafting's margin
    included), the probe interval and whether it is calibrating; None for a fixed schedule."""
    chooser, running = engine.draft_length, engine.scheduler.running
    if chooser is None or not running or not chooser.schedule.is_adaptive:
        return None
    # The batch's own kind of step costs (greedy or sampled), as `choose` will price it.
    sampled = chooser.costs.sampled = any(s.acceptance.sampled for s in running)
    batch, prior = len(running), chooser.prior_alpha(sampled)
    alphas = [
        e.alpha_bin / ALPHA_BINS if e.alpha_bin >= 0 else chooser.prior_alpha(e.sampled)
        for e in (s.acceptance for s in running)
    ]
    allowed = chooser.allowed_by_cap[chooser.schedule.num_drafts(batch)]
    bucket = chooser.costs.bucket(batch)
    return {
        "alpha": sum(alphas) / len(alphas),
        "sampled": sampled,
        "prior": prior,
        "cost_ms": {n: 1e3 * chooser.step_cost(batch, n) for n in allowed},
        "tokens_per_s": chooser.expected_rates((s.acceptance for s in running), batch),
        "measured": [n for n in allowed if chooser.costs.has(batch, n)],
        "probe_ms": 1e3 * chooser.probe_cost(batch, allowed[1]) if len(allowed) > 1 else None,
        "probe_interval": chooser.probe_interval,
        "since_drafting": chooser.steps_since_drafting,
        "calibrating": chooser.calibrating.get(bucket, 0),
    }


def timed_pass(
    llm: object, batch: list, params: SamplingParams | list[SamplingParams]
) -> tuple[float, list[StepRecord]]:
    """Seconds of one `generate` over `batch`, and a record of each engine step in it. A step
    is timed by the host's clock alone: a device sync around each step (`now`) would drain the
    engine's async decode pipeline, and the chooser, timing its own steps, then reads the
    plain-decode steps as ~10x cheaper than they are (2.7 ms against 26.4 a step, the 27B shape
    at batch 32 on an H100) and stops drafting."""
    engine = llm.engine
    step, chooser = engine.step, engine.draft_length
    records: list[StepRecord] = []
    handed: list[list] = []

    def record_if_uniform(chunks: list, n: int, seconds: float, pipelined: bool = True) -> None:
        handed.append([len(chunks), n, seconds * 1e3, pipelined])
        record(chunks, n, seconds, pipelined)

    def timed_step() -> list:
        sched, by_n = engine.scheduler, engine.spec_stats.steps_by_num_drafts
        running, admitting, before = len(sched.running), bool(sched.waiting), dict(by_n)
        weighed_before = weighed(engine)
        t0 = time.perf_counter()
        out = step()
        ms = (time.perf_counter() - t0) * 1e3
        drafted = [n for n, c in by_n.items() if c != before.get(n, 0)]
        n = drafted[0] if drafted else None
        records.append(StepRecord(ms, running, admitting, n, weighed_before, handed[:]))
        handed.clear()
        return out

    # Instance attributes over the methods, removed below.
    engine.step = timed_step
    if chooser is not None:
        record = chooser.record_if_uniform
        chooser.record_if_uniform = record_if_uniform
    try:
        t0 = now()
        llm.generate(batch, params, use_tqdm=False)
        return now() - t0, records
    finally:
        del engine.step
        if chooser is not None:
            del chooser.record_if_uniform


def breakdown(elapsed: float, records: list[StepRecord], full: int) -> list[list]:
    """[kind, steps, ms, share of the pass, ms a step] by kind of step (module docstring)."""
    groups: dict[str, list[float]] = defaultdict(list)
    for r in records:
        n = "none" if r.num_drafts is None else r.num_drafts
        kind = "admit" if r.admitting else f"N = {n}, " + ("full" if r.running >= full else "tail")
        groups[kind].append(r.ms)
    total = elapsed * 1e3
    groups["host"] = [total - sum(r.ms for r in records)]
    return [
        [kind, len(ms), sum(ms), 100 * sum(ms) / total, sum(ms) / len(ms)]
        for kind, ms in sorted(groups.items())
    ]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--passes", type=int, default=4)
    p.add_argument("--accept", type=float, default=0.86)
    engine_names = ["default", "fixed"]
    p.add_argument("--engines", nargs="+", default=engine_names, choices=engine_names)
    p.add_argument("--trace", default=None, help="a JSON file for every pass's step records")
    args = p.parse_args()
    target, drafter = SHAPES[args.shape].dirs()
    prompt = torch.randint(1000, 100_000, (args.prompt_len,)).tolist()
    kw = dict(
        load_format="dummy",
        max_model_len=args.prompt_len + args.new_tokens + 64,
        max_num_seqs=args.concurrency,
    )
    batch = [prompt] * args.concurrency
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    rows, parts, trace = [], [], []
    compiles = TritonCompileLog()
    engines = {"default": ("default schedule", 15, "auto"), "fixed": ("fixed N=7", 7, None)}
    for label, n, schedule in (engines[e] for e in args.engines):
        llm = dflash_llm(target, drafter, n, schedule, args.accept, kw)
        warm = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        for _ in range(2):
            llm.generate(batch, warm, use_tqdm=False)
        for i in range(args.passes):
            with compiles.timed(f"{label}, pass {i + 1}"):
                elapsed, records = timed_pass(llm, batch, params)
            trace.append({"engine": label, "pass": i + 1, "s": elapsed,
                          "steps": [dataclasses.asdict(r) for r in records]})  # fmt: skip
            times = sorted(r.ms for r in records)
            rows.append([label, i + 1, args.concurrency * args.new_tokens / elapsed, len(times),
                         times[len(times) // 2], times[-1]])  # fmt: skip
            if i == args.passes - 1:
                parts += [[label, *row] for row in breakdown(elapsed, records, args.concurrency)]
        llm.shutdown()
    title = f"{args.shape}, concurrency {args.concurrency}, {args.new_tokens} new tokens"
    print_table(
        f"{title}, p={args.accept}",
        ["engine", "pass", "tok/s", "steps", "median step ms", "max step ms"],
        rows,
    )
    print_table(
        f"{title}: where the last pass's time went",
        ["engine", "steps", "count", "ms", "% of pass", "ms a step"],
        parts,
    )
    for phase, kernels in compiles.by_phase().items():
        print(f"Triton compiles inside {phase}: {', '.join(kernels)}")
    if args.trace:
        Path(args.trace).write_text(json.dumps(trace))


if __name__ == "__main__":
    main()
