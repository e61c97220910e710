"""Skinny-GEMM sweep on Qwen3-8B shapes: cuBLAS `F.linear` against the Triton kernel of
`blockdraft.kernels.triton_linear`, bf16, M = 1, 2, 4, 8, 16 rows. CUDA only.

    python benchmarks/gemv_bench.py [--json gemv.json] [--iters 20] [--reps 3]

For each projection (fused qkv 4096->6144, o 4096->4096, fused gate_up 4096->24576, down
12288->4096, lm_head 4096->151936) and M, times cuBLAS and a few dozen kernel configs. A timing
is one CUDA graph of `iters` calls cycling over copies of the weight (at least 256 MB of them,
five times the H200's 50 MB L2, so every call reads its weight from HBM), replayed `reps` times
between CUDA events; the fastest replay counts. CUDA graphs, as the engine's decode runs:
Triton's Python launch would otherwise dominate a 10 us kernel. Achieved TB/s = weight bytes /
time per call (the gaps between graph nodes included). Each config's output is checked against
an fp32 F.linear (max |err| / max |ref|); a config that fails to compile or to match is skipped.

Prints the best config per (shape, M) as a dict literal to paste over `DEFAULT_CONFIGS`, then
a table per shape and the sum over a whole forward (36 layers' four GEMMs + lm_head) per M,
cuBLAS vs the best Triton config of each shape. About 50 kernel variants compile on a cold
Triton cache (~1 min); the whole run should stay under 3 minutes on an H200.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import hardware, print_table, time_graph  # noqa: E402

DEVICE = "cuda"
NUM_LAYERS = 36
# name -> (N, K, GEMMs per forward)
SHAPES = {
    "qkv": (6144, 4096, NUM_LAYERS),
    "o": (4096, 4096, NUM_LAYERS),
    "gate_up": (24576, 4096, NUM_LAYERS),
    "down": (4096, 12288, NUM_LAYERS),
    "lm_head": (151936, 4096, 1),
}
# Not in the default sweep: shapes with few output rows, where split-K decides the speed
# (triton_linear.pick_config splits them when untabulated): a DFlash2 drafter's extra
# projections at Qwen3-8B width (z-lab's conv kernel 2, groups of 16: 2 x 2 x 256 outputs, two
# a layer over 5 layers; the selector's rank-256 hidden projection), and the 30B-A3B / 35B-A3B
# MoE targets' o_proj (4096 -> 2048) and shared expert down projection (512 -> 2048).
EXTRA_SHAPES = {
    "dflash2_kernel": (1024, 4096, 10),
    "dflash2_selector": (256, 4096, 1),
    "a3b_o": (2048, 4096, 48),
    "a3b_shared_down": (2048, 512, 40),
    # Qwen3.5-27B (hidden 5120): the gated attention's fused q (with its gate) + k + v and its
    # o_proj (16 layers), the Gated DeltaNet's fused qkv + z + b + a and its out_proj (48), the
    # MLP (64), the head.
    "q35_27b_qkv": (14336, 5120, 16),
    "q35_27b_o": (5120, 6144, 16),
    "q35_27b_gdn_in": (16480, 5120, 48),
    "q35_27b_gdn_out": (5120, 6144, 48),
    "q35_27b_gate_up": (34816, 5120, 64),
    "q35_27b_down": (5120, 17408, 64),
    "q35_27b_lm_head": (248320, 5120, 1),
    # Qwen3.5-35B-A3B (hidden 2048): the gated attention's fused q + gate + k + v (10 layers),
    # the Gated DeltaNet's fused qkv + z + b + a (30; both o_proj and out_proj are `a3b_o`),
    # the router with the shared expert's gate row (40), the shared expert's gate_up where it
    # runs apart (past two tokens), the head.
    "q35_a3b_qkv": (9216, 2048, 10),
    "q35_a3b_gdn_in": (12352, 2048, 30),
    "q35_a3b_router": (257, 2048, 40),
    "q35_a3b_shared_gate_up": (1024, 2048, 40),
    "q35_a3b_lm_head": (248320, 2048, 1),
}
# The projections decode runs with a prologue at <= 2 rows (`--prologue`).
SILU_MUL_INPUT = ("down", "q35_27b_down")
NORM_INPUT = ("qkv", "gate_up")  # Qwen3.5's offset norms run unfused
ROTATE_BYTES = 256 * 1024**2  # weight copies cycled per timing: well past the 50 MB L2
MAX_REL_ERR = 1e-2  # bf16 output rounding is ~4e-3 of the largest value

# (block_n, block_k at M = 1, num_warps, num_stages): the broadcast path keeps a
# [block_n, M, block_k] fp32 accumulator, so block_k shrinks as M grows (same registers).
BROADCAST = [
    (8, 512, 4, 1),
    (8, 1024, 4, 1),
    (16, 512, 4, 1),
    (32, 256, 4, 1),
    (8, 1024, 4, 3),
    (16, 512, 4, 3),
    (16, 1024, 8, 1),
    (32, 512, 8, 1),
]
# (block_n, block_k, num_warps, num_stages) on tensor cores, M padded to 16 rows.
DOT = [
    (16, 256, 4, 3),
    (16, 256, 4, 4),
    (16, 512, 4, 3),
    (32, 256, 4, 3),
    (32, 256, 4, 4),
    (64, 128, 4, 4),
    (64, 256, 4, 3),
    (64, 256, 8, 3),
    (16, 128, 4, 4),
    (32, 128, 4, 4),
    (64, 128, 4, 3),
    (128, 64, 4, 4),
    (128, 128, 8, 3),
]
# (block_n, block_k, num_warps, num_stages, split_k), tried where N / block_n is few programs.
SPLIT = [
    (16, 512, 4, 3, 2),
    (32, 256, 4, 3, 2),
    (32, 256, 4, 4, 2),
    (64, 256, 4, 3, 4),
    (16, 256, 4, 3, 4),
    (16, 256, 4, 3, 8),
    (32, 256, 4, 3, 8),
    (16, 128, 4, 4, 16),
]


def candidates(m: int, n: int, k: int, sms: int) -> list:
    from blockdraft.kernels.triton_linear import SkinnyConfig, m_bucket, pick_config

    configs = [pick_config(m, n, k)]  # the current default first
    if configs[0].split_k > 1:
        configs.append(configs[0]._replace(split_k=1))  # and unsplit
    if m <= 4:
        bucket = m_bucket(m)
        for bn, bk, warps, stages in BROADCAST:
            configs.append(SkinnyConfig(bn, max(16, bk // bucket), warps, stages, 1, False))
    for bn, bk, warps, stages in DOT:
        configs.append(SkinnyConfig(bn, bk, warps, stages, 1, True))
    for bn, bk, warps, stages, split in SPLIT:
        if -(-n // bn) < 4 * sms and k % (bk * split) == 0:
            configs.append(SkinnyConfig(bn, bk, warps, stages, split, True))
    return list(dict.fromkeys(configs))  # dedupe, order kept


def gemm_input(name: str, m: int, k: int, prologue: bool) -> tuple[torch.Tensor, dict]:
    """x for a GEMM of depth k, and the fused-input keywords of `skinny_linear` that decode
    uses for this projection (none without `prologue`)."""
    if prologue and name in SILU_MUL_INPUT:
        return torch.randn(m, 2 * k, device=DEVICE).bfloat16(), {"silu_mul_input": True}
    x = torch.randn(m, k, device=DEVICE).bfloat16()
    if not (prologue and name in NORM_INPUT):
        return x, {}
    norm_weight = (1 + 0.1 * torch.randn(k, device=DEVICE)).bfloat16()
    return x, {
        "rms_norm": (norm_weight, 1e-6),
        "residual": torch.randn_like(x),
        "residual_out": torch.empty_like(x),
    }


def as_fp32(fused: dict) -> dict:
    """The same keywords with fp32 tensors (the reference's), residual_out left out."""
    if "rms_norm" not in fused:
        return fused
    weight, eps = fused["rms_norm"]
    return {"rms_norm": (weight.float(), eps), "residual": fused["residual"].float()}


def time_per_call(calls: list, iters: int, reps: int) -> float:
    """Seconds per call: a CUDA graph of `iters` calls cycling through `calls`, best of `reps`
    replays."""
    return time_graph(calls, iters, reps) / 1e3


def copy_bandwidth() -> float:
    """Device-to-device copy bytes (read + written) per second, the practical roofline."""
    x = torch.empty(1024**3, dtype=torch.uint8, device=DEVICE)
    y = torch.empty_like(x)
    return 2 * 1024**3 / time_per_call([lambda: y.copy_(x)], iters=10, reps=3)


def short(cfg) -> str:  # "bc 16x512 w4 st1", "dot 32x256 w4 st3/s2"
    kind = "dot" if cfg.use_dot else "bc"
    split = f"/s{cfg.split_k}" if cfg.split_k > 1 else ""
    return f"{kind} {cfg.block_n}x{cfg.block_k} w{cfg.num_warps} st{cfg.num_stages}{split}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--iters", type=int, default=20, help="calls per timed graph")
    parser.add_argument("--reps", type=int, default=3, help="timed replays per config")
    parser.add_argument("--m", default="1,2,4,8,16", help="row counts, comma-separated")
    parser.add_argument(
        "--shapes",
        default=",".join(SHAPES),
        help="comma-separated, of " + ",".join([*SHAPES, *EXTRA_SHAPES]),
    )
    parser.add_argument(
        "--prologue",
        action="store_true",
        help="time the fused inputs decode runs at <= 2 rows: residual add + RMSNorm before "
        "qkv and gate_up, silu(gate) * up before down (cuBLAS gets the unfused ops)",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gemv_bench.py times CUDA kernels and needs a CUDA GPU; none is visible.")

    from blockdraft.kernels.triton_linear import SkinnyConfig, skinny_linear, skinny_linear_torch

    t_start = time.perf_counter()
    torch.manual_seed(0)
    ms = [int(v) for v in args.m.split(",")]
    known = {**SHAPES, **EXTRA_SHAPES}
    unknown = sorted(set(args.shapes.split(",")) - set(known))
    if unknown:
        sys.exit(f"unknown --shapes {', '.join(unknown)}: choose from {', '.join(known)}")
    shapes = {name: known[name] for name in args.shapes.split(",")}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    copy_bw = copy_bandwidth()
    print(f"{hardware()}, {sms} SMs; copy bandwidth {copy_bw / 1e12:.2f} TB/s (read + write)")

    results = []
    for name, (n, k, _) in shapes.items():
        weight_bytes = n * k * 2
        copies = max(2, math.ceil(ROTATE_BYTES / weight_bytes))
        weights = [torch.randn(n, k, device=DEVICE).div_(math.sqrt(k)).bfloat16()]
        weights += [weights[0].clone() for _ in range(copies - 1)]
        for m in ms:
            x, fused = gemm_input(name, m, k, args.prologue)
            ref = skinny_linear_torch(x.float(), weights[0].float(), **as_fp32(fused))
            scale = ref.abs().max().item()
            plain = skinny_linear_torch(x, weights[0], **fused)
            cublas_err = (plain.float() - ref).abs().max().item() / scale
            cublas = time_per_call(
                [lambda w=w, x=x, f=fused: skinny_linear_torch(x, w, **f) for w in weights],
                args.iters,
                args.reps,
            )
            entry = {
                "shape": name,
                "n": n,
                "k": k,
                "m": m,
                "weight_bytes": weight_bytes,
                "weight_copies": copies,
                "cublas_us": cublas * 1e6,
                "cublas_tbs": weight_bytes / cublas / 1e12,
                "cublas_max_rel_err": cublas_err,
                "configs": [],
            }
            for cfg in candidates(m, n, k, sms):
                row = {"config": cfg._asdict(), "repr": repr(cfg)}
                try:
                    got = skinny_linear(x, weights[0], None, cfg, **fused)
                    torch.cuda.synchronize()
                    row["max_rel_err"] = (got.float() - ref).abs().max().item() / scale
                    if not row["max_rel_err"] <= MAX_REL_ERR:  # NaN fails too
                        raise RuntimeError(f"max rel err {row['max_rel_err']:.3g}")
                    t = time_per_call(
                        [
                            lambda w=w, x=x, c=cfg, f=fused: skinny_linear(x, w, None, c, **f)
                            for w in weights
                        ],
                        args.iters,
                        args.reps,
                    )
                    row["us"], row["tbs"] = t * 1e6, weight_bytes / t / 1e12
                except Exception as exc:  # a config that does not compile, fit or match
                    row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                    print(f"  skip {name} M={m} {short(cfg)}: {row['error']}")
                entry["configs"].append(row)
            timed = [r for r in entry["configs"] if "us" in r]
            entry["best"] = min(timed, key=lambda r: r["us"]) if timed else None
            entry["default"] = entry["configs"][0]
            unsplit = entry["configs"][1] if entry["default"]["config"]["split_k"] > 1 else None
            if unsplit is not None and "tbs" in unsplit:
                print(f"  {name} M={m} default unsplit: {unsplit['tbs']:.2f} TB/s")
            results.append(entry)
            best = entry["best"]
            default = entry["default"]
            print(
                f"{name:>8} M={m:<2} cuBLAS {entry['cublas_tbs']:.2f} TB/s, default "
                + (
                    f"{default['tbs']:.2f} TB/s {short(SkinnyConfig(**default['config']))}, "
                    if "tbs" in default
                    else "failed, "
                )
                + "best Triton "
                + (f"{best['tbs']:.2f} TB/s {best['repr']}" if best else "none")
                + f"  [{time.perf_counter() - t_start:.0f}s]"
            )
        del weights
        torch.cuda.empty_cache()

    # Per-M whole-forward sums over the shapes measured (all of them: a full forward).
    layer_sum = []
    for m in ms:
        rows = [r for r in results if r["m"] == m]
        count = {r["shape"]: shapes[r["shape"]][2] for r in rows}
        cub = sum(count[r["shape"]] * r["cublas_us"] for r in rows)
        tri = sum(count[r["shape"]] * (r["best"] or {"us": r["cublas_us"]})["us"] for r in rows)
        both = sum(
            count[r["shape"]] * min(r["cublas_us"], (r["best"] or {"us": math.inf})["us"])
            for r in rows
        )
        total_bytes = sum(count[r["shape"]] * r["weight_bytes"] for r in rows)
        layer_sum.append(
            {
                "m": m,
                "cublas_ms": cub / 1e3,
                "triton_ms": tri / 1e3,
                "best_of_both_ms": both / 1e3,
                "cublas_tbs": total_bytes / cub / 1e6,
                "triton_tbs": total_bytes / tri / 1e6,
            }
        )

    best_configs = {
        f"({min(r['m'], 16)}, {r['n']}, {r['k']})": r["best"]["repr"] for r in results if r["best"]
    }
    print("\nBest configs, to paste over DEFAULT_CONFIGS in blockdraft/kernels/triton_linear.py:")
    print("{")
    for name, (n, k, _) in shapes.items():
        print(f"    # {name}")
        for r in results:
            if r["shape"] == name and r["best"]:
                print(f"    ({r['m']}, {n}, {k}): {r['best']['repr']},")
    print("}")

    if args.json:
        report = {
            "device": hardware(),
            "sms": sms,
            "copy_bandwidth_tbs": copy_bw / 1e12,
            "iters": args.iters,
            "reps": args.reps,
            "prologue": args.prologue,
            "results": results,
            "layer_sum": layer_sum,
            "best_configs": best_configs,
            "seconds": time.perf_counter() - t_start,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
        print(f"\nwrote {args.json}")

    print_table(
        f"Per GEMM, bf16 (copy bandwidth {copy_bw / 1e12:.2f} TB/s)",
        ["shape", "M", "cuBLAS us", "TB/s", "Triton us", "TB/s", "default TB/s", "speedup", "best"],
        [
            [
                r["shape"],
                r["m"],
                r["cublas_us"],
                r["cublas_tbs"],
                r["best"]["us"] if r["best"] else "-",
                r["best"]["tbs"] if r["best"] else "-",
                r["default"].get("tbs", "-"),
                r["cublas_us"] / r["best"]["us"] if r["best"] else "-",
                short(config_of(r["best"])) if r["best"] else "-",
            ]
            for r in results
        ],
    )
    print_table(
        f"Whole forward ({NUM_LAYERS} layers x 4 GEMMs + lm_head), per-shape best Triton config",
        ["M", "cuBLAS ms", "TB/s", "Triton ms", "TB/s", "best-of-both ms", "speedup"],
        [
            [
                s["m"],
                s["cublas_ms"],
                s["cublas_tbs"],
                s["triton_ms"],
                s["triton_tbs"],
                s["best_of_both_ms"],
                s["cublas_ms"] / s["triton_ms"],
            ]
            for s in layer_sum
        ],
    )
    print(f"\n{time.perf_counter() - t_start:.0f} s")


def config_of(row: dict):
    from blockdraft.kernels.triton_linear import SkinnyConfig

    return SkinnyConfig(**row["config"])


if __name__ == "__main__":
    main()
