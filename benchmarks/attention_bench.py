"""Decode-attention sweep on Qwen3-8B (or SmolLM2-135M) shapes: split-K and tile choices of the
Triton paged attention for few query rows over short contexts. CUDA only.

    python benchmarks/attention_bench.py [--seq-lens 512 640 768] [--batches 1 8]
        [--query-lens 1 16] [--shape qwen3-8b|smollm2-135m] [--json F]
        [--no-sweep] [--short-split-keys K]

A batch-1 decode over 512-768 keys is 8 KV heads' worth of programs walking a few KB each:
latency, not bandwidth, so the split count and the tile shape decide its time. For each
(batch, query rows, keys) this times the default launch (`triton_attention`'s rules) and a
grid of num_splits x block_n x num_warps x num_stages, each as one CUDA graph of one call per
layer (36 on Qwen3-8B), each layer with its own KV cache on shuffled pages (so the keys come
from HBM), the split-K reduction included. Every variant's output is checked against
the default's. Prints the per-layer microseconds of the default and the best variant per case.
`--no-sweep` times the default launch alone; `--short-split-keys` moves the rule's bound on
the walks that take 32-key tiles (A/B of the rule at long contexts).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import hardware, print_table  # noqa: E402
from benchmarks.gemv_bench import time_per_call  # noqa: E402

BLOCK_SIZE = 16
# name -> (layers, query heads, kv heads, head_dim)
SHAPES = {"qwen3-8b": (36, 32, 8, 128), "smollm2-135m": (30, 9, 3, 64)}
SPLITS = (1, 2, 4, 6, 8, 12, 16, 24)
BLOCK_NS = (16, 32, 64)
WARPS = (2, 4)
STAGES = (2, 3)
MAX_ERR = 2e-2


def layer_inputs(
    shape: tuple[int, int, int, int], batch: int, q_len: int, seq_len: int, gen: torch.Generator
) -> tuple:
    """Query, KV caches (one per layer) and metadata for `batch` sequences of `seq_len` keys
    whose last `q_len` are the queries; pages shuffled across the cache."""
    from blockdraft.kernels.forward_context import AttentionMetadata

    num_layers, num_heads, num_kv_heads, head_dim = shape
    pages = -(-seq_len // BLOCK_SIZE)
    num_blocks = batch * pages
    cache_shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    caches = [
        (torch.randn(cache_shape, generator=gen, device="cuda").bfloat16(),
         torch.randn(cache_shape, generator=gen, device="cuda").bfloat16())
        for _ in range(num_layers)
    ]  # fmt: skip
    tables = torch.randperm(num_blocks, generator=gen, device="cuda").view(batch, pages)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(batch * q_len, dtype=torch.int64, device="cuda"),
        query_start_loc=torch.arange(batch + 1, device="cuda") * q_len,
        seq_lens=torch.full((batch,), seq_len, device="cuda"),
        block_tables=tables,
        max_query_len=q_len,
        max_seq_len=seq_len,
        block_size=BLOCK_SIZE,
        uniform_query_len=True,
    )
    query = torch.randn(batch * q_len, num_heads, head_dim, generator=gen, device="cuda")
    return query.bfloat16(), caches, meta


def time_case(
    shape: tuple[int, int, int, int],
    batch: int,
    q_len: int,
    seq_len: int,
    gen: torch.Generator,
    reps: int,
    sweep: bool = True,
) -> dict:
    """Per-layer microseconds of the default launch and of every variant (checked against
    the default's output) for one (batch, query rows, keys) case."""
    from blockdraft.kernels.triton_attention import triton_paged_attention

    query, caches, meta = layer_inputs(shape, batch, q_len, seq_len, gen)
    out = torch.empty_like(query)
    scale = shape[3] ** -0.5
    layers = shape[0]

    def calls(**launch) -> list:
        return [
            lambda k=k, v=v: triton_paged_attention(query, k, v, meta, scale, out=out, **launch)
            for k, v in caches
        ]

    ref = calls()[0]().clone()
    default_us = time_per_call(calls(), layers, reps) * 1e6
    variants = []
    grid = itertools.product(SPLITS, BLOCK_NS, WARPS, STAGES) if sweep else ()
    for splits, block_n, warps, stages in grid:
        launch = dict(num_splits=splits, block_n=block_n, num_warps=warps, num_stages=stages)
        try:
            err = (calls(**launch)[0]().float() - ref.float()).abs().max().item()
            if not err <= MAX_ERR:
                raise RuntimeError(f"max err {err:.3g}")
            us = time_per_call(calls(**launch), layers, reps) * 1e6
            variants.append({**launch, "us": us})
        except Exception as exc:  # a launch that does not compile or fit
            print(f"  skip {launch}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
    best = min(variants, key=lambda v: v["us"]) if variants else {"us": default_us}
    return {"batch": batch, "query_len": q_len, "seq_len": seq_len, "default_us": default_us,
            "best": best, "variants": variants}  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[512, 640, 768])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--query-lens", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--reps", type=int, default=5, help="timed replays per variant")
    parser.add_argument("--shape", choices=SHAPES, default="qwen3-8b", help="attention shapes")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--no-sweep", action="store_true", help="time the default launch only")
    parser.add_argument(
        "--short-split-keys", type=int, default=None,
        help="override triton_attention.SHORT_SPLIT_KEYS (the longest walk a program may make "
        "and still take the short-split launch) for this run",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.short_split_keys is not None:
        from blockdraft.kernels import triton_attention

        triton_attention.SHORT_SPLIT_KEYS = args.short_split_keys

    if not torch.cuda.is_available():
        sys.exit("attention_bench.py times CUDA kernels and needs a CUDA GPU; none is visible.")
    t_start = time.perf_counter()
    gen = torch.Generator(device="cuda").manual_seed(0)
    cases = []
    for batch, q_len, seq_len in itertools.product(args.batches, args.query_lens, args.seq_lens):
        case = time_case(
            SHAPES[args.shape], batch, q_len, seq_len, gen, args.reps, not args.no_sweep
        )
        cases.append(case)
        best = case["best"]
        print(
            f"batch {batch} q {q_len} keys {seq_len}: default {case['default_us']:.2f} us, "
            f"best {best['us']:.2f} us {best}  [{time.perf_counter() - t_start:.0f}s]"
        )
        torch.cuda.empty_cache()
    seconds = time.perf_counter() - t_start
    report = {"device": hardware(), "shape": args.shape, "cases": cases, "seconds": seconds}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    print_table(
        "Paged attention per layer (us; split-K reduction included)",
        ["batch", "q rows", "keys", "default", "best", "splits", "block_n", "warps", "stages"],
        [
            [
                c["batch"],
                c["query_len"],
                c["seq_len"],
                c["default_us"],
                c["best"]["us"],
                c["best"].get("num_splits", "default"),
                c["best"].get("block_n", "default"),
                c["best"].get("num_warps", "default"),
                c["best"].get("num_stages", "default"),
            ]
            for c in cases
        ],  # fmt: skip
    )
    return report


if __name__ == "__main__":
    main()
