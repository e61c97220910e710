"""`blockdraft generate` on a CPU shared with a busy process: tokens/s with torch's default
thread count (one per physical core), with blockdraft's default (the cores free at start,
blockdraft/threads.py) and with one thread, each on an idle machine and next to competing
CPU-bound processes. Every run is a fresh `blockdraft generate` process; the settings take
turns within each repeat so that a drift of the machine's speed falls on all of them; the
median of the repeats is reported.

    .venv/bin/python -m benchmarks.cpu_contention [--max-tokens 32] [--repeats 5]
        [--competitors 1] [--draft none] [--json out.json]

Run it on an otherwise quiet machine: "idle" means no other work.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from benchmarks.common import hardware, print_table

PROMPT = "Write a short story about a robot who learns to paint."
# A competitor: one CPU-bound process that never sleeps.
BUSY_LOOP = "while True: pass"
# The start-up line and the result line `blockdraft generate` prints.
THREADS_RE = re.compile(r"(\d+) CPU threads? \(")
RATE_RE = re.compile(r"\[(\d+) tokens in ([\d.]+) s, ([\d.]+) tok/s")


@contextmanager
def competitors(count: int, warm_up_s: float = 1.0) -> Iterator[None]:
    procs = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(count)]
    try:
        time.sleep(warm_up_s if count else 0)
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def run_generate(args: argparse.Namespace, threads: int | None) -> tuple[float, int]:
    """tok/s of one `blockdraft generate` process, and the thread count it ran with."""
    cmd = [sys.executable, "-m", "blockdraft.cli", "generate", args.prompt, "--device", "cpu",
           "--max-tokens", str(args.max_tokens)]  # fmt: skip
    if args.draft is not None:
        cmd += ["--draft", args.draft]
    if threads is not None:
        cmd += ["--threads", str(threads)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    rate, used = RATE_RE.search(done.stdout), THREADS_RE.search(done.stderr)
    if done.returncode != 0 or rate is None or used is None:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}")
    return float(rate.group(3)), int(used.group(1))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per generate")
    parser.add_argument("--repeats", type=int, default=5, help="runs per setting and condition")
    parser.add_argument(
        "--competitors", type=int, default=1, help="busy processes in the 'busy' condition"
    )
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument(
        "--draft", default=None, help="passed to generate (unset: generate's default)"
    )
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)

    # torch's own default in a fresh process: one thread per physical core (or OMP_NUM_THREADS).
    torch_default = torch.get_num_threads()
    settings = {
        f"torch default ({torch_default})": torch_default,
        "blockdraft default": None,
        "1 thread": 1,
    }
    rows, results = [], []
    for condition, count in [("idle", 0), (f"{args.competitors} busy", args.competitors)]:
        rates: dict[str, list[float]] = {name: [] for name in settings}
        used: dict[str, set[int]] = {name: set() for name in settings}
        with competitors(count):
            for _ in range(args.repeats):
                for name, threads in settings.items():
                    rate, n = run_generate(args, threads)
                    rates[name].append(rate)
                    used[name].add(n)
        for name in settings:
            median = statistics.median(rates[name])
            threads_used = ",".join(str(n) for n in sorted(used[name]))
            rows.append([condition, name, threads_used, median,
                         " ".join(f"{r:.1f}" for r in rates[name])])  # fmt: skip
            results.append({"condition": condition, "setting": name, "threads": sorted(used[name]),
                            "median_tok_s": median, "tok_s": rates[name]})  # fmt: skip
    print_table(
        f"blockdraft generate, {args.max_tokens} tokens, {hardware()}, median of {args.repeats}",
        ["condition", "setting", "threads", "tok/s", "runs"],
        rows,
    )
    out = {"max_tokens": args.max_tokens, "repeats": args.repeats, "results": results}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()
