"""A Gated DeltaNet layer's verify forward in one launch, in the delta rule's chunked form: the
block's rows as one chunk of matrix products instead of a serial pass over them. Same
arguments, stash and outputs as `triton_gated_deltanet_verify` (whose torch twin,
`gated_deltanet_verify_torch`, is the specification), same roundings to the tensors' dtypes
up to the order of the float32 sums.

Why: the row kernel's programs step through the block's rows one after another, two
reductions over Dk a row, so a verify costs ~16 decode steps of latency whatever the batch
(Qwen3.5-27B heads on an H200, 16 rows: 28 us a layer at batch 1, 396 at 32, where one
decode row takes 8-11). Here a program forms every row's conv (tiles of [rows, channels]),
the L2 norms, g and beta at once, then, with S the slot's state slice [Dk, BV] and the
rows' cumulative log decay c (Gamma = exp(c)):

    A = strictly lower (beta_t exp(c_t - c_i) k_t . k_i)         [T, T]
    U = (I + A)^-1 beta (V - Gamma K S)                          [T, BV], the rows' deltas
    O = Gamma Q S + causal(exp(c_t - c_i) q_t . k_i) U           [T, BV], the un-normed output

A is nilpotent (A^T = 0 for T rows), so (I + A)^-1 = (I - A)(I + A^2)(I + A^4)...: log2(T) - 1
squarings (three for 16 rows, one for 4), each a product on the tensor cores, instead of a
forward substitution row by row.
The state slice is only read (the commit kernel advances it over the accepted rows, row by
row, as decoding does). Everything else (one program per (sequence, value head, block of
value dims), the stash, the gated RMSNorm by the head's last program) is the row kernel's.

Precision. The products over Dk (K S, Q S, K K^T, Q K^T) take tf32 in 16-bit models, as the
prefill kernel's do (ieee in float32 ones); the inverse's chain and the scores' product take
tf32x3 (three tensor-core products of split operands, near float32): where keys align the
powers of A grow to thousands (13 equal keys with beta 1 and no decay: A^8 entries of 3,432)
and cancel back to O(1), which plain tf32 cannot do. Emulated on 16 rows (Dk 128), the output
is within 1.2e-3 of each row's largest value with random keys and 3.3e-3 with equal ones (a
bf16 ulp is 3.9e-3; all-tf32 dots: 5.5, i.e. wrong; tf32x3 everywhere: 4.5e-3 but, at 32
value dims, 255 registers and 112 bytes of spills a thread on sm_90, against 186 and none so).
For the same reason blocks of more than MAX_CHUNK_ROWS rows go to the row kernel (20 aligned
rows came out 3% off even in float32: A^16's entries reach ~10^4).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from blockdraft.kernels.gated_deltanet_verify import MAX_CHUNK_ROWS
from blockdraft.kernels.pdl import launch_options, pdl_enabled, pdl_start
from blockdraft.kernels.triton_chunk_gated_delta_rule import _normed
from blockdraft.kernels.triton_gated_delta_rule import _gate_inputs
from blockdraft.kernels.triton_gated_deltanet_verify import (
    _check_verify_shapes,
    _gated_norm_when_done,
    _head_channels,
    _rows,
    _state_slice_ptrs,
    _verify_program,
    triton_gated_deltanet_verify,
)

__all__ = ["triton_gated_deltanet_verify_chunked"]

MIN_DOT = 16  # tl.dot tiles are at least 16 a side


@triton.jit
def _conv_tile(
    qkv_ptr,  # [N, conv_dim] row stride stride_qkv
    stride_qkv,
    conv_ptr,  # this slot's conv state [K - 1, conv_dim] contiguous
    weight_ptr,  # [conv_dim, K] contiguous
    rows_ptr,  # this sequence's [T] flat rows
    offs_t,  # [BT] steps
    length,
    ch,  # [B] channels
    mask,  # [B]
    keep,  # scalar: read the conv state (not fresh)
    conv_dim,
    K: tl.constexpr,
):
    """Every step's conv inputs [BT, B] (qkv's dtype) on channels `ch`, and silu(conv) of its
    window (the conv state's rows before the block's first step), summed oldest input first
    and rounded as the row kernel rounds (returned in qkv's dtype)."""
    state_ty = conv_ptr.dtype.element_ty
    acc = tl.zeros((offs_t.shape[0], ch.shape[0]), dtype=tl.float32)
    for j in tl.static_range(K):
        src = offs_t - (K - 1) + j  # [BT] the window's step: < 0 in the conv state
        in_block = (src >= 0) & (src < length)
        row = tl.load(rows_ptr + src, mask=in_block, other=0)
        x = tl.load(
            qkv_ptr + row[:, None] * stride_qkv + ch[None, :],
            mask=in_block[:, None] & mask[None, :],
            other=0.0,
        )
        old = tl.load(
            conv_ptr + (src + K - 1)[:, None] * conv_dim + ch[None, :],
            mask=((src < 0) & keep)[:, None] & mask[None, :],
            other=0.0,
        )
        val = tl.where((src < 0)[:, None], old, x.to(state_ty))
        w = tl.load(weight_ptr + ch * K + j, mask=mask, other=0.0).to(tl.float32)
        acc += val.to(tl.float32) * w[None, :]
    acc = acc.to(state_ty).to(tl.float32)
    mixed = (acc / (1.0 + tl.exp(-acc))).to(state_ty).to(qkv_ptr.dtype.element_ty)
    return x, mixed  # x: the last tap's, the step's own inputs


@triton.jit
def _stash_tile(
    x_stash_ptr,  # this slot's stash of conv inputs [W, conv_dim] contiguous
    mixed_stash_ptr,  # and of conv outputs
    x,  # [BT, B] the steps' conv inputs on channels ch
    mixed,  # [BT, B] their conv outputs
    offs_t,  # [BT]
    ch,  # [B]
    mask,  # [BT, B]
    conv_dim,
):
    offs = offs_t[:, None] * conv_dim + ch[None, :]
    tl.store(x_stash_ptr + offs, x.to(x_stash_ptr.dtype.element_ty), mask=mask)
    tl.store(mixed_stash_ptr + offs, mixed.to(mixed_stash_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gated_deltanet_verify_chunk_kernel(
    qkv_ptr,  # [N, conv_dim] row stride stride_qkv: q | k | v channels
    ba_ptr,  # [N, 2 * Hv] row stride stride_ba: b then a
    z_ptr,  # [N, Hv * Dv] row stride stride_z
    conv_weight_ptr,  # [conv_dim, K] contiguous
    a_log_ptr,  # [Hv]
    dt_bias_ptr,  # [Hv]
    norm_weight_ptr,  # [Dv]
    conv_ptr,  # [num_slots, K - 1, conv_dim] contiguous
    state_ptr,  # [num_slots, Hv, Dk, Dv] float32 contiguous
    stash_qkv_ptr,  # [num_slots, W, conv_dim] contiguous
    stash_mixed_ptr,  # [num_slots, W, conv_dim] contiguous
    stash_gb_ptr,  # [num_slots, W, 2 * Hv] float32 contiguous
    slots_ptr,  # [S] int64 (-1: the last slot)
    fresh_ptr,  # [S] bool
    rows_ptr,  # [S, T] int64 contiguous
    lengths_ptr,  # [S] int64
    counters_ptr,  # [>= S * Hv] int32 zeros; left as zeros
    out_ptr,  # [N, Hv * Dv] contiguous, qkv's dtype
    stride_qkv,
    stride_ba,
    stride_z,
    num_slots,
    T,
    W,
    Hk,
    Hv,
    Dk,
    Dv,
    groups,  # Hv // Hk: value heads per key head
    scale,  # Dk ** -0.5, on the normalised query
    l2_eps,
    norm_eps,
    K: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    BT: tl.constexpr,  # 16 >= T
    SQUARINGS: tl.constexpr,  # log2(T rounded up to a power of two) - 1: A^(2^(S+1)) = 0
    BD: tl.constexpr,  # Dv rounded up to a power of two
    SPLIT: tl.constexpr,  # more than one value block a head
    ROUND_PRODUCT: tl.constexpr,  # norm weight * normed x is rounded to the output dtype
    PRECISION: tl.constexpr,  # of the products over Dk: "tf32" (16-bit models) or "ieee"
    PDL: tl.constexpr,  # launched with programmatic dependent launch (blockdraft.kernels.pdl)
):
    pdl_start(PDL)
    conv_dim = 2 * Hk * Dk + Hv * Dv
    seq, head, block, slot, keep, length, seq_rows_ptr, conv_slot_ptr = _verify_program(
        slots_ptr, fresh_ptr, rows_ptr, lengths_ptr, conv_ptr, num_slots, T, conv_dim, K
    )

    offs_t = tl.arange(0, BT)
    mask_t = offs_t < length
    offs_k, mask_k, q_ch, k_ch, offs_v, mask_v, v_ch = _head_channels(
        head, block, groups, Hk, Dk, Dv, BK, BV
    )
    rows_tk = mask_t[:, None] & mask_k[None, :]
    rows_tv = mask_t[:, None] & mask_v[None, :]

    conv_args = (qkv_ptr, stride_qkv, conv_slot_ptr, conv_weight_ptr, seq_rows_ptr, offs_t,
                 length)  # fmt: skip
    xq, q = _conv_tile(*conv_args, q_ch, mask_k, keep, conv_dim, K)
    xk, k = _conv_tile(*conv_args, k_ch, mask_k, keep, conv_dim, K)
    xv, v = _conv_tile(*conv_args, v_ch, mask_v, keep, conv_dim, K)
    x_stash_ptr = stash_qkv_ptr + slot * W * conv_dim
    mixed_stash_ptr = stash_mixed_ptr + slot * W * conv_dim
    stashes_qk = (head % groups == 0) & (block == 0)
    _stash_tile(x_stash_ptr, mixed_stash_ptr, xq, q, offs_t, q_ch, rows_tk & stashes_qk, conv_dim)
    _stash_tile(x_stash_ptr, mixed_stash_ptr, xk, k, offs_t, k_ch, rows_tk & stashes_qk, conv_dim)
    _stash_tile(x_stash_ptr, mixed_stash_ptr, xv, v, offs_t, v_ch, rows_tv, conv_dim)

    row = tl.load(seq_rows_ptr + offs_t, mask=mask_t, other=0)
    b = tl.load(ba_ptr + row * stride_ba + head, mask=mask_t, other=0.0)
    a = tl.load(ba_ptr + row * stride_ba + Hv + head, mask=mask_t, other=0.0)
    neg_a = -tl.exp(tl.load(a_log_ptr + head).to(tl.float32))
    g, beta = _gate_inputs(b, a, neg_a, tl.load(dt_bias_ptr + head).to(tl.float32))
    gb_ptr = stash_gb_ptr + (slot * W + offs_t) * 2 * Hv + head
    tl.store(gb_ptr, g, mask=mask_t & (block == 0))
    tl.store(gb_ptr + Hv, beta, mask=mask_t & (block == 0))
    # Steps past the block's length take no decay, no beta and zero q/k/v (their windows
    # still reach real inputs): zero rows and columns of every product below.
    g = tl.where(mask_t, g, 0.0)
    beta = tl.where(mask_t, beta, 0.0)
    q = tl.where(rows_tk, _normed(q.to(tl.float32), scale, l2_eps), 0.0)
    k = tl.where(rows_tk, _normed(k.to(tl.float32), 1.0, l2_eps), 0.0)
    v = tl.where(rows_tv, v.to(tl.float32), 0.0)

    state_ptrs = _state_slice_ptrs(state_ptr, slot, head, offs_k, offs_v, Hv, Dk, Dv)
    state = tl.load(state_ptrs, mask=mask_k[:, None] & mask_v[None, :] & keep, other=0.0)
    cum = tl.cumsum(g, axis=0)
    causal = offs_t[:, None] >= offs_t[None, :]
    # exp only on and below the diagonal (cum falls, so above it could overflow)
    pair_decay = tl.exp(tl.where(causal, cum[:, None] - cum[None, :], 0.0))
    kk = tl.dot(k, tl.trans(k), input_precision=PRECISION)
    a_pow = tl.where(offs_t[:, None] > offs_t[None, :], kk * pair_decay * beta[:, None], 0.0)
    ks = tl.dot(k, state, input_precision=PRECISION)  # [BT, BV]
    rhs = beta[:, None] * (v - tl.exp(cum)[:, None] * ks)
    u = rhs - tl.dot(a_pow, rhs, input_precision="tf32x3")  # (I - A) rhs
    for _ in tl.static_range(SQUARINGS):
        a_pow = tl.dot(a_pow, a_pow, input_precision="tf32x3")  # A^2, A^4, ...
        u += tl.dot(a_pow, u, input_precision="tf32x3")
    scores = tl.where(causal, tl.dot(q, tl.trans(k), input_precision=PRECISION) * pair_decay, 0.0)
    core = tl.exp(cum)[:, None] * tl.dot(q, state, input_precision=PRECISION)
    core += tl.dot(scores, u, input_precision="tf32x3")
    out_ptrs = out_ptr + row[:, None] * (Hv * Dv) + head * Dv + offs_v[None, :]
    tl.store(out_ptrs, core.to(out_ptr.dtype.element_ty), mask=rows_tv)

    _gated_norm_when_done(out_ptr, z_ptr, norm_weight_ptr, counters_ptr, seq_rows_ptr, seq,
                          length, head, stride_z, Hv, Dv, norm_eps, BT, BD, SPLIT,
                          ROUND_PRODUCT)  # fmt: skip


def triton_gated_deltanet_verify_chunked(
    qkv: torch.Tensor,  # [N, conv_dim] the forward's conv inputs: q | k | v channels
    b_a: torch.Tensor,  # [N, 2 * Hv]: b then a
    z: torch.Tensor,  # [N, Hv * Dv] output gate
    conv_weight: torch.Tensor,  # [conv_dim, K] depthwise taps
    a_log: torch.Tensor,  # [Hv]
    dt_bias: torch.Tensor,  # [Hv]
    norm_weight: torch.Tensor,  # [Dv]
    norm_eps: float,
    num_k_heads: int,
    conv_pool: torch.Tensor,  # [num_slots, K - 1, conv_dim] contiguous
    state_pool: torch.Tensor,  # [num_slots, Hv, Dk, Dv] float32 contiguous
    stash_qkv: torch.Tensor,  # [num_slots, W, conv_dim] contiguous
    stash_mixed: torch.Tensor,  # [num_slots, W, conv_dim] contiguous
    stash_gb: torch.Tensor,  # [num_slots, W, 2 * Hv] float32 contiguous
    slots: torch.Tensor,  # [S] int64 each sequence's slot (-1: the spare last)
    fresh: torch.Tensor,  # [S] bool: start from zero states
    rows: torch.Tensor,  # [S, T] int64 flat row of each step; past a sequence's length, its last
    lengths: torch.Tensor,  # [S] int64 rows of each sequence (T >= each >= 1)
    counters: torch.Tensor | None = None,  # [>= S * Hv] int32 zeros, kept between launches
    block_v: int | None = None,  # value dims of a program's state slice (default: up to 64)
    num_warps: int = 4,
) -> torch.Tensor:  # [N, Hv * Dv] qkv's dtype
    """`gated_deltanet_verify_torch` in one launch of the chunked form (the stash only for
    each sequence's first `lengths` rows); blocks of more than MAX_CHUNK_ROWS rows take the
    row kernel."""
    n, conv_dim = qkv.shape
    s, t = rows.shape
    hv, dk, dv = state_pool.shape[1:]
    _check_verify_shapes(t, stash_qkv.shape[1], conv_weight.shape[-1])
    if t > MAX_CHUNK_ROWS:
        return triton_gated_deltanet_verify(
            qkv, b_a, z, conv_weight, a_log, dt_bias, norm_weight, norm_eps, num_k_heads,
            conv_pool, state_pool, stash_qkv, stash_mixed, stash_gb, slots, fresh, rows, lengths,
            counters, block_v,
        )  # fmt: skip
    out = torch.empty(n, hv * dv, dtype=qkv.dtype, device=qkv.device)
    if s == 0:
        return out
    if counters is None or counters.numel() < s * hv:
        counters = torch.zeros(s * hv, dtype=torch.int32, device=qkv.device)
    # 64 value dims a program, 4 warps: the fastest of 32 / 64 x 4 / 8 warps at every batch
    # and block (H100, 27B heads; 8 warps: 1.6-1.9x slower), with no spills (255 registers).
    bv = max(MIN_DOT, block_v or min(triton.next_power_of_2(dv), 64))
    blocks = triton.cdiv(dv, bv)
    qkv, b_a, z = _rows(qkv), _rows(b_a), _rows(z)
    round_product = torch.result_type(norm_weight, out) == out.dtype != torch.float32
    pdl = pdl_enabled(qkv.device)
    _gated_deltanet_verify_chunk_kernel[(s, hv, blocks)](
        qkv, b_a, z, conv_weight.contiguous(), a_log, dt_bias, norm_weight,
        conv_pool, state_pool, stash_qkv, stash_mixed, stash_gb,
        slots, fresh, rows.contiguous(), lengths, counters, out,
        qkv.stride(0), b_a.stride(0), z.stride(0),
        state_pool.shape[0], t, stash_qkv.shape[1], num_k_heads, hv, dk, dv, hv // num_k_heads,
        dk**-0.5, 1e-6, norm_eps,
        K=conv_weight.shape[-1], BK=max(MIN_DOT, triton.next_power_of_2(dk)), BV=bv, BT=MIN_DOT,
        SQUARINGS=max(triton.next_power_of_2(t).bit_length() - 2, 0),
        BD=triton.next_power_of_2(dv), SPLIT=blocks > 1,
        ROUND_PRODUCT=round_product,
        PRECISION="ieee" if qkv.dtype == torch.float32 else "tf32",
        PDL=pdl, num_warps=num_warps, **launch_options(pdl),
    )  # fmt: skip
    return out
