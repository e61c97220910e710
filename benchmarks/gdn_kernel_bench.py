"""Gated DeltaNet kernels on a hybrid target's heads, Triton against the torch twins: the decode
step (one row a sequence), the verify forward (blocks of each `--rows`; the row kernel, and
the chunked form at each `--chunked-block-v`) and the commit after it (`--accepted` rows
kept), at each batch size, random inputs and states.

On a GPU each kernel is timed as replays of a CUDA graph of ten calls (launch costs amortised,
as in the engine's graphs), each twin as plain calls (they read back to the host); on the CPU
(`--tiny`, a smoke run under Triton's interpreter) both as plain calls. The outputs of the two
paths are compared (max |diff|).

H200, Qwen3.5-27B heads:  python -m benchmarks.gdn_kernel_bench
CPU smoke:                TRITON_INTERPRET=1 python -m benchmarks.gdn_kernel_bench --tiny
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable

import torch

from benchmarks.common import hardware, print_table, time_eager, time_graph

# (key heads, value heads, key dim, value dim, conv taps)
HEADS = {
    "qwen3.5-27b": (16, 48, 128, 128, 4),
    "qwen3.5-35b-a3b": (16, 32, 128, 128, 4),  # also Qwen3-Next-80B-A3B's
    "tiny": (2, 6, 16, 16, 4),
}


def time_us(fn: Callable[[], object], graphed: bool, reps: int) -> float:
    """Microseconds a call: replays of a CUDA graph of ten calls (`graphed`, a GPU), else plain
    calls (the torch twins index by masks, which reads back to the host: no graph)."""
    if graphed and torch.cuda.is_available():
        return time_graph([fn], 10, reps) * 1e3
    return time_eager([fn], reps) * 1e3


def layer_inputs(heads: tuple, rows: int, slots: int, device: torch.device, dtype: torch.dtype):
    """Projections of `rows` rows, a layer's weights and `slots` slots of states and stashes."""
    hk, hv, dk, dv, taps = heads
    conv_dim = 2 * hk * dk + hv * dv

    def randn(*shape, scale=1.0, dt=dtype):
        return (scale * torch.randn(*shape, device=device)).to(dt)

    projections = (randn(rows, conv_dim), randn(rows, 2 * hv), randn(rows, hv * dv))
    weights = (randn(conv_dim, taps, scale=0.5), randn(hv, scale=0.5), randn(hv),
               1 + randn(dv, scale=0.2), 1e-6, hk)  # fmt: skip
    states = randn(slots, hv, dk, dv, scale=0.1, dt=torch.float32)
    pools = (randn(slots, taps - 1, conv_dim), states)
    return projections, weights, pools


def stashes(heads: tuple, slots: int, width: int, device: torch.device, dtype: torch.dtype):
    hk, hv, dk, dv, _ = heads
    conv_dim = 2 * hk * dk + hv * dv
    return (
        torch.zeros(slots, width, conv_dim, device=device, dtype=dtype),
        torch.zeros(slots, width, conv_dim, device=device, dtype=dtype),
        torch.zeros(slots, width, 2 * hv, device=device),
    )


def verify_inputs(heads: tuple, batch: int, rows: int, device: torch.device, dtype: torch.dtype):
    """A verify forward of `batch` blocks of `rows` rows from slots 0..batch-1: projections,
    weights, pools with stashes, and the block arguments (slots, fresh, rows, lengths)."""
    projections, weights, pools = layer_inputs(heads, batch * rows, batch + 1, device, dtype)
    pools = [*pools, *stashes(heads, batch + 1, rows + 1, device, dtype)]
    block = (
        torch.arange(batch, device=device),
        torch.zeros(batch, dtype=torch.bool, device=device),
        torch.arange(batch * rows, device=device).view(batch, rows),
        torch.full((batch,), rows, device=device),
    )
    return projections, weights, pools, block


def twin_and_kernel_us(
    call: Callable[[Callable, list], object], twin: tuple, kernel: tuple, reps: int
) -> list[float]:
    """[twin us, kernel us]: `call(fn, pools)` with each (fn, pools), the twin eagerly, the
    kernel as graph replays."""
    return [time_us(lambda: call(*twin), False, reps), time_us(lambda: call(*kernel), True, reps)]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def bench_batch(
    heads: tuple,
    batch: int,
    rows: int,
    accepted: int,
    chunked_block_v: list[int],
    chunked_warps: list[int],
    decode_v_splits: list[int],
    device: torch.device,
    dtype: torch.dtype,
    reps: int,
) -> list[tuple]:
    """[(kernel, torch us, triton us, max |diff|)] for one batch size."""
    from blockdraft.kernels.gated_delta_rule import gated_deltanet_decode_torch
    from blockdraft.kernels.triton_gated_deltanet_step import (
        state_block_v,
        triton_gated_deltanet_decode,
    )
    from blockdraft.kernels.triton_gated_deltanet_verify import (
        gated_deltanet_commit_torch,
        gated_deltanet_verify_torch,
        triton_gated_deltanet_commit,
        triton_gated_deltanet_verify,
    )
    from blockdraft.kernels.triton_gated_deltanet_verify_chunk import (
        triton_gated_deltanet_verify_chunked,
    )

    slots = torch.arange(batch, device=device)
    fresh = torch.zeros(batch, dtype=torch.bool, device=device)
    results = []

    projections, weights, pools = layer_inputs(heads, batch, batch + 1, device, dtype)
    twin, kernel = [p.clone() for p in pools], [p.clone() for p in pools]
    want = gated_deltanet_decode_torch(*projections, *weights, *twin, slots, fresh)
    got = triton_gated_deltanet_decode(*projections, *weights, *kernel, slots, fresh)
    err = max(max_diff(got, want), max_diff(kernel[1], twin[1]))
    times = twin_and_kernel_us(
        lambda f, p: f(*projections, *weights, *p, slots, fresh),
        (gated_deltanet_decode_torch, twin),
        (triton_gated_deltanet_decode, kernel),
        reps,
    )
    results.append(("decode", *times, err))
    value_blocks = -(-heads[3] // state_block_v(heads[3]))
    for v_splits in (v for v in decode_v_splits if v <= value_blocks):
        split = [p.clone() for p in pools]

        def decode_split(p=split, v_splits=v_splits) -> torch.Tensor:
            return triton_gated_deltanet_decode(
                *projections, *weights, *p, slots, fresh, v_splits=v_splits
            )

        err = max_diff(decode_split(), want)
        times[1] = time_us(decode_split, True, reps)
        results.append((f"decode, heads split over {v_splits} programs", *times, err))

    projections, weights, twin, block = verify_inputs(heads, batch, rows, device, dtype)
    kernel = [p.clone() for p in twin]
    want = gated_deltanet_verify_torch(*projections, *weights, *twin, *block)
    got = triton_gated_deltanet_verify(*projections, *weights, *kernel, *block)
    times = twin_and_kernel_us(
        lambda f, p: f(*projections, *weights, *p, *block),
        (gated_deltanet_verify_torch, twin),
        (triton_gated_deltanet_verify, kernel),
        reps,
    )
    results.append((f"verify {rows} rows", *times, max_diff(got, want)))
    for block_v, warps in itertools.product(chunked_block_v, chunked_warps):
        chunked = [p.clone() for p in twin]

        def verify_chunked(p=chunked, block_v=block_v, warps=warps) -> torch.Tensor:
            return triton_gated_deltanet_verify_chunked(
                *projections, *weights, *p, *block, block_v=block_v, num_warps=warps
            )

        err = max_diff(verify_chunked(), want)
        times[1] = time_us(verify_chunked, True, reps)
        name = f"verify {rows} rows, chunked, {block_v} value dims, {warps} warps"
        results.append((name, *times, err))

    kept = torch.full((batch,), accepted, device=device)
    hk = heads[0]
    gated_deltanet_commit_torch(hk, *twin, slots, kept)
    triton_gated_deltanet_commit(hk, *kernel, slots, kept)
    err = max_diff(kernel[1], twin[1])
    times = twin_and_kernel_us(
        lambda f, p: f(hk, *p, slots, kept),
        (gated_deltanet_commit_torch, twin),
        (triton_gated_deltanet_commit, kernel),
        reps,
    )
    results.append((f"commit {accepted} rows", *times, err))
    return results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(HEADS), default="qwen3.5-27b")
    p.add_argument("--tiny", action="store_true", help="tiny heads (CPU smoke run)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument(
        "--rows", type=int, nargs="+", default=[16], help="rows of a verify block (1 + N)"
    )
    p.add_argument("--accepted", type=int, default=5, help="rows a commit keeps")
    p.add_argument(
        "--chunked-block-v",
        type=int,
        nargs="*",
        default=[32, 64],
        help="value dims a program of the chunked verify holds (one row each)",
    )
    p.add_argument("--chunked-warps", type=int, nargs="+", default=[4, 8])
    p.add_argument(
        "--decode-v-splits",
        type=int,
        nargs="*",
        default=[2, 4],
        help="programs the decode kernel splits each value head over (one timed row each; "
        "counts past the head's blocks of 32 value dims are left out)",
    )
    p.add_argument("--reps", type=int, default=50)
    args = p.parse_args(argv)
    if not 1 <= args.accepted <= min(args.rows):
        p.error(f"--accepted must lie in 1..{min(args.rows)} (--rows), not {args.accepted}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    heads = HEADS["tiny" if args.tiny else args.shape]
    torch.manual_seed(0)
    rows = []
    for batch, block_rows in itertools.product(args.batches, args.rows):
        for name, t_torch, t_triton, err in bench_batch(
            heads,
            batch,
            block_rows,
            args.accepted,
            args.chunked_block_v,
            args.chunked_warps,
            args.decode_v_splits,
            device,
            dtype,
            args.reps,
        ):
            rows.append([batch, name, t_torch, t_triton, t_torch / t_triton, f"{err:.3g}"])
    print_table(
        f"Gated DeltaNet kernels, {'tiny' if args.tiny else args.shape} heads {heads[:4]}, conv "
        f"{heads[4]}, {dtype}, {hardware()}",
        ["batch", "kernel", "torch us", "triton us", "speed-up", "max |diff|"],
        rows,
    )


if __name__ == "__main__":
    main()
