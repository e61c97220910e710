"""DFlash2's sub-block opening on the GPU: the kernel projection then the convolution (the
skinny GEMM up to 16 rows, cuBLAS past it, and the conv kernel: two or three launches) against
`triton_projected_dynamic_conv` (one launch), over the fused kernel's launch options.

Qwen3-8B drafter width (hidden 4096) with z-lab's published conv fields (kernel 2, groups of
16: a 4096 -> 1024 projection, 8 MiB in bf16), a block of 16 rows a request. A timing is one
CUDA graph of 20 calls cycling over 32 copies of the weights (256 MiB, five times the L2), so
every call reads its weight from HBM; the fastest of 3 replays counts. Each fused config's
outputs are checked against the separate ops' (max |diff| / max |ref|); a config that fails to
compile or to match is skipped.

    python benchmarks/conv_projection_bench.py [--rows 16 128 512] [--json F]

Prints, per row count, the separate ops, the fused kernel's default launch and its best
options. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import DFLASH2_FIELDS, hardware, print_table, time_graph  # noqa: E402

HIDDEN, BLOCK_LEN, COPIES = 4096, 16, 32
MAX_REL_ERR = 1e-2  # bf16 rounding of the dynamic kernels and of the output


def candidates(rows: int) -> list[dict]:
    """Launch options of `triton_projected_dynamic_conv` worth timing at `rows` rows."""
    block_ms = [m for m in (16, 32, 64) if m == 16 or m <= rows]
    return [
        {"groups_per_program": g, "block_m": m, "block_k": k, "num_stages": s}
        for g in (1, 2, 4, 8)
        for m in block_ms
        for k in (128, 256)
        for s in (3, 4)
    ]


def opening_modules(device: torch.device, dtype: torch.dtype) -> list[torch.nn.Module]:
    from blockdraft.layers.dynamic_conv import GroupedDynamicCausalConv

    size, group = DFLASH2_FIELDS["conv_kernel_size"], DFLASH2_FIELDS["conv_group_size"]
    convs = []
    for _ in range(COPIES):
        conv = GroupedDynamicCausalConv(HIDDEN, size, group).to(device, dtype)
        torch.nn.init.normal_(conv.kernel_projection.weight, std=HIDDEN**-0.5)
        torch.nn.init.normal_(conv.base_kernel, std=0.5)
        convs.append(conv.requires_grad_(False))
    return convs


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[16, 128, 512])
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("conv_projection_bench.py times CUDA kernels and needs a CUDA GPU; none is seen.")

    from blockdraft.kernels.forward_context import use_kernel_policy
    from blockdraft.kernels.policy import KernelPolicy
    from blockdraft.kernels.triton_dynamic_conv import triton_projected_dynamic_conv

    torch.manual_seed(0)
    device, dtype = torch.device("cuda"), torch.bfloat16
    convs = opening_modules(device, dtype)
    results, table = [], []
    for rows in args.rows:
        if rows % BLOCK_LEN:
            sys.exit(f"--rows {rows}: need whole blocks of {BLOCK_LEN} rows")
        x = torch.randn(rows, HIDDEN, device=device, dtype=dtype)
        with use_kernel_policy(KernelPolicy()):
            ref = convs[0].prepare(x, BLOCK_LEN)[0].float()
            separate = time_graph([lambda c=c, x=x: c.prepare(x, BLOCK_LEN) for c in convs], 20, 3)
        scale = ref.abs().max().item()

        def fused(cfg: dict, x: torch.Tensor = x) -> list:
            return [
                lambda c=c: triton_projected_dynamic_conv(
                    x, c.kernel_projection.weight, c.base_kernel[0], BLOCK_LEN, **cfg
                )
                for c in convs
            ]

        timed = []
        for cfg in [{}, *candidates(rows)]:
            try:
                got = fused(cfg)[0]()[0].float()
                err = (got - ref).abs().max().item() / scale
                if not err <= MAX_REL_ERR:  # NaN fails too
                    raise RuntimeError(f"max rel err {err:.3g}")
                timed.append((time_graph(fused(cfg), 20, 3), cfg, err))
            except Exception as exc:  # a config that does not compile, fit or match
                print(f"  skip rows={rows} {cfg}: {type(exc).__name__}: {str(exc)[:160]}")
        default = timed[0] if timed and timed[0][1] == {} else None
        best = min(timed, key=lambda t: t[0]) if timed else None
        results.append(
            {"rows": rows, "separate_ms": separate,
             "default_ms": default[0] if default else None,
             "best_ms": best[0] if best else None, "best": best[1] if best else None,
             "best_rel_err": best[2] if best else None}
        )  # fmt: skip
        table.append(
            [rows, separate * 1e3, default[0] * 1e3 if default else float("nan"),
             best[0] * 1e3 if best else float("nan"), separate / best[0] if best else float("nan"),
             json.dumps(best[1]) if best else "-"]
        )  # fmt: skip
    print_table(
        f"DFlash2 opening (projection {HIDDEN} -> {2 * DFLASH2_FIELDS['conv_kernel_size']} x "
        f"{HIDDEN // DFLASH2_FIELDS['conv_group_size']} + conv), bf16, {hardware()}, us a call",
        ["rows", "separate", "fused default", "fused best", "speedup", "best options"],
        table,
    )
    if args.json:
        args.json.write_text(json.dumps({"device": hardware(), "results": results}, indent=1))
    return results


if __name__ == "__main__":
    main()
