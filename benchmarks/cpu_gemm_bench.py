"""The CPU's few-row GEMMs on the default target's shapes: `F.linear` (x @ W.T) and `W @ x.T`
against blockdraft's `linear` (which picks one of them by the row count,
blockdraft/layers/linear.py), fp32, over a whole
forward's weights (SmolLM2-135M: 30 layers of fused qkv, o, fused gate_up and down, then the LM
head), so every product reads its weight from memory as a decode or verify step does.

    python -m benchmarks.cpu_gemm_bench [--threads 1] [--rows 1 2 3 4 8 16 64] [--reps 5]
        [--json F]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from benchmarks.common import SMOLLM2_135M, hardware, now, print_table
from blockdraft.layers.linear import linear


def forward_weights(cfg: dict) -> list[torch.Tensor]:
    """One forward's projection weights, [out_features, in_features] each."""
    h, i, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    qkv = (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * d
    layer = [(qkv, h), (h, cfg["num_attention_heads"] * d), (2 * i, h), (h, i)]
    shapes = layer * cfg["num_hidden_layers"] + [(cfg["vocab_size"], h)]
    return [torch.randn(n, k) for n, k in shapes]


def weight_left(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ W.T computed as (W @ x.T).T, the weight as the left operand, as stored."""
    return torch.mm(w, x.t()).t().contiguous()


def time_forward(
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    weights: list[torch.Tensor],
    rows: int,
    reps: int,
) -> float:
    """Median seconds over `reps` passes of `fn(x, w)` over every weight."""
    inputs = {k: torch.randn(rows, k) for k in {w.shape[1] for w in weights}}
    times = []
    with torch.no_grad():
        for _ in range(reps + 1):  # the first pass warms up
            t0 = now()
            for w in weights:
                fn(inputs[w.shape[1]], w)
            times.append(now() - t0)
    return statistics.median(times[1:])


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 8, 16, 64])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.threads < 1 or args.reps < 1 or min(args.rows) < 1:
        raise SystemExit("--threads, --reps and --rows must be >= 1")
    torch.set_num_threads(args.threads)
    weights = forward_weights(SMOLLM2_135M)
    results = []
    for rows in tqdm(args.rows, desc="rows"):
        f_linear = time_forward(F.linear, weights, rows, args.reps)
        left = time_forward(weight_left, weights, rows, args.reps)
        ours = time_forward(linear, weights, rows, args.reps)
        results.append({"rows": rows, "f_linear_ms": f_linear * 1e3,
                        "weight_left_ms": left * 1e3, "linear_ms": ours * 1e3})  # fmt: skip
    print_table(
        f"one forward's GEMMs, SmolLM2-135M shapes, fp32, {args.threads} thread(s), median ms",
        ["rows", "F.linear", "W @ x.T", "blockdraft linear", "best / ours"],
        [
            [
                r["rows"],
                r["f_linear_ms"],
                r["weight_left_ms"],
                r["linear_ms"],
                min(r["f_linear_ms"], r["weight_left_ms"]) / r["linear_ms"],
            ]
            for r in results
        ],  # fmt: skip
    )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        out = {"hardware": hardware(), "date": datetime.date.today().isoformat(),
               "args": vars(args), "results": results}  # fmt: skip
        Path(args.json).write_text(json.dumps(out, indent=1))
    return results


if __name__ == "__main__":
    main()
