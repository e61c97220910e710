"""Plot gpu_bench.py's JSON: throughput against concurrency, AR vs DFlash, with the roofline.

python benchmarks/plot_gpu.py results/gpu_bench.json results/gpu_throughput.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src: str, dst: str) -> None:
    r = json.loads(open(src).read())
    conc = r["concurrency_tok_s"]
    levels = sorted(int(c) for c in conc["ar"])
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    ax.plot(levels, [conc["ar"][str(c)] for c in levels], "o-", label="blockdraft AR")
    schedule = " by batch" if "dflash_n15" in conc else ""
    ax.plot(
        levels,
        [conc["dflash"][str(c)] for c in levels],
        "o-",
        label=f"DFlash, N{schedule} (τ={r['mean_acceptance_length']:.1f}, synthetic)",
    )
    if "dflash_n15" in conc:
        ax.plot(
            levels,
            [conc["dflash_n15"][str(c)] for c in levels],
            "^:",
            label=f"DFlash, fixed N = 15 (τ={r['mean_acceptance_length_n15']:.1f})",
        )
    small = r.get("small_block") or {}
    if small.get("tok_s"):
        levels_small = sorted(int(c) for c in small["tok_s"])
        ax.plot(
            levels_small,
            [small["tok_s"][str(c)] for c in levels_small],
            "s--",
            label=f"DFlash at block {small['block_size']} "
            f"(τ={small['mean_acceptance_length']:.1f})",
        )
    ax.axhline(r["roofline_tok_s"], color="gray", ls="--", label="batch-1 roofline")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tok/s")
    ax.set_title(f"Qwen3-8B shapes, bf16, {r['hardware']} ({r['date']})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    Path(dst).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(dst)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
