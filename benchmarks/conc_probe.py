"""Per-pass DFlash throughput at one concurrency on Qwen3-8B shapes (random bf16 weights, a GPU),
with the step times of each pass: for telling a configuration's rate from a stalled pass.

    python benchmarks/conc_probe.py [--concurrency 32] [--new-tokens 256] [--passes 4]

Runs the default draft schedule and fixed N = 7 (block 8), synthetic acceptance p = 0.86.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import now, print_table  # noqa: E402
from benchmarks.gpu_bench import dflash_llm  # noqa: E402
from benchmarks.shapes import SHAPES  # noqa: E402
from blockdraft import SamplingParams  # noqa: E402


def timed_pass(llm: object, batch: list, params: SamplingParams) -> tuple[float, list[float]]:
    """Seconds of one `generate` over `batch`, and the ms of each engine step in it, sorted."""
    engine = llm.engine
    step = engine.step
    times: list[float] = []

    def timed_step() -> list:
        t0 = now()
        out = step()
        times.append((now() - t0) * 1e3)
        return out

    engine.step = timed_step  # an instance attribute over the method, removed below
    try:
        t0 = now()
        llm.generate(batch, params, use_tqdm=False)
        return now() - t0, sorted(times)
    finally:
        del engine.step


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--passes", type=int, default=4)
    p.add_argument("--accept", type=float, default=0.86)
    args = p.parse_args()
    target, drafter = SHAPES["qwen3-8b"].dirs()
    prompt = torch.randint(1000, 100_000, (args.prompt_len,)).tolist()
    kw = dict(
        load_format="dummy",
        max_model_len=args.prompt_len + args.new_tokens + 64,
        max_num_seqs=args.concurrency,
    )
    batch = [prompt] * args.concurrency
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    rows = []
    for label, n, schedule in [("default schedule", 15, "auto"), ("fixed N=7", 7, None)]:
        llm = dflash_llm(target, drafter, n, schedule, args.accept, kw)
        warm = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        for _ in range(2):
            llm.generate(batch, warm, use_tqdm=False)
        for i in range(args.passes):
            elapsed, times = timed_pass(llm, batch, params)
            rows.append([label, i + 1, args.concurrency * args.new_tokens / elapsed, len(times),
                         times[len(times) // 2], times[-1]])  # fmt: skip
        del llm
        torch.cuda.empty_cache()
    print_table(
        f"concurrency {args.concurrency}, {args.new_tokens} new tokens, p={args.accept}",
        ["engine", "pass", "tok/s", "steps", "median step ms", "max step ms"],
        rows,
    )


if __name__ == "__main__":
    main()
