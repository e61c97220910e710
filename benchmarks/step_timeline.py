"""Device timeline of steady batch-1 steps on Qwen3-8B shapes (random bf16 weights): every
kernel with its duration and the idle gap before it, summed per kernel and per step.

gpu_bench's `--profile` sums kernel times; this keeps their order, which tells where the GPU
idles (between kernels inside a graph, or waiting for the host between steps) and how long
each GEMM of a layer takes in place. Needs an NVIDIA GPU.

    python benchmarks/step_timeline.py [--engine ar dflash] [--steps 6] [--out DIR]
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


def device_events(trace_path: Path) -> list[dict]:
    """The device's kernels, copies and memsets of a Chrome trace, by start time (µs)."""
    events = json.loads(trace_path.read_text())["traceEvents"]
    return sorted((e for e in events if e.get("cat") in DEVICE_EVENTS), key=lambda e: e["ts"])


def summarize(events: list[dict], steps: int) -> tuple[dict, list[str]]:
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
        gap_list.append((gap, e["name"][:40]))
        count, total = by_kernel.get(e["name"][:48], (0, 0.0))
        by_kernel[e["name"][:48]] = (count + 1, total + dur)
        lines.append(f"{start - lo:10.1f} {dur:8.2f} gap {gap:7.2f} {e['name'][:100]}")
    summary = {
        "span_ms": (hi - lo) / n / 1e3,
        "busy_ms": busy / n / 1e3,
        "gaps_ms": gaps / n / 1e3,
        "events_per_step": len(middle) / n,
        "kernels": {k: {"per_step": c / n, "ms": d / n / 1e3}
                    for k, (c, d) in sorted(by_kernel.items(), key=lambda kv: -kv[1][1])},
        "largest_gaps_us": [[round(g, 1), name] for g, name in sorted(gap_list, reverse=True)[:8]],
    }  # fmt: skip
    return summary, lines


def timeline(llm: LLM, prompt: list[int], steps: int, trace_path: Path) -> list[dict]:
    start_requests(llm, prompt, 1, warm_steps=8)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            llm.engine.step()
        torch.cuda.synchronize()
    stop_requests(llm, 1)
    prof.export_chrome_trace(str(trace_path))
    return device_events(trace_path)


def main() -> None:
    p = argparse.ArgumentParser()
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
    target, drafter = SHAPES["qwen3-8b"].dirs()
    prompt = torch.randint(1000, 100_000, (512,)).tolist()
    kw = dict(load_format="dummy", max_model_len=832, max_num_seqs=32)
    results = {}
    for name in args.engine:
        if name == "ar":
            llm = LLM(str(target), **kw)
        else:
            llm = dflash_llm(target, drafter, 15, None, args.accept, kw)
        events = timeline(llm, prompt, max(args.steps, 3), out / f"trace_{name}.json")
        summary, lines = summarize(events, max(args.steps, 3))
        (out / f"timeline_{name}.txt").write_text("\n".join(lines) + "\n")
        results[name] = summary
        print(f"\n{name}: step {summary['span_ms']:.3f} ms, busy {summary['busy_ms']:.3f}, "
              f"idle {summary['gaps_ms']:.3f} in gaps, {summary['events_per_step']:.0f} "
              "device events a step")  # fmt: skip
        for kernel, v in list(summary["kernels"].items())[:10]:
            print(f"  {kernel:<48} {v['per_step']:6.1f}/step {v['ms']:7.3f} ms")
        print("  largest gaps (µs):", summary["largest_gaps_us"][:5])
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    (out / "step_timeline.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
