"""The skinny GEMM kernels (the launcher and its config table are `triton_linear`, whose module
doc describes the design): `_skinny_matmul_kernel` with its row loaders and the fused RMSNorm /
SiLU-and-mul prologues, and `_split_k_reduce_kernel`, which sums SPLIT_K partials in a fixed
order.

Kept apart from the launcher so that the device code and the host-side launch table (tuned per
GPU by `benchmarks/gemv_bench.py`) each read on their own.
"""

import triton
import triton.language as tl


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
        if RMS_NORM == 2:  # as _rms_norm_kernel's OFFSET: scale by 1 + weight, one rounding
            x = (x.to(tl.float32) * rstd * (1.0 + nw.to(tl.float32))).to(ptrs.dtype.element_ty)
        else:  # as _rms_norm_kernel: normalise in fp32, round, scale by the weight, round
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
    # 1: the GEMM's x is rms_norm(x (+ residual)) * norm weight; 2: * (1 + norm weight), the
    # offset form (Qwen3.5's norms); 0: x as it is
    RMS_NORM: tl.constexpr,
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
