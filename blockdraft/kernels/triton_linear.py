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
x chunk is formed as round(round(s * rstd) * norm_weight), the norm kernel's output; program 0
along N (split 0) writes s to the residual-out buffer.

SPLIT_K > 1 cuts K into SPLIT_K ranges whose fp32 partial sums go to a [SPLIT_K, M, N]
workspace, summed in a fixed order (with the bias) by a second kernel: deterministic, unlike
atomics. It pays only when N / BLOCK_N leaves SMs idle.

Launch parameters come from `DEFAULT_CONFIGS` (by M bucket and the exact (N, K), else the
nearest tabulated shape): `benchmarks/gemv_bench.py` measures the candidates on a GPU and
prints a table to paste there. Only tensor shapes steer the launch: no host sync, so calls can
be captured in CUDA graphs.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from blockdraft.kernels.linear import skinny_linear_torch
from blockdraft.kernels.pdl import launch_options, pdl_enabled

__all__ = ["DEFAULT_CONFIGS", "SkinnyConfig", "skinny_linear", "skinny_linear_torch"]


@triton.jit
def _norm_row_rstd(
    x_ptr,
    res_ptr,
    res_out_ptr,
    row,  # int64, clamped to a valid row of x
    stride_xm,
    stride_rm,
    stride_rom,
    K,
    eps,
    write,  # scalar bool: this program stores the row's residual stream
    HAS_RESIDUAL: tl.constexpr,
    NORM_BLOCK: tl.constexpr,  # next_power_of_2(K): the whole row in one block
):  # fp32 scalar, the row's 1 / rms
    # The very loads, rounding and full-row sum of `_rms_norm_kernel`, so that rstd is its rstd.
    offs = tl.arange(0, NORM_BLOCK)
    ok = offs < K
    x = tl.load(x_ptr + row * stride_xm + offs, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_rm + offs, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_rom + offs, x, mask=ok & write)
    x32 = x.to(tl.float32)
    return 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / K + eps)


@triton.jit
def _load_x(
    ptrs,  # [..., BLOCK_K] pointers into x; with SILU_MUL into its gate half
    up_offset,  # K: with SILU_MUL, how far the up half sits from the gate half
    k_ok,  # [..., BLOCK_K] bool; ignored when EVEN_K
    res_ptrs,  # [..., BLOCK_K] pointers into the residual; read with RMS_NORM and HAS_RESIDUAL
    nw_ptrs,  # [..., BLOCK_K] (broadcastable) pointers into the norm weight; with RMS_NORM
    rstd,  # fp32, broadcastable to [..., BLOCK_K]: the rows' 1 / rms; with RMS_NORM
    EVEN_K: tl.constexpr,
    SILU_MUL: tl.constexpr,
    RMS_NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):  # [..., BLOCK_K] x's dtype
    if EVEN_K:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=k_ok, other=0.0)
    if RMS_NORM:  # masked lanes: x = 0 gives 0
        if HAS_RESIDUAL:
            if EVEN_K:
                r = tl.load(res_ptrs)
            else:
                r = tl.load(res_ptrs, mask=k_ok, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(ptrs.dtype.element_ty)
        if EVEN_K:
            nw = tl.load(nw_ptrs)
        else:
            nw = tl.load(nw_ptrs, mask=k_ok, other=0.0)
        # As _rms_norm_kernel: normalise in fp32, round, scale by the weight, round.
        normed = (x.to(tl.float32) * rstd).to(ptrs.dtype.element_ty).to(tl.float32)
        x = (normed * nw.to(tl.float32)).to(ptrs.dtype.element_ty)
    if SILU_MUL:  # masked lanes: silu(0) * 0 = 0
        if EVEN_K:
            up = tl.load(ptrs + up_offset)
        else:
            up = tl.load(ptrs + up_offset, mask=k_ok, other=0.0)
        # As triton_silu_mul (and F.silu(gate) * up): silu in fp32 rounded to x's dtype, then
        # the product rounded once; the GEMM must see the same operand as the unfused path.
        g = x.to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(ptrs.dtype.element_ty).to(tl.float32)
        x = (s * up.to(tl.float32)).to(ptrs.dtype.element_ty)
    return x


@triton.jit
def _row_term(
    acc,  # [BLOCK_N, BLOCK_K] fp32, this row's running products
    w,  # [BLOCK_N, BLOCK_K] fp32, the weight chunk
    x_ptr,
    row,  # int64, clamped to a valid row of x
    stride_xm,
    k_offs,  # [BLOCK_K] positions along K
    k_ok,  # [BLOCK_K] bool; ignored when EVEN_K
    K,
    res_ptr,
    stride_rm,
    nw_ptr,
    rstd,  # fp32 scalar, the row's 1 / rms; with RMS_NORM
    EVEN_K: tl.constexpr,
    SILU_MUL: tl.constexpr,
    RMS_NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    x = _load_x(
        x_ptr + row * stride_xm + k_offs, K, k_ok, res_ptr + row * stride_rm + k_offs,
        nw_ptr + k_offs, rstd, EVEN_K, SILU_MUL, RMS_NORM, HAS_RESIDUAL,
    )  # fmt: skip
    return acc + w * x.to(tl.float32)[None, :]


@triton.jit
def _store_rows(
    acc,  # [BLOCK_N, ROWS] fp32 (ROWS = BLOCK_M on the dot path, 1 on the broadcast path)
    out_ptr,
    bias_ptr,
    offs_n,  # [BLOCK_N]
    rows_n,  # [BLOCK_N] clamped
    offs_m,  # [ROWS]
    N,
    M,
    stride_om,
    split_offset,  # int64 offset of this split's workspace slice
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    ok = (offs_n < N)[:, None] & (offs_m < M)[None, :]
    out_ptrs = out_ptr + offs_m.to(tl.int64)[None, :] * stride_om + offs_n[:, None]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rows_n).to(tl.float32)[:, None]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        tl.store(out_ptrs + split_offset, acc, mask=ok)


# M is not specialised (Triton would compile M == 1 and M % 16 == 0 apart): one compile per
# config serves every row count, and the clamps and store masks on M cost nothing here.
@triton.jit(do_not_specialize=["M"])
def _skinny_matmul_kernel(
    x_ptr,  # [M, K], unit column stride; with SILU_MUL [M, 2K], gate then up
    w_ptr,  # [N, K], unit column stride
    bias_ptr,  # [N]; read when HAS_BIAS (and SPLIT_K == 1)
    out_ptr,  # [M, N] x's dtype; with SPLIT_K > 1 the fp32 workspace [SPLIT_K, M, N]
    res_ptr,  # [M, K] residual, unit column stride; read with RMS_NORM and HAS_RESIDUAL
    nw_ptr,  # [K] norm weight, x's dtype; read with RMS_NORM
    res_out_ptr,  # [M, K] x + residual; written with RMS_NORM and HAS_RESIDUAL
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    stride_os,  # workspace stride between splits
    stride_rm,
    stride_rom,
    k_per_split,  # a multiple of BLOCK_K
    eps,  # the norm's epsilon; with RMS_NORM
    BLOCK_M: tl.constexpr,  # 16 with USE_DOT; 1, 2 or 4 without
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % (BLOCK_K * SPLIT_K) == 0: no masks along K
    HAS_BIAS: tl.constexpr,
    SILU_MUL: tl.constexpr,  # the GEMM's x is silu(x[:, :K]) * x[:, K:]
    RMS_NORM: tl.constexpr,  # the GEMM's x is rms_norm(x (+ residual)) * norm weight
    HAS_RESIDUAL: tl.constexpr,
    NORM_BLOCK: tl.constexpr,  # next_power_of_2(K) with RMS_NORM, else 1
    NUM_STAGES: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch (blockdraft.kernels.pdl)
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Clamped, not masked: rows past N or M reread a valid row, and the store drops them.
    rows_n = tl.minimum(offs_n, N - 1).to(tl.int64)
    m0 = pid_m * BLOCK_M
    k_start = pid_k * k_per_split
    k_len = tl.minimum(K - k_start, k_per_split)  # <= 0 for a trailing empty split
    split_offset = pid_k.to(tl.int64) * stride_os
    w_ptrs = w_ptr + rows_n[:, None] * stride_wn + (k_start + offs_k)[None, :]  # [BN, BK]
    # Program 0 along N, split 0, stores the residual stream of its rows: one writer each.
    writer = (pid_n == 0) & (pid_k == 0)
    if PDL:  # wait for the previous kernel before the first read of x
        tl.extra.cuda.gdc_wait()
    if USE_DOT:
        offs_m = m0 + tl.arange(0, BLOCK_M)
        rows_m = tl.minimum(offs_m, M - 1).to(tl.int64)
        x_ptrs = x_ptr + rows_m[:, None] * stride_xm + (k_start + offs_k)[None, :]  # [BM, BK]
        res_ptrs = res_ptr + rows_m[:, None] * stride_rm + (k_start + offs_k)[None, :]
        nw_ptrs = nw_ptr + (k_start + offs_k)[None, :]  # [1, BK]
        rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)
        if RMS_NORM:  # one full-row pre-pass per row, gathered into a [BLOCK_M] vector
            for i in tl.static_range(BLOCK_M):
                rstd_i = _norm_row_rstd(
                    x_ptr, res_ptr, res_out_ptr, tl.minimum(m0 + i, M - 1).to(tl.int64),
                    stride_xm, stride_rm, stride_rom, K, eps, writer & (m0 + i < M),
                    HAS_RESIDUAL, NORM_BLOCK,
                )  # fmt: skip
                rstd = tl.where(tl.arange(0, BLOCK_M) == i, rstd_i, rstd)
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k in tl.range(0, k_len, BLOCK_K, num_stages=NUM_STAGES):
            k_ok = (offs_k < k_len - k)[None, :]
            if EVEN_K:
                w = tl.load(w_ptrs, eviction_policy="evict_first")
            else:
                w = tl.load(w_ptrs, mask=k_ok, other=0.0, eviction_policy="evict_first")
            x = _load_x(
                x_ptrs, K, k_ok, res_ptrs, nw_ptrs, rstd[:, None], EVEN_K, SILU_MUL, RMS_NORM,
                HAS_RESIDUAL,
            )  # fmt: skip
            # fp32 stays fp32 ("ieee"), as F.linear without TF32; ignored for 16-bit inputs.
            acc = tl.dot(w, tl.trans(x), acc, input_precision="ieee")
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
            res_ptrs += BLOCK_K
            nw_ptrs += BLOCK_K
        if PDL:  # every W chunk read: the successor's launch overlaps the stores and tail
            tl.extra.cuda.gdc_launch_dependents()
        _store_rows(
            acc, out_ptr, bias_ptr, offs_n, rows_n, offs_m, N, M, stride_om, split_offset,
            SPLIT_K, HAS_BIAS,
        )  # fmt: skip
    else:
        # One [BLOCK_N, BLOCK_K] fp32 accumulator per row of x, all fed by the same W chunk in
        # its coalesced load layout, reduced over K once after the loop.
        row0 = tl.minimum(m0, M - 1).to(tl.int64)
        row1 = tl.minimum(m0 + 1, M - 1).to(tl.int64)
        row2 = tl.minimum(m0 + 2, M - 1).to(tl.int64)
        row3 = tl.minimum(m0 + 3, M - 1).to(tl.int64)
        rstd0 = 0.0
        rstd1 = 0.0
        rstd2 = 0.0
        rstd3 = 0.0
        if RMS_NORM:
            rstd0 = _norm_row_rstd(
                x_ptr, res_ptr, res_out_ptr, row0, stride_xm, stride_rm, stride_rom, K, eps,
                writer, HAS_RESIDUAL, NORM_BLOCK,
            )  # fmt: skip
            if BLOCK_M > 1:
                rstd1 = _norm_row_rstd(
                    x_ptr, res_ptr, res_out_ptr, row1, stride_xm, stride_rm, stride_rom, K, eps,
                    writer & (m0 + 1 < M), HAS_RESIDUAL, NORM_BLOCK,
                )  # fmt: skip
            if BLOCK_M > 2:
                rstd2 = _norm_row_rstd(
                    x_ptr, res_ptr, res_out_ptr, row2, stride_xm, stride_rm, stride_rom, K, eps,
                    writer & (m0 + 2 < M), HAS_RESIDUAL, NORM_BLOCK,
                )  # fmt: skip
                rstd3 = _norm_row_rstd(
                    x_ptr, res_ptr, res_out_ptr, row3, stride_xm, stride_rm, stride_rom, K, eps,
                    writer & (m0 + 3 < M), HAS_RESIDUAL, NORM_BLOCK,
                )  # fmt: skip
        acc0 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc1 = acc0
        acc2 = acc0
        acc3 = acc0
        x_offs = k_start + offs_k
        for k in tl.range(0, k_len, BLOCK_K, num_stages=NUM_STAGES):
            k_ok = offs_k < k_len - k
            if EVEN_K:
                w = tl.load(w_ptrs, eviction_policy="evict_first")
            else:
                w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0, eviction_policy="evict_first")
            w = w.to(tl.float32)
            acc0 = _row_term(
                acc0, w, x_ptr, row0, stride_xm, x_offs + k, k_ok, K, res_ptr, stride_rm, nw_ptr,
                rstd0, EVEN_K, SILU_MUL, RMS_NORM, HAS_RESIDUAL,
            )  # fmt: skip
            if BLOCK_M > 1:
                acc1 = _row_term(
                    acc1, w, x_ptr, row1, stride_xm, x_offs + k, k_ok, K, res_ptr, stride_rm,
                    nw_ptr, rstd1, EVEN_K, SILU_MUL, RMS_NORM, HAS_RESIDUAL,
                )  # fmt: skip
            if BLOCK_M > 2:
                acc2 = _row_term(
                    acc2, w, x_ptr, row2, stride_xm, x_offs + k, k_ok, K, res_ptr, stride_rm,
                    nw_ptr, rstd2, EVEN_K, SILU_MUL, RMS_NORM, HAS_RESIDUAL,
                )  # fmt: skip
                acc3 = _row_term(
                    acc3, w, x_ptr, row3, stride_xm, x_offs + k, k_ok, K, res_ptr, stride_rm,
                    nw_ptr, rstd3, EVEN_K, SILU_MUL, RMS_NORM, HAS_RESIDUAL,
                )  # fmt: skip
            w_ptrs += BLOCK_K
        if PDL:  # every W chunk read: the successor's launch overlaps the stores and tail
            tl.extra.cuda.gdc_launch_dependents()
        one = tl.arange(0, 1)
        _store_rows(
            tl.sum(acc0, axis=1)[:, None], out_ptr, bias_ptr, offs_n, rows_n, m0 + one, N, M,
            stride_om, split_offset, SPLIT_K, HAS_BIAS,
        )  # fmt: skip
        if BLOCK_M > 1:
            _store_rows(
                tl.sum(acc1, axis=1)[:, None], out_ptr, bias_ptr, offs_n, rows_n, m0 + 1 + one,
                N, M, stride_om, split_offset, SPLIT_K, HAS_BIAS,
            )  # fmt: skip
        if BLOCK_M > 2:
            _store_rows(
                tl.sum(acc2, axis=1)[:, None], out_ptr, bias_ptr, offs_n, rows_n, m0 + 2 + one,
                N, M, stride_om, split_offset, SPLIT_K, HAS_BIAS,
            )  # fmt: skip
            _store_rows(
                tl.sum(acc3, axis=1)[:, None], out_ptr, bias_ptr, offs_n, rows_n, m0 + 3 + one,
                N, M, stride_om, split_offset, SPLIT_K, HAS_BIAS,
            )  # fmt: skip


@triton.jit
def _split_k_reduce_kernel(
    ws_ptr,  # [SPLIT_K, M, N] fp32 partial sums
    bias_ptr,  # [N]; read when HAS_BIAS
    out_ptr,  # [M, N]
    N,
    stride_ws,  # M * N
    stride_om,
    SPLIT_K: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    m = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):  # a fixed order: the same sum on every run
        acc += tl.load(ws_ptr + s * stride_ws + m * N + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


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
}


def m_bucket(m: int) -> int:
    return min(triton.next_power_of_2(max(m, 1)), 16)


def pick_config(m: int, n: int, k: int) -> SkinnyConfig:
    """The tabulated config for (M bucket, N, K), else that of the nearest tabulated shape of
    the same M bucket, with BLOCK_K and SPLIT_K cut down to what a short K can use."""
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
        raise ValueError(f"norm weight {tuple(norm_weight.shape)} {norm_weight.dtype} does not "
                         f"match x's last dim {x.shape[-1]} and dtype {x.dtype}")
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
) -> torch.Tensor:  # [..., N], x's dtype
    """`F.linear(x, weight, bias)` for few rows of x; fp32 accumulation. Any row count works
    (the grid tiles M by 16) but past 16 rows cuBLAS's GEMMs are the better choice. A weight
    without unit column stride is left to F.linear rather than copied. With silu_mul_input,
    `F.linear(silu_mul_torch(*x.chunk(2, -1)), weight, bias)`, the activation formed in the
    kernel's loads (K, the GEMM's depth and the config's key, is half of x's width).

    With rms_norm = (norm_weight, eps), the GEMM's input is `rms_norm_torch(x, norm_weight,
    eps, residual)`, formed in the kernel's loads exactly as `triton_rms_norm` forms it; with a
    residual the new stream x + residual is written to residual_out (required, and not
    aliasing x or residual: other programs still read them while it is written)."""
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
                x, weight, bias, silu_mul_input=silu_mul_input, rms_norm=rms_norm,
                residual=residual, residual_out=residual_out,
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
        RMS_NORM=rms_norm is not None,
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
