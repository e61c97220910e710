"""Skinny GEMM for few-row linears: `y = x @ W.T (+ bias)` with M <= 16 rows.

`skinny_linear_torch` (in `blockdraft.kernels.linear`) is the specification: `F.linear`. Batch
decode (M = batch) and verify (M = batch * (1 + N)) steps multiply a handful of rows by every
weight matrix of the model, so their GEMMs are reads of W and nothing else: the time is
weight bytes / bandwidth, and the kernel's only job is to stream W at as close to the HBM peak
as possible.

A program owns BLOCK_N rows of W (nn.Linear's [N, K], row-major) and walks K in BLOCK_K chunks:
each chunk is BLOCK_N contiguous runs of BLOCK_K elements, read in wide coalesced loads that
bypass reuse (W is read once), against the matching [BLOCK_M, BLOCK_K] chunk of x (a few KB,
served from L1/L2). Rows of W past N and of x past M are clamped to the last valid row instead
of masked, so that the loads stay unpredicated; the store drops them. Two inner products:

- USE_DOT: `tl.dot(w, x.T)` on tensor cores, the M rows padded to a 16-row tile (mma needs
  16; the padding costs nothing here, the tile is loaded from L1). W is the left operand
  ("swap AB"), so BLOCK_N, not M, is the tile's long side.
- otherwise: a broadcast multiply of the W chunk by each row of x into one [BLOCK_N, BLOCK_K]
  fp32 accumulator per row (up to 4 rows a program), reduced over K once after the loop (no
  cross-lane shuffles inside it): for M of 1 or 2, where a 16-row mma would waste most of its
  work and the accumulators still fit in registers.

SILU_MUL fuses the gated MLP's activation into the down projection as a prologue: x is the
fused gate_up output [M, 2K] and each x chunk is formed as silu(gate) * up from its two halves,
rounded as `triton_silu_mul` rounds, so the GEMM sees the very operand the unfused pair would
write to memory (one launch and one round trip of the activations less).

RMS_NORM fuses the pre-norm block's residual add + RMSNorm into the GEMM as a prologue: x is
the un-normed input (with an optional residual), and a pre-pass over each row's whole K forms
s = x + residual and rstd exactly as `triton_rms_norm` does (same full-row fp32 sum), then each
x chunk is formed as round(round(s * rstd) * norm_weight), the norm kernel's output (with
norm_offset round(s * rstd * (1 + norm_weight)), its offset form's); program 0 along N (split 0)
writes s to the residual-out buffer.

SPLIT_K > 1 cuts K into SPLIT_K ranges whose fp32 partial sums go to a [SPLIT_K, M, N]
workspace, summed in a fixed order (with the bias) by a second kernel: deterministic, unlike
atomics. It pays only when N / BLOCK_N leaves SMs idle.

Launch parameters come from `DEFAULT_CONFIGS` (by M bucket and the exact (N, K), else the
nearest tabulated shape): `benchmarks/gemv_bench.py` measures the candidates on a GPU and
prints a table to paste there. Only tensor shapes steer the launch: no host sync, so calls can
be captured in CUDA graphs.

This file is the host side (the config table, its lookup and the launcher); the kernels are in
`triton_linear_kernels`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton

from blockdraft.kernels.linear import skinny_linear_torch
from blockdraft.kernels.pdl import launch_options, pdl_enabled
from blockdraft.kernels.triton_linear_kernels import _skinny_matmul_kernel, _split_k_reduce_kernel

__all__ = ["DEFAULT_CONFIGS", "SkinnyConfig", "skinny_linear", "skinny_linear_torch"]


class SkinnyConfig(NamedTuple):
    """Launch parameters of `_skinny_matmul_kernel`."""

    block_n: int = 16
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 1
    split_k: int = 1
    use_dot: bool = False

    def __repr__(self) -> str:  # positional: short table lines, still pasteable
        return f"SkinnyConfig{tuple(self)!r}"


# (M bucket = next power of two of M, N, K) ->
#     SkinnyConfig(block_n, block_k, num_warps, num_stages, split_k, use_dot)
# for the Qwen3-8B projections, the fastest of benchmarks/gemv_bench.py's sweep on an H200
# (with PDL and decode's prologues at M = 1-2, `--prologue`); other shapes take the entry of
# their M bucket nearest in log N + log K.
# Against cuBLAS (bf16, weights streamed from HBM): at M = 1-2 the broadcast path wins on every
# shape (whole forward 3.79 vs 4.11 ms at M = 1); at M = 4-16 the two are close GEMM by GEMM,
# and whole steps are faster with this kernel up to 16 rows (KernelPolicy.skinny_max_rows).
DEFAULT_CONFIGS: dict[tuple[int, int, int], SkinnyConfig] = {
    # fused qkv
    (1, 6144, 4096): SkinnyConfig(16, 512, 4, 1, 1, False),
    (2, 6144, 4096): SkinnyConfig(16, 256, 4, 3, 1, False),
    (4, 6144, 4096): SkinnyConfig(64, 256, 4, 3, 1, True),
    (8, 6144, 4096): SkinnyConfig(64, 256, 4, 3, 1, True),
    (16, 6144, 4096): SkinnyConfig(64, 256, 4, 3, 1, True),
    # o_proj
    (1, 4096, 4096): SkinnyConfig(16, 512, 4, 3, 1, False),
    (2, 4096, 4096): SkinnyConfig(16, 256, 4, 3, 1, False),
    (4, 4096, 4096): SkinnyConfig(8, 256, 4, 3, 1, False),
    (8, 4096, 4096): SkinnyConfig(64, 256, 4, 3, 1, True),
    (16, 4096, 4096): SkinnyConfig(32, 256, 4, 4, 1, True),
    # fused gate_up
    (1, 24576, 4096): SkinnyConfig(32, 256, 4, 1, 1, False),
    (2, 24576, 4096): SkinnyConfig(16, 256, 4, 3, 1, False),
    (4, 24576, 4096): SkinnyConfig(64, 256, 4, 3, 1, True),
    (8, 24576, 4096): SkinnyConfig(64, 256, 4, 3, 1, True),
    (16, 24576, 4096): SkinnyConfig(64, 128, 4, 3, 1, True),
    # down_proj
    (1, 4096, 12288): SkinnyConfig(16, 512, 4, 3, 1, False),
    (2, 4096, 12288): SkinnyConfig(8, 512, 4, 3, 1, False),
    (4, 4096, 12288): SkinnyConfig(64, 256, 4, 3, 4, True),
    (8, 4096, 12288): SkinnyConfig(64, 256, 4, 3, 4, True),
    (16, 4096, 12288): SkinnyConfig(32, 256, 4, 4, 1, True),
    # lm_head
    (1, 151936, 4096): SkinnyConfig(16, 512, 4, 3, 1, False),
    (2, 151936, 4096): SkinnyConfig(16, 256, 4, 3, 1, False),
    (4, 151936, 4096): SkinnyConfig(64, 128, 4, 4, 1, True),
    (8, 151936, 4096): SkinnyConfig(64, 128, 4, 4, 1, True),
    (16, 151936, 4096): SkinnyConfig(64, 128, 4, 3, 1, True),
    # Qwen3.5-27B (hidden 5120), measured on an H100 (2026-12-07): at one row the nearest 8B
    # configs ran its fused gate_up at 2.89 TB/s against 3.13 for this table's, the others
    # within 3%; a decode step 18.99 -> 18.38 ms. Gated attention's fused q + gate + k + v
    (1, 14336, 5120): SkinnyConfig(8, 512, 4, 1, 1, False),
    (16, 14336, 5120): SkinnyConfig(64, 128, 4, 3, 1, True),
    # its o_proj, and the Gated DeltaNet's out_proj
    (1, 5120, 6144): SkinnyConfig(8, 512, 4, 1, 1, False),
    (16, 5120, 6144): SkinnyConfig(64, 128, 4, 4, 1, True),
    # the Gated DeltaNet's fused qkv + z + b + a
    (1, 16480, 5120): SkinnyConfig(16, 512, 4, 3, 1, False),
    (16, 16480, 5120): SkinnyConfig(64, 128, 4, 3, 1, True),
    # fused gate_up
    (1, 34816, 5120): SkinnyConfig(8, 1024, 4, 3, 1, False),
    (16, 34816, 5120): SkinnyConfig(64, 128, 4, 3, 1, True),
    # down_proj
    (1, 5120, 17408): SkinnyConfig(8, 512, 4, 1, 1, False),
    (16, 5120, 17408): SkinnyConfig(32, 256, 4, 4, 1, True),
    # lm_head
    (1, 248320, 5120): SkinnyConfig(8, 512, 4, 1, 1, False),
    (16, 248320, 5120): SkinnyConfig(128, 128, 8, 3, 1, True),
    # Qwen3.5-35B-A3B (hidden 2048), H100 (2026-12-07), where its own config beat the nearest
    # by 2-16% (the others within 1%: its GDN in_proj, shared expert, head): gated attention's
    # fused q + gate + k + v
    (1, 9216, 2048): SkinnyConfig(8, 512, 4, 1, 1, False),
    (2, 9216, 2048): SkinnyConfig(8, 512, 4, 3, 1, False),
    # o_proj (also Qwen3-30B-A3B's)
    (1, 2048, 4096): SkinnyConfig(8, 1024, 4, 3, 1, False),
    (2, 2048, 4096): SkinnyConfig(8, 512, 4, 3, 1, False),
    # the router with the shared expert's gate row
    (1, 257, 2048): SkinnyConfig(8, 1024, 4, 3, 1, False),
    (2, 257, 2048): SkinnyConfig(8, 512, 4, 3, 1, False),
}


def m_bucket(m: int) -> int:
    return min(triton.next_power_of_2(max(m, 1)), 16)


# An untabulated weight of at least SPLIT_MIN_ELEMENTS whose rows give its nearest config fewer
# than half of FILL_PROGRAMS programs (~ one per SM of an H200; half that for the one- and
# two-row broadcast path, whose programs are wider) is split along K until they fill the GPU,
# each split at least SPLIT_MIN_DEPTH deep. H200, 16 rows (gemv_bench): a DFlash2 drafter's
# kernel projection 4096 -> 1024 0.86 -> 1.20 TB/s (split 4), its selector projection 4096 ->
# 256 0.22 -> 0.46 (16), an A3B MoE's o_proj 4096 -> 2048 1.67 -> 1.91 (2); a 512-deep shared
# expert down projection lost (0.68 -> 0.50 at split 2), one row of 4096 -> 1024 too (1.40 ->
# 1.35). Smaller weights are latency-bound and would only pay the reduce launch.
FILL_PROGRAMS = 128
SPLIT_MIN_ELEMENTS = 1 << 20
SPLIT_MIN_DEPTH = 512
MAX_SPLIT_K = 16


def pick_config(m: int, n: int, k: int) -> SkinnyConfig:
    """The tabulated config for (M bucket, N, K), else that of the nearest tabulated shape of
    the same M bucket, with BLOCK_K and SPLIT_K cut down to what a short K can use, and SPLIT_K
    raised where few rows of a large weight would leave SMs idle."""
    bucket = m_bucket(m)
    cfg = DEFAULT_CONFIGS.get((bucket, n, k))
    if cfg is not None:
        return cfg
    same = [key for key in DEFAULT_CONFIGS if key[0] == bucket] or list(DEFAULT_CONFIGS)
    if not same:
        return SkinnyConfig(use_dot=bucket >= 4)

    def distance(key: tuple[int, int, int]) -> float:
        return abs(math.log2(key[1] / n)) + abs(math.log2(key[2] / k)) + abs(key[0] - bucket)

    cfg = DEFAULT_CONFIGS[min(same, key=distance)]
    block_k = min(cfg.block_k, max(16, triton.next_power_of_2(k)))
    split_k = max(1, min(cfg.split_k, triton.cdiv(k, block_k)))
    programs = triton.cdiv(n, cfg.block_n)
    fill = FILL_PROGRAMS if cfg.use_dot else FILL_PROGRAMS // 2
    if n * k >= SPLIT_MIN_ELEMENTS:
        while (
            split_k < MAX_SPLIT_K
            and programs * split_k * 2 <= fill
            and k >= max(block_k, SPLIT_MIN_DEPTH) * split_k * 2
        ):
            split_k *= 2
    return cfg._replace(block_k=block_k, split_k=split_k)


def _check_norm_args(
    x: torch.Tensor,
    silu_mul_input: bool,
    rms_norm: tuple[torch.Tensor, float] | None,
    residual: torch.Tensor | None,
    residual_out: torch.Tensor | None,
) -> None:
    if rms_norm is None:
        if residual is not None or residual_out is not None:
            raise ValueError("residual and residual_out go with rms_norm")
        return
    if silu_mul_input:
        raise ValueError("rms_norm and silu_mul_input do not combine")
    norm_weight = rms_norm[0]
    if norm_weight.shape != x.shape[-1:] or norm_weight.dtype != x.dtype:
        raise ValueError(
            f"norm weight {tuple(norm_weight.shape)} {norm_weight.dtype} does not "
            f"match x's last dim {x.shape[-1]} and dtype {x.dtype}"
        )
    if (residual is None) != (residual_out is None):
        raise ValueError("a residual needs a residual_out (and residual_out a residual)")
    if residual is None:
        return
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError("residual must match x's shape and dtype")
    if residual_out.shape != x.shape or residual_out.dtype != x.dtype:
        raise ValueError("residual_out must match x's shape and dtype")
    if residual_out.stride(-1) != 1:
        raise ValueError("residual_out needs unit column stride")
    if residual_out.data_ptr() in (x.data_ptr(), residual.data_ptr()):
        raise ValueError("residual_out must not alias x or residual")


def skinny_linear(
    x: torch.Tensor,  # [..., K] ([..., 2K] with silu_mul_input), unit column stride
    weight: torch.Tensor,  # [N, K], unit column stride (rows may be strided)
    bias: torch.Tensor | None = None,  # [N]
    config: SkinnyConfig | None = None,
    *,
    out: torch.Tensor | None = None,  # [..., N] preallocated output, unit column stride
    silu_mul_input: bool = False,  # x is a fused gate_up output: multiply silu(gate) * up
    rms_norm: tuple[torch.Tensor, float] | None = None,  # (norm weight [K], eps)
    residual: torch.Tensor | None = None,  # [..., K]; with rms_norm
    residual_out: torch.Tensor | None = None,  # [..., K] unit column stride; with residual
    norm_offset: bool = False,  # with rms_norm: scale by 1 + norm weight (OffsetRMSNorm)
) -> torch.Tensor:  # [..., N], x's dtype
    """`F.linear(x, weight, bias)` for few rows of x; fp32 accumulation. Any row count works
    (the grid tiles M by 16) but past 16 rows cuBLAS's GEMMs are the better choice. A weight
    without unit column stride is left to F.linear rather than copied. With silu_mul_input,
    `F.linear(silu_mul_torch(*x.chunk(2, -1)), weight, bias)`, the activation formed in the
    kernel's loads (K, the GEMM's depth and the config's key, is half of x's width).

    With rms_norm = (norm_weight, eps), the GEMM's input is `rms_norm_torch(x, norm_weight,
    eps, residual, offset=norm_offset)`, formed in the kernel's loads exactly as
    `triton_rms_norm` forms it; with a residual the new stream x + residual is written to
    residual_out (required, and not aliasing x or residual: other programs still read them
    while it is written)."""
    width = x.shape[-1]
    k = width // 2 if silu_mul_input else width
    n = weight.shape[0]
    if silu_mul_input and width % 2:
        raise ValueError(f"a gate_up input needs an even last dim, not {width}")
    if weight.dim() != 2 or weight.shape[1] != k:
        raise ValueError(f"weight {tuple(weight.shape)} does not match x's last dim {k}")
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError("x, weight and bias must share one dtype")
    _check_norm_args(x, silu_mul_input, rms_norm, residual, residual_out)
    if out is None:
        out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    rows = x.reshape(-1, width)
    m = rows.shape[0]
    if m == 0:
        return out
    if n == 0 or k == 0 or weight.stride(1) != 1:
        out.copy_(
            skinny_linear_torch(
                x,
                weight,
                bias,
                silu_mul_input=silu_mul_input,
                rms_norm=rms_norm,
                residual=residual,
                residual_out=residual_out,
                norm_offset=norm_offset,
            )  # fmt: skip
        )
        return out
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    # Without RMS_NORM (or a residual) the kernel never touches these: any tensor will do.
    norm_weight = res_rows = res_out_rows = rows
    eps = 0.0
    if rms_norm is not None:
        norm_weight, eps = rms_norm
        norm_weight = norm_weight.contiguous()
        if residual is not None:
            res_rows = residual.reshape(-1, k)
            if res_rows.stride(-1) != 1:
                res_rows = res_rows.contiguous()
            res_out_rows = residual_out.view(-1, k)
    out_rows = out.view(-1, n)
    cfg = config if config is not None else pick_config(m, n, k)
    block_m = 16 if cfg.use_dot else min(m_bucket(m), 4)
    split_k = max(1, cfg.split_k)
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), cfg.block_k) * cfg.block_k
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, block_m), split_k)
    target = out_rows
    if split_k > 1:
        target = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
    pdl = pdl_enabled(x.device)
    _skinny_matmul_kernel[grid](
        rows,
        weight,
        bias if bias is not None else weight,  # unused without HAS_BIAS
        target,
        res_rows,
        norm_weight,
        res_out_rows,
        m,
        n,
        k,
        rows.stride(0),
        weight.stride(0),
        target.stride(-2),
        target.stride(0) if split_k > 1 else 0,
        res_rows.stride(0),
        res_out_rows.stride(0),
        k_per_split,
        eps,
        BLOCK_M=block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        SPLIT_K=split_k,
        USE_DOT=cfg.use_dot,
        EVEN_K=k % (cfg.block_k * split_k) == 0,
        HAS_BIAS=bias is not None,
        SILU_MUL=silu_mul_input,
        RMS_NORM=0 if rms_norm is None else 2 if norm_offset else 1,
        HAS_RESIDUAL=residual is not None,
        NORM_BLOCK=triton.next_power_of_2(k) if rms_norm is not None else 1,
        NUM_STAGES=cfg.num_stages,
        PDL=pdl,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **launch_options(pdl),
    )
    if split_k > 1:
        block = min(1024, triton.next_power_of_2(n))
        _split_k_reduce_kernel[(m, triton.cdiv(n, block))](
            target,
            bias if bias is not None else target,
            out_rows,
            n,
            target.stride(0),
            out_rows.stride(0),
            SPLIT_K=split_k,
            BLOCK=block,
            HAS_BIAS=bias is not None,
            num_warps=4,
        )
    return out
