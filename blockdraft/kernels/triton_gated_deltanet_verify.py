"""A Gated DeltaNet layer's verify forward in one launch, and the commit after it in one more:
the kernels of `gated_deltanet_verify_torch` and `gated_deltanet_commit_torch`
(blockdraft.kernels.gated_deltanet_verify; same arguments, same roundings to the tensors'
dtypes, reductions may round in a different order).

Verify: one program per (sequence, value head, block of value dims) holds its [Dk, BV] slice
of the float32 state on chip over the block's rows. For each row it forms the conv (SiLU) of
its key head's q and k channels and of its value channels over the window (the slot's conv
state, then the block's inputs; the window's older inputs and the tap weights stay in
registers from row to row), g and beta, the L2 norms, advances the state and stores the
un-normed output, and keeps the row's conv inputs, conv outputs, g and beta in the slot's
stash. The next row's inputs are loaded while this row's recurrence runs, so their latency
stays off the serial path (H200, Qwen3.5-27B heads, 16 rows: 45.5 -> 28.0 us at batch 1).
The programs of the value heads sharing a key head each form its q and k (a few hundred
multiply-adds a row, against a round trip between programs); value block 0 of the key head's
first value head stashes them. The slot's states are only read. Splitting a head's value dims
over programs keeps a batch of one busy (Qwen3.5 27B: 4 x 48 programs), each with one serial
pass over the rows instead of one a block; the gated RMSNorm then needs the head's whole
output row: the head's last program to finish (an atomic counter per (sequence, value head),
reset by it) normalises all its rows. The window is held for conv kernels of up to 4 taps
(every published Gated DeltaNet uses 4).

Commit: one program per (sequence, value head, block of value dims) advances its state slice
over the accepted rows of the stash (each row loaded one row ahead) and stores it; the program
of value block 0 of each key head's first value head shifts that key head's q/k conv state,
every program its own value channels. Nothing in the launch reads what another program writes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from blockdraft.kernels.gated_deltanet_verify import (
    MAX_CONV_TAPS,
    gated_deltanet_commit_torch,
    gated_deltanet_verify_torch,
)
from blockdraft.kernels.pdl import launch_options, pdl_enabled, pdl_start
from blockdraft.kernels.triton_gated_delta_rule import _delta_step, _gate_inputs
from blockdraft.kernels.triton_gated_deltanet_step import state_block_v

__all__ = [
    "gated_deltanet_commit_torch",
    "gated_deltanet_verify_torch",
    "triton_gated_deltanet_commit",
    "triton_gated_deltanet_verify",
]


@triton.jit
def _conv_window_start(
    conv_ptr,  # this slot's conv state [K - 1, conv_dim] contiguous
    weight_ptr,  # [conv_dim, K] contiguous
    ch,  # [B] channels
    mask,  # [B]
    keep,  # scalar: read the conv state (not fresh)
    conv_dim,
    K: tl.constexpr,  # <= 4
):
    """The window before the block's first row: the conv state's last three rows p1 (newest),
    p2, p3 (zeros where K - 1 is smaller), and the K tap weights w0..w3 (float32; zeros past
    K), loaded once for every row of the block."""
    p1 = tl.load(conv_ptr + (K - 2) * conv_dim + ch, mask=mask & keep & (K >= 2), other=0.0)
    p2 = tl.load(conv_ptr + (K - 3) * conv_dim + ch, mask=mask & keep & (K >= 3), other=0.0)
    p3 = tl.load(conv_ptr + (K - 4) * conv_dim + ch, mask=mask & keep & (K >= 4), other=0.0)
    w0 = tl.load(weight_ptr + ch * K + 0, mask=mask, other=0.0).to(tl.float32)
    w1 = tl.load(weight_ptr + ch * K + 1, mask=mask & (K >= 2), other=0.0).to(tl.float32)
    w2 = tl.load(weight_ptr + ch * K + 2, mask=mask & (K >= 3), other=0.0).to(tl.float32)
    w3 = tl.load(weight_ptr + ch * K + 3, mask=mask & (K >= 4), other=0.0).to(tl.float32)
    return p1, p2, p3, w0, w1, w2, w3


@triton.jit
def _conv_of_window(
    x,  # [B] this row's inputs, the conv state's dtype
    p1,  # [B] the three inputs before it, newest first
    p2,
    p3,
    w0,  # [B] float32 tap weights, oldest input's first
    w1,
    w2,
    w3,
    out_ty: tl.constexpr,
    K: tl.constexpr,
):
    """silu(conv) over the window in float32, summed oldest input first and rounded as the
    torch twin rounds: the sum to the conv state's dtype, the SiLU's result to it and then to
    the inputs' dtype (returned in it)."""
    state_ty = x.dtype
    acc = tl.zeros(x.shape, dtype=tl.float32)
    for j in tl.static_range(K):
        if K - 1 - j == 3:
            val = p3
        elif K - 1 - j == 2:
            val = p2
        elif K - 1 - j == 1:
            val = p1
        else:
            val = x
        if j == 0:
            w = w0
        elif j == 1:
            w = w1
        elif j == 2:
            w = w2
        else:
            w = w3
        acc += val.to(tl.float32) * w
    acc = acc.to(state_ty).to(tl.float32)
    return (acc / (1.0 + tl.exp(-acc))).to(state_ty).to(out_ty)


@triton.jit
def _row_inputs(
    qkv_ptr,  # [N, conv_dim] row stride stride_qkv
    stride_qkv,
    ba_ptr,  # [N, 2 * Hv] row stride stride_ba
    stride_ba,
    rows_ptr,  # this sequence's [T] flat rows
    t,  # the step
    valid,  # scalar: the step exists (else zeros)
    q_ch,  # [BK]
    k_ch,  # [BK]
    v_ch,  # [BV]
    mask_k,
    mask_v,
    head,
    Hv,
):
    """Step t's flat row, its conv inputs on the q, k and v channels, and its b and a."""
    row = tl.load(rows_ptr + t, mask=valid, other=0)
    x_ptr = qkv_ptr + row * stride_qkv
    xq = tl.load(x_ptr + q_ch, mask=mask_k & valid, other=0.0)
    xk = tl.load(x_ptr + k_ch, mask=mask_k & valid, other=0.0)
    xv = tl.load(x_ptr + v_ch, mask=mask_v & valid, other=0.0)
    b = tl.load(ba_ptr + row * stride_ba + head, mask=valid, other=0.0)
    a = tl.load(ba_ptr + row * stride_ba + Hv + head, mask=valid, other=0.0)
    return row, xq, xk, xv, b, a


@triton.jit
def _stash_row(
    x_stash_ptr,  # this step's stash row of conv inputs [conv_dim]
    mixed_stash_ptr,  # and of conv outputs
    x,  # [B] the step's conv inputs on channels ch
    mixed,  # [B] their conv outputs
    ch,  # [B]
    mask,  # [B]
):
    tl.store(x_stash_ptr + ch, x.to(x_stash_ptr.dtype.element_ty), mask=mask)
    tl.store(mixed_stash_ptr + ch, mixed.to(mixed_stash_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _kept_row(
    mixed_ptr,  # a stash row of conv outputs [conv_dim]
    gb_ptr,  # its g (beta Hv further on), this value head's
    valid,  # scalar: the row is kept (else zeros)
    q_ch,  # [BK]
    k_ch,  # [BK]
    v_ch,  # [BV]
    mask_k,
    mask_v,
    Hv,
):
    """A kept row's q, k, v, g and beta, as the commit replays them."""
    q = tl.load(mixed_ptr + q_ch, mask=mask_k & valid, other=0.0)
    k = tl.load(mixed_ptr + k_ch, mask=mask_k & valid, other=0.0)
    v = tl.load(mixed_ptr + v_ch, mask=mask_v & valid, other=0.0)
    g = tl.load(gb_ptr, mask=valid, other=0.0)
    beta = tl.load(gb_ptr + Hv, mask=valid, other=0.0)
    return q, k, v, g, beta


@triton.jit
def _head_channels(
    head,  # value head
    block,  # block of value dims
    groups,  # Hv // Hk: value heads per key head
    Hk,
    Dk,
    Dv,
    BK: tl.constexpr,
    BV: tl.constexpr,
):
    """A program's channels: its key head's q and k channels and its value block's v channels
    (with their masks), and their offsets within a head."""
    offs_k = tl.arange(0, BK)
    mask_k = offs_k < Dk
    q_ch = (head // groups) * Dk + offs_k
    offs_v = block * BV + tl.arange(0, BV)
    mask_v = offs_v < Dv
    v_ch = 2 * Hk * Dk + head * Dv + offs_v
    return offs_k, mask_k, q_ch, Hk * Dk + q_ch, offs_v, mask_v, v_ch


@triton.jit
def _state_slice_ptrs(
    state_ptr,  # [num_slots, Hv, Dk, Dv] float32 contiguous
    slot,
    head,
    offs_k,  # [BK]
    offs_v,  # [BV]
    Hv,
    Dk,
    Dv,
):
    """[BK, BV] pointers to the program's slice of its slot's state."""
    head_ptr = state_ptr + (slot * Hv + head) * Dk * Dv
    return head_ptr + offs_k[:, None].to(tl.int64) * Dv + offs_v[None, :]


@triton.jit
def _gated_norm_rows(
    out_ptr,  # [N, Hv * Dv] contiguous: un-normed core in, gated-normed out
    z_ptr,  # [N, Hv * Dv] row stride stride_z
    norm_weight_ptr,  # [Dv]
    rows_ptr,  # this sequence's [T] flat rows
    length,
    head,
    stride_z,
    Hv,
    Dv,
    norm_eps,
    BT: tl.constexpr,
    BD: tl.constexpr,
    ROUND_PRODUCT: tl.constexpr,
):
    """`weight * rms_norm(core) * silu(z)` over the head's rows of this sequence, in place."""
    out_ty = out_ptr.dtype.element_ty
    offs_t = tl.arange(0, BT)
    mask_t = offs_t < length
    rows = tl.load(rows_ptr + offs_t, mask=mask_t, other=0)
    offs_d = tl.arange(0, BD)
    mask_d = offs_d < Dv
    mask = mask_t[:, None] & mask_d[None, :]
    ptrs = out_ptr + rows[:, None] * (Hv * Dv) + head * Dv + offs_d[None, :]
    # ".cg": the other programs' rows come from L2, never a stale L1 line.
    core = tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    rstd = tl.rsqrt(tl.sum(core * core, axis=1) / Dv + norm_eps)
    w = tl.load(norm_weight_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    y = (core * rstd[:, None]).to(out_ty).to(tl.float32) * w[None, :]
    if ROUND_PRODUCT:
        y = y.to(out_ty).to(tl.float32)
    z_ptrs = z_ptr + rows[:, None] * stride_z + head * Dv + offs_d[None, :]
    gate = tl.load(z_ptrs, mask=mask, other=0.0).to(tl.float32)
    y = y * (gate / (1.0 + tl.exp(-gate)))
    tl.debug_barrier()  # every copy of the un-normed rows is read before they are replaced
    tl.store(ptrs, y.to(out_ty), mask=mask)


@triton.jit
def _verify_program(
    slots_ptr,  # [S] int64 (-1: the last slot)
    fresh_ptr,  # [S] bool
    rows_ptr,  # [S, T] int64 contiguous
    lengths_ptr,  # [S] int64
    conv_ptr,  # [num_slots, K - 1, conv_dim] contiguous
    num_slots,
    T,
    conv_dim,
    K: tl.constexpr,
):
    """A verify program's sequence, value head and value block (its grid position), the
    sequence's slot, whether it continues (not fresh), its length, its rows and its slot's
    conv state."""
    seq = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + seq)
    slot = tl.where(slot < 0, slot + num_slots, slot)
    keep = tl.load(fresh_ptr + seq) == 0
    length = tl.load(lengths_ptr + seq)
    conv_slot_ptr = conv_ptr + slot * (K - 1) * conv_dim
    return (seq, tl.program_id(1), tl.program_id(2), slot, keep, length, rows_ptr + seq * T,
            conv_slot_ptr)  # fmt: skip


@triton.jit
def _gated_norm_when_done(
    out_ptr,  # [N, Hv * Dv] contiguous: un-normed core in, gated-normed out
    z_ptr,  # [N, Hv * Dv] row stride stride_z
    norm_weight_ptr,  # [Dv]
    counters_ptr,  # [>= S * Hv] int32 zeros; left as zeros
    rows_ptr,  # this sequence's [T] flat rows
    seq,
    length,
    head,
    stride_z,
    Hv,
    Dv,
    norm_eps,
    BT: tl.constexpr,
    BD: tl.constexpr,
    SPLIT: tl.constexpr,  # more than one value block a head
    ROUND_PRODUCT: tl.constexpr,
):
    """The gated RMSNorm of the head's rows, by the last of its value blocks' programs to
    finish storing its un-normed output (an atomic counter per (sequence, value head), reset
    by it)."""
    # Every thread's stores come before the arrival, which releases them to the last program.
    tl.debug_barrier()
    if SPLIT:
        counter = counters_ptr + seq * Hv + head
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == tl.num_programs(2) - 1:
            tl.store(counter, 0)  # ready for the next launch
            tl.debug_barrier()  # the arrival's acquire before every thread's loads
            _gated_norm_rows(out_ptr, z_ptr, norm_weight_ptr, rows_ptr, length, head,
                             stride_z, Hv, Dv, norm_eps, BT, BD, ROUND_PRODUCT)  # fmt: skip
    else:
        _gated_norm_rows(out_ptr, z_ptr, norm_weight_ptr, rows_ptr, length, head, stride_z,
                         Hv, Dv, norm_eps, BT, BD, ROUND_PRODUCT)  # fmt: skip


@triton.jit
def _gated_deltanet_verify_kernel(
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
    BT: tl.constexpr,  # T rounded up to a power of two
    BD: tl.constexpr,  # Dv rounded up to a power of two
    SPLIT: tl.constexpr,  # more than one value block a head
    ROUND_PRODUCT: tl.constexpr,  # norm weight * normed x is rounded to the output dtype
    PDL: tl.constexpr,  # launched with programmatic dependent launch (blockdraft.kernels.pdl)
):
    pdl_start(PDL)
    out_ty = out_ptr.dtype.element_ty
    conv_dim = 2 * Hk * Dk + Hv * Dv
    seq, head, block, slot, keep, length, seq_rows_ptr, conv_slot_ptr = _verify_program(
        slots_ptr, fresh_ptr, rows_ptr, lengths_ptr, conv_ptr, num_slots, T, conv_dim, K
    )

    offs_k, mask_k, q_ch, k_ch, offs_v, mask_v, v_ch = _head_channels(
        head, block, groups, Hk, Dk, Dv, BK, BV
    )
    stashes_qk = mask_k & (head % groups == 0) & (block == 0)
    state_ptrs = _state_slice_ptrs(state_ptr, slot, head, offs_k, offs_v, Hv, Dk, Dv)
    state = tl.load(state_ptrs, mask=mask_k[:, None] & mask_v[None, :] & keep, other=0.0)
    neg_a = -tl.exp(tl.load(a_log_ptr + head).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + head).to(tl.float32)

    state_ty = conv_ptr.dtype.element_ty
    in_ty = qkv_ptr.dtype.element_ty
    qp1, qp2, qp3, qw0, qw1, qw2, qw3 = _conv_window_start(conv_slot_ptr, conv_weight_ptr, q_ch,
                                                            mask_k, keep, conv_dim, K)  # fmt: skip
    kp1, kp2, kp3, kw0, kw1, kw2, kw3 = _conv_window_start(conv_slot_ptr, conv_weight_ptr, k_ch,
                                                            mask_k, keep, conv_dim, K)  # fmt: skip
    vp1, vp2, vp3, vw0, vw1, vw2, vw3 = _conv_window_start(conv_slot_ptr, conv_weight_ptr, v_ch,
                                                            mask_v, keep, conv_dim, K)  # fmt: skip
    row, xq, xk, xv, b, a = _row_inputs(qkv_ptr, stride_qkv, ba_ptr, stride_ba, seq_rows_ptr, 0,
                                        length > 0, q_ch, k_ch, v_ch, mask_k, mask_v, head,
                                        Hv)  # fmt: skip
    for t in range(0, length):
        # The next row's inputs are loaded now and used a row later: their latency hides
        # behind this row's recurrence instead of lying on the serial path.
        next_row, next_xq, next_xk, next_xv, next_b, next_a = _row_inputs(
            qkv_ptr, stride_qkv, ba_ptr, stride_ba, seq_rows_ptr, t + 1, t + 1 < length, q_ch,
            k_ch, v_ch, mask_k, mask_v, head, Hv,
        )  # fmt: skip

        sq, sk, sv = xq.to(state_ty), xk.to(state_ty), xv.to(state_ty)
        q = _conv_of_window(sq, qp1, qp2, qp3, qw0, qw1, qw2, qw3, in_ty, K)
        k = _conv_of_window(sk, kp1, kp2, kp3, kw0, kw1, kw2, kw3, in_ty, K)
        v = _conv_of_window(sv, vp1, vp2, vp3, vw0, vw1, vw2, vw3, in_ty, K)
        x_stash_ptr = stash_qkv_ptr + (slot * W + t) * conv_dim
        mixed_stash_ptr = stash_mixed_ptr + (slot * W + t) * conv_dim
        _stash_row(x_stash_ptr, mixed_stash_ptr, xq, q, q_ch, stashes_qk)
        _stash_row(x_stash_ptr, mixed_stash_ptr, xk, k, k_ch, stashes_qk)
        _stash_row(x_stash_ptr, mixed_stash_ptr, xv, v, v_ch, mask_v)

        g, beta = _gate_inputs(b, a, neg_a, dt_bias)
        gb_ptr = stash_gb_ptr + (slot * W + t) * 2 * Hv + head
        tl.store(gb_ptr, g, mask=block == 0)
        tl.store(gb_ptr + Hv, beta, mask=block == 0)

        state, core = _delta_step(
            state, q.to(tl.float32), k.to(tl.float32), v.to(tl.float32), tl.exp(g), beta,
            scale, l2_eps,
        )  # fmt: skip
        tl.store(out_ptr + row * (Hv * Dv) + head * Dv + offs_v, core.to(out_ty), mask=mask_v)

        qp3, qp2, qp1 = qp2, qp1, sq
        kp3, kp2, kp1 = kp2, kp1, sk
        vp3, vp2, vp1 = vp2, vp1, sv
        row, xq, xk, xv, b, a = next_row, next_xq, next_xk, next_xv, next_b, next_a

    _gated_norm_when_done(out_ptr, z_ptr, norm_weight_ptr, counters_ptr, seq_rows_ptr, seq,
                          length, head, stride_z, Hv, Dv, norm_eps, BT, BD, SPLIT,
                          ROUND_PRODUCT)  # fmt: skip


@triton.jit
def _commit_conv_state(
    conv_ptr,  # this slot's conv state [K - 1, conv_dim] contiguous
    stash_ptr,  # this slot's kept conv inputs [W, conv_dim] contiguous
    ch,  # [B] channels
    mask,  # [B]: the channels to shift (none: the state stays)
    length,  # rows taken
    conv_dim,
    K: tl.constexpr,
    KP: tl.constexpr,  # K - 1 rounded up to a power of two
):
    """The conv state after `length` rows: rows length .. length + K - 2 of the window (the
    conv state, then the kept inputs). Every read of the state comes before the barrier, every
    write after (rows move up)."""
    r = tl.arange(0, KP)[:, None]
    i = length + r  # window row of new row r
    in_state = i < K - 1
    live = (r < K - 1) & mask[None, :]
    old = tl.load(conv_ptr + i * conv_dim + ch[None, :], mask=live & in_state, other=0.0)
    new = tl.load(
        stash_ptr + (i - (K - 1)) * conv_dim + ch[None, :], mask=live & (i >= K - 1), other=0.0
    )
    shifted = tl.where(in_state, old, new.to(conv_ptr.dtype.element_ty))
    tl.debug_barrier()
    tl.store(conv_ptr + r * conv_dim + ch[None, :], shifted, mask=live)


@triton.jit
def _gated_deltanet_commit_kernel(
    conv_ptr,  # [(L,) num_slots, K - 1, conv_dim] contiguous
    state_ptr,  # [(L,) num_slots, Hv, Dk, Dv] float32 contiguous
    stash_qkv_ptr,  # [(L,) num_slots, W, conv_dim] contiguous
    stash_mixed_ptr,  # [(L,) num_slots, W, conv_dim] contiguous
    stash_gb_ptr,  # [(L,) num_slots, W, 2 * Hv] float32 contiguous
    slots_ptr,  # [V] int64 (-1: the last slot)
    lengths_ptr,  # [V] int64
    num_blocks,  # value-dim blocks a head: program_id(2) is layer * num_blocks + block
    layer_conv,  # elements between one layer's pools and the next's (L layers stacked)
    layer_state,
    layer_stash,
    layer_gb,
    num_slots,
    W,
    Hk,
    Hv,
    Dk,
    Dv,
    groups,  # Hv // Hk: value heads per key head
    scale,  # Dk ** -0.5, on the normalised query
    eps,
    K: tl.constexpr,
    KP: tl.constexpr,  # K - 1 rounded up to a power of two
    BK: tl.constexpr,
    BV: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    layer = (tl.program_id(2) // num_blocks).to(tl.int64)
    block = tl.program_id(2) % num_blocks
    conv_ptr += layer * layer_conv
    state_ptr += layer * layer_state
    stash_qkv_ptr += layer * layer_stash
    stash_mixed_ptr += layer * layer_stash
    stash_gb_ptr += layer * layer_gb
    conv_dim = 2 * Hk * Dk + Hv * Dv
    slot = tl.load(slots_ptr + seq)
    slot = tl.where(slot < 0, slot + num_slots, slot)
    length = tl.minimum(tl.load(lengths_ptr + seq), W)
    offs_k, mask_k, q_ch, k_ch, offs_v, mask_v, v_ch = _head_channels(
        head, block, groups, Hk, Dk, Dv, BK, BV
    )
    mask = mask_k[:, None] & mask_v[None, :]
    state_ptrs = _state_slice_ptrs(state_ptr, slot, head, offs_k, offs_v, Hv, Dk, Dv)
    state = tl.load(state_ptrs, mask=mask, other=0.0)
    mixed_ptr = stash_mixed_ptr + slot * W * conv_dim
    gb_ptr = stash_gb_ptr + slot * W * 2 * Hv + head
    taken = length > 0
    q, k, v, g, beta = _kept_row(mixed_ptr, gb_ptr, taken, q_ch, k_ch, v_ch, mask_k, mask_v, Hv)
    for t in range(0, length):
        # The next row loads now and is used a row later (see the verify kernel).
        mixed_ptr += conv_dim
        gb_ptr += 2 * Hv
        next_q, next_k, next_v, next_g, next_beta = _kept_row(
            mixed_ptr, gb_ptr, t + 1 < length, q_ch, k_ch, v_ch, mask_k, mask_v, Hv
        )
        state, _ = _delta_step(state, q.to(tl.float32), k.to(tl.float32), v.to(tl.float32),
                               tl.exp(g), beta, scale, eps)  # fmt: skip
        q, k, v, g, beta = next_q, next_k, next_v, next_g, next_beta
    tl.store(state_ptrs, state, mask=mask & taken)

    conv_slot_ptr = conv_ptr + slot * (K - 1) * conv_dim
    stash_slot_ptr = stash_qkv_ptr + slot * W * conv_dim
    shifts_qk = mask_k & taken & (head % groups == 0) & (block == 0)
    _commit_conv_state(conv_slot_ptr, stash_slot_ptr, q_ch, shifts_qk, length, conv_dim, K, KP)
    _commit_conv_state(conv_slot_ptr, stash_slot_ptr, k_ch, shifts_qk, length, conv_dim, K, KP)
    _commit_conv_state(conv_slot_ptr, stash_slot_ptr, v_ch, mask_v & taken, length, conv_dim, K, KP)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x with unit column stride (a column slice of a fused projection stays as it is)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _check_verify_shapes(rows: int, width: int, taps: int) -> None:
    if rows > width:
        raise ValueError(f"verify blocks of {rows} rows exceed the stash's {width}")
    if taps > MAX_CONV_TAPS:
        raise ValueError(
            f"the verify kernels hold conv windows of up to {MAX_CONV_TAPS} taps, not {taps}"
        )


def triton_gated_deltanet_verify(
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
    block_v: int | None = None,  # value dims of a program's state slice (default: up to 32)
) -> torch.Tensor:  # [N, Hv * Dv] qkv's dtype
    """`gated_deltanet_verify_torch` in one launch (the stash only for each sequence's first
    `lengths` rows). `counters` (zeros, left as zeros) saves an allocation per call."""
    n, conv_dim = qkv.shape
    s, t = rows.shape
    hv, dk, dv = state_pool.shape[1:]
    width = stash_qkv.shape[1]
    _check_verify_shapes(t, width, conv_weight.shape[-1])
    out = torch.empty(n, hv * dv, dtype=qkv.dtype, device=qkv.device)
    if s == 0:
        return out
    if counters is None or counters.numel() < s * hv:
        counters = torch.zeros(s * hv, dtype=torch.int32, device=qkv.device)
    bv = state_block_v(dv, block_v)
    blocks = triton.cdiv(dv, bv)
    qkv, b_a, z = _rows(qkv), _rows(b_a), _rows(z)
    round_product = torch.result_type(norm_weight, out) == out.dtype != torch.float32
    pdl = pdl_enabled(qkv.device)
    _gated_deltanet_verify_kernel[(s, hv, blocks)](
        qkv, b_a, z, conv_weight.contiguous(), a_log, dt_bias, norm_weight,
        conv_pool, state_pool, stash_qkv, stash_mixed, stash_gb,
        slots, fresh, rows.contiguous(), lengths, counters, out,
        qkv.stride(0), b_a.stride(0), z.stride(0),
        state_pool.shape[0], t, width, num_k_heads, hv, dk, dv, hv // num_k_heads, dk**-0.5,
        1e-6, norm_eps,
        K=conv_weight.shape[-1], BK=triton.next_power_of_2(dk), BV=bv,
        BT=triton.next_power_of_2(t), BD=triton.next_power_of_2(dv), SPLIT=blocks > 1,
        ROUND_PRODUCT=round_product, PDL=pdl, num_warps=4, **launch_options(pdl),
    )  # fmt: skip
    return out


def triton_gated_deltanet_commit(
    num_k_heads: int,
    conv_pool: torch.Tensor,  # [(L,) num_slots, K - 1, conv_dim] contiguous
    state_pool: torch.Tensor,  # [(L,) num_slots, Hv, Dk, Dv] float32 contiguous
    stash_qkv: torch.Tensor,  # [(L,) num_slots, W, conv_dim] contiguous
    stash_mixed: torch.Tensor,  # [(L,) num_slots, W, conv_dim] contiguous
    stash_gb: torch.Tensor,  # [(L,) num_slots, W, 2 * Hv] float32 contiguous
    slots: torch.Tensor,  # [V] int64 slots of the verified sequences (-1: the spare last)
    lengths: torch.Tensor,  # [V] int64 rows to keep (past W: W; 0: the slot stays as it is)
    block_v: int | None = None,  # value dims of a program's state slice (default: up to 32)
) -> None:
    """`gated_deltanet_commit_torch` in one launch; with a leading layer dim on every pool (L
    layers' pools stacked, `Qwen3_5LM.allocate_states`), that of every layer in one launch."""
    v = slots.shape[0]
    if v == 0:
        return
    pools = (conv_pool, state_pool, stash_qkv, stash_mixed, stash_gb)
    stacked = state_pool.dim() == 5
    if stacked and len({p.shape[0] for p in pools}) != 1:
        raise ValueError("stacked pools must hold the same number of layers")
    layers = state_pool.shape[0] if stacked else 1
    strides = [p.stride(0) if stacked else 0 for p in (conv_pool, state_pool, stash_qkv, stash_gb)]
    hv, dk, dv = state_pool.shape[-3:]
    taps = conv_pool.shape[-2] + 1
    bv = state_block_v(dv, block_v)
    blocks = triton.cdiv(dv, bv)
    _gated_deltanet_commit_kernel[(v, hv, blocks * layers)](
        conv_pool, state_pool, stash_qkv, stash_mixed, stash_gb, slots, lengths, blocks,
        *strides, state_pool.shape[-4], stash_qkv.shape[-2], num_k_heads, hv, dk, dv,
        hv // num_k_heads, dk**-0.5, 1e-6,
        K=taps, KP=triton.next_power_of_2(taps - 1), BK=triton.next_power_of_2(dk), BV=bv,
        num_warps=4,
    )  # fmt: skip
