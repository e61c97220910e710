"""Device timeline of steady batch-1 steps on a benchmark shape (random bf16 weights; Qwen3-8B
by default): every kernel with its duration and the idle gap before it, summed per kernel and
per step, and the host calls that ran while the device waited in its largest gaps.

gpu_bench's `--profile` sums kernel times; this keeps their order, which tells where the GPU
idles (between kernels inside a graph, or waiting for the host between steps) and how long
each GEMM of a layer takes in place. Needs an NVIDIA GPU.

    python benchmarks/step_timeline.py [--shape qwen3.5-27b] [--engine ar dflash] [--steps 6]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import start_requests, stop_requests  # noqa: E402
from benchmarks.gpu_bench import dflash_llm  # noqa: E402
from benchmarks.shapes import SHAPES  # noqa: E402
from blockdraft import LLM  # noqa: E402

DEVICE_EVENTS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_EVENTS = ("python_function", "cpu_op", "cuda_runtime", "cuda_driver")


def trace_events(trace_path: Path) -> tuple[list[dict], list[dict]]:
    """The device's kernels, copies and memsets of a Chrome trace, and its host calls (Python
    functions and torch ops), each by start time (µs)."""
    events = json.loads(trace_path.read_text())["traceEvents"]
    timed = [e for e in events if "ts" in e and "dur" in e]
    device = [e for e in timed if e.get("cat") in DEVICE_EVENTS]
    host = [e for e in timed if e.get("cat") in HOST_EVENTS]
    return sorted(device, key=lambda e: e["ts"]), sorted(host, key=lambda e: e["ts"])


def host_calls_in(host: list[dict], start: float, end: float, top: int = 6) -> list[str]:
    """The host calls that overlap [start, end) longest, innermost first among equals: what
    the device waited for."""
    overlap = []
    for e in host:
        if e["ts"] >= end:
            break
        o = min(end, e["ts"] + e["dur"]) - max(start, e["ts"])
        if o > 0:
            overlap.append((o, e["dur"], e["name"][:70]))
    # Overlaps within 0.1 us are equal (then innermost first); each is printed rounded once.
    overlap.sort(key=lambda t: (-round(t[0], 1), t[1]))
    return [f"{o:.0f} us {name}" for o, _, name in overlap[:top]]


def summarize(
    events: list[dict], steps: int, host: list[dict] | None = None
) -> tuple[dict, list[str]]:
    """Per-step figures of the middle steps (the first and last are cut at the edges of the
    profile), and one timeline line per event."""
    t0, t1 = events[0]["ts"], events[-1]["ts"] + events[-1]["dur"]
    per_step = (t1 - t0) / steps
    lo, hi = t0 + per_step, t0 + per_step * (steps - 1)
    middle = [e for e in events if lo <= e["ts"] < hi]
    n = steps - 2
    busy = gaps = 0.0
    end = None
    lines, by_kernel, gap_list = [], {}, []
    for e in middle:
        start, dur = e["ts"], e["dur"]
        gap = 0.0 if end is None else max(0.0, start - end)
        busy += dur if end is None else max(0.0, start + dur - max(start, end))
        end = start + dur if end is None else max(end, start + dur)
        gaps += gap
        gap_list.append((gap, e["name"][:40], start - gap, start))
        count, total = by_kernel.get(e["name"][:48], (0, 0.0))
        by_kernel[e["name"][:48]] = (count + 1, total + dur)
        lines.append(f"{start - lo:10.1f} {dur:8.2f} gap {gap:7.2f} {e['name'][:100]}")
    largest = sorted(gap_list, reverse=True)
    summary = {
        "span_ms": (hi - lo) / n / 1e3,
        "busy_ms": busy / n / 1e3,
        "gaps_ms": gaps / n / 1e3,
        "events_per_step": len(middle) / n,
        "kernels": {k: {"per_step": c / n, "ms": d / n / 1e3}
                    for k, (c, d) in sorted(by_kernel.items(), key=lambda kv: -kv[1][1])},
        "largest_gaps_us": [[round(g, 1), n] for g, n, *_ in largest[:8]],
        "host_in_gaps": [
            [round(g, 1), name, host_calls_in(host or [], a, b)]
            for g, name, a, b in largest[:4]
            if g > 0
        ],
    }  # fmt: skip
    return summary, lines


def timeline(
    llm: LLM, prompt: list[int], steps: int, trace_path: Path
) -> tuple[list[dict], list[dict]]:
    start_requests(llm, prompt, 1, warm_steps=8)
    torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with profile(activities=activities, with_stack=True) as prof:
        for _ in range(steps):
            llm.engine.step()
        torch.cuda.synchronize()
    stop_requests(llm, 1)
    prof.export_chrome_trace(str(trace_path))
    return trace_events(trace_path)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    p.add_argument("--engine", nargs="+", choices=["ar", "dflash"], default=["ar", "dflash"])
    p.add_argument("--steps", type=int, default=6, help="profiled steps (>= 3)")
    p.add_argument("--accept", type=float, default=0.86)
    p.add_argument(
        "--out", default="results/step_timeline", help="folder for the traces and timelines"
    )
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("step_timeline.py needs a CUDA device")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target, drafter = SHAPES[args.shape].dirs()
    prompt = torch.randint(1000, 100_000, (512,)).tolist()
    kw = dict(load_format="dummy", max_model_len=832, max_num_seqs=32)
    results = {}
    for name in args.engine:
        if name == "ar":
            llm = LLM(str(target), **kw)
        else:
            llm = dflash_llm(target, drafter, 15, None, args.accept, kw)
        events, host = timeline(llm, prompt, max(args.steps, 3), out / f"trace_{name}.json")
        summary, lines = summarize(events, max(args.steps, 3), host)
        (out / f"timeline_{name}.txt").write_text("\n".join(lines) + "\n")
        results[name] = summary
        print(f"\n{name}: step {summary['span_ms']:.3f} ms, busy {summary['busy_ms']:.3f}, "
              f"idle {summary['gaps_ms']:.3f} in gaps, {summary['events_per_step']:.0f} "
              "device events a step")  # fmt: skip
        for kernel, v in list(summary["kernels"].items())[:10]:
            print(f"  {kernel:<48} {v['per_step']:6.1f}/step {v['ms']:7.3f} ms")
        print("  largest gaps (µs):", summary["largest_gaps_us"][:5])
        for gap, kernel, calls in summary["host_in_gaps"]:
            print(f"  gap {gap:.0f} us before {kernel}: host in " + "; ".join(calls))
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    (out / "step_timeline.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
