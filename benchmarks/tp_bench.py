"""Tensor-parallel speed on one host's GPUs (benchmarks/shapes.py shapes, random bf16 weights made
on each rank's device).

    python -m benchmarks.tp_bench [--shape qwen3-32b] [--tp 1 2] [--concurrency 1 32]
        [--json results/tp_bench.json]

For each tensor-parallel size N:
a. batch-1 autoregressive decode: steady tok/s (one over a timed decode step) against N's
   roofline (the weight bytes a token reads split over N GPUs ÷ one GPU's copy bandwidth);
b. the all-reduces a step adds: two per layer (after attention, after the MLP) of one row
   (decode) and of 16 rows (a verify at N = 15), timed alone as one CUDA graph of them;
c. tok/s at each concurrency: plain decoding and DFlash with synthetic acceptance (p = 0.86,
   N = 15 fixed).
Then the speedup of each N over N = 1 (goal: AR ≥ 1.7×, DFlash ≥ 1.6× at N = 2).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import hardware, print_table  # noqa: E402
from benchmarks.gpu_bench import (  # noqa: E402
    conc_reps,
    copy_bandwidth,
    decode_tok_s,
    dflash_llm,
    mean_step_ms,
)
from benchmarks.shapes import SHAPES  # noqa: E402
from blockdraft import LLM  # noqa: E402


def _all_reduce_rank(rank: int, size: int, port: int, shapes: list, reps: int, out) -> None:
    """One rank of the all-reduce timing: per (rows, hidden, count), `count` all-reduces of a
    [rows, hidden] bf16 tensor captured in one CUDA graph (as the engine's step replays them),
    the median replay time in ms (rank 0 reports)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=size)
    results = []
    for rows, hidden, count in shapes:
        x = torch.randn(rows, hidden, dtype=torch.bfloat16, device="cuda")
        for _ in range(3):  # NCCL sets its communicator up outside the capture
            dist.all_reduce(x)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(count):
                dist.all_reduce(x)
        times = []
        for _ in range(reps):
            dist.barrier()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            graph.replay()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        results.append(sorted(times)[len(times) // 2])
    if rank == 0:
        out.put(results)
    dist.destroy_process_group()


def all_reduce_ms(size: int, hidden: int, layers: int, rows: list[int]) -> dict[int, float]:
    """ms of the 2 × `layers` all-reduces of one step for each row count, N = `size` GPUs."""
    ctx = torch.multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    shapes = [(r, hidden, 2 * layers) for r in rows]
    port = 29_500 + os.getpid() % 1000
    procs = [
        ctx.Process(target=_all_reduce_rank, args=(r, size, port, shapes, 20, queue))
        for r in range(size)
    ]
    for p in procs:
        p.start()
    try:
        times = queue.get(timeout=120)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return dict(zip(rows, times, strict=True))


def free(llm: LLM) -> None:
    """The engine's device memory back (shutdown frees it; the caller's name stays bound)."""
    llm.shutdown()
    gc.collect()
    torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-32b")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="tensor-parallel sizes")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=64, help="per request in c.")
    p.add_argument("--steps", type=int, default=20, help="timed decode steps in a.")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    p.add_argument("--accept", type=float, default=0.86, help="synthetic acceptance p")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if max(args.tp) > torch.cuda.device_count():
        p.error(f"--tp {max(args.tp)} needs that many GPUs; {torch.cuda.device_count()} visible")
    shape = SHAPES[args.shape]
    cfg = shape.config
    target, drafter = shape.dirs()
    prompt = torch.randint(1000, 100_000, (args.prompt_len,)).tolist()
    bandwidth = copy_bandwidth()
    token_bytes = shape.bytes_per_token(cfg)
    kw = dict(
        load_format="dummy",
        max_model_len=args.prompt_len + args.new_tokens + 64,
        max_num_seqs=max(args.concurrency),
    )
    rows = []
    for size in tqdm(args.tp, "tensor-parallel sizes"):
        row: dict = {"tp": size, "roofline_tok_s": size * bandwidth / token_bytes}
        if size > 1:
            try:
                row["all_reduce_ms"] = all_reduce_ms(size, cfg["hidden_size"],
                                                     cfg["num_hidden_layers"], [1, 16])  # fmt: skip
            except Exception as e:  # the engines' figures are still worth having
                print(f"all-reduce timing failed: {type(e).__name__}: {e}", flush=True)
        t0 = time.perf_counter()
        ar = LLM(str(target), tensor_parallel_size=size, **kw)
        row["load_s"] = time.perf_counter() - t0
        row["ar_step_ms"] = mean_step_ms(ar, prompt, 1, args.steps)
        row["ar_tok_s"] = {
            c: decode_tok_s(ar, prompt, c, args.new_tokens, conc_reps(c)) for c in args.concurrency
        }
        free(ar)
        sd = dflash_llm(target, drafter, 15, None, args.accept,
                        {**kw, "tensor_parallel_size": size})  # fmt: skip
        row["dflash_step_ms"] = mean_step_ms(sd, prompt, 1, args.steps)
        row["dflash_tok_s"] = {
            c: decode_tok_s(sd, prompt, c, args.new_tokens, conc_reps(c)) for c in args.concurrency
        }
        row["mean_acceptance_length"] = sd.engine.spec_stats.mean_acceptance_length
        free(sd)
        rows.append(row)
        print(json.dumps(row), flush=True)

    print(
        f"\n{hardware()} x {max(args.tp)}, {time.strftime('%Y-%m-%d')}; {shape.name} shapes, "
        f"random bf16 weights, prompt {args.prompt_len}; copy bandwidth "
        f"{bandwidth / 1e12:.2f} TB/s per GPU"
    )
    print_table(
        "a./b. batch-1 decode (steady: one over the decode step) and the step's all-reduces",
        ["TP", "roofline tok/s", "AR steady tok/s", "% roofline", "decode ms",
         "all-reduce ms (1 row)", "verify16+draft ms", "all-reduce ms (16 rows)"],
        [[r["tp"], r["roofline_tok_s"], 1e3 / r["ar_step_ms"],
          100e3 / r["ar_step_ms"] / r["roofline_tok_s"], r["ar_step_ms"],
          r.get("all_reduce_ms", {}).get(1, 0.0), r["dflash_step_ms"],
          r.get("all_reduce_ms", {}).get(16, 0.0)] for r in rows],
    )  # fmt: skip
    base = rows[0]
    print_table(
        f"c. tok/s (DFlash: synthetic acceptance p = {args.accept}, N = 15); × = over TP "
        f"{base['tp']}",
        ["TP", "concurrency", "AR", "DFlash", "DFlash / AR", "AR ×", "DFlash ×"],
        [[r["tp"], c, r["ar_tok_s"][c], r["dflash_tok_s"][c],
          r["dflash_tok_s"][c] / r["ar_tok_s"][c], r["ar_tok_s"][c] / base["ar_tok_s"][c],
          r["dflash_tok_s"][c] / base["dflash_tok_s"][c]]
         for r in rows for c in args.concurrency],
    )  # fmt: skip
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        report = {
            "hardware": hardware(),
            "date": time.strftime("%Y-%m-%d"),
            "shape": shape.name,
            "copy_bandwidth_TBps": bandwidth / 1e12,
            "rows": rows,
        }
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
