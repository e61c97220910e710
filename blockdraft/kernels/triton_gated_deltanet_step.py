"""A Gated DeltaNet layer's whole token mixer for one-token decode rows, in one launch: from
the projected q|k|v conv inputs, b|a and the gate z to the gated-normed core that `out_proj`
reads. Each program, one per (sequence, value head), reads its slot's conv state, runs the
causal conv (SiLU) of its key head's q and k channels and of its value channels, forms g and
beta, L2-normalises q and k, advances its head's float32 state [Dk, Dv] in blocks of value
dims (each stored back as it is done; a whole 128 x 128 head at once would not fit in
registers), and normalises its head's output (RMSNorm gated by silu(z)) in a second pass over
the un-normed output it stored.

The programs of the value heads that share a key head all read that key head's q/k conv state;
the one that arrives last (an atomic counter per (sequence, key head), reset by it) shifts that
state, so none reads a state already shifted. Each program shifts its own value channels.

With few sequences (one request's decode: 32-48 programs on a GPU of 132 SMs) a head's value
dims can be split over `v_splits` programs, each advancing its own columns of the state: they
leave their sums of squares in a scratch row and arrive on a second counter (per sequence and
value head), and the last to arrive norms the whole head, summing the parts in order.

`gated_deltanet_decode_torch` (blockdraft.kernels.gated_delta_rule) is the specification: same
arguments, same roundings to the tensors' dtypes (reductions may round in a different order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from blockdraft.kernels.gated_delta_rule import gated_deltanet_decode_torch
from blockdraft.kernels.pdl import launch_options, pdl_enabled, pdl_start
from blockdraft.kernels.triton_gated_delta_rule import _gate_inputs

__all__ = ["gated_deltanet_decode_torch", "triton_gated_deltanet_decode"]


@triton.jit
def _conv_channels(
    row_ptr,  # this sequence's conv inputs [conv_dim]
    weight_ptr,  # [conv_dim, K] contiguous
    conv_ptr,  # this slot's conv state [K - 1, conv_dim] contiguous
    ch,  # [B] channels
    mask,  # [B]
    keep,  # scalar: read the conv state (not fresh)
    conv_dim,
    K: tl.constexpr,
):
    """silu(conv) of the channels (float32, rounded as the torch twin rounds: the sum to the
    conv state's dtype, the SiLU's result to it and then to the inputs' dtype)."""
    state_ty = conv_ptr.dtype.element_ty
    acc = tl.zeros(ch.shape, dtype=tl.float32)
    for j in tl.static_range(K - 1):
        x = tl.load(conv_ptr + j * conv_dim + ch, mask=mask & keep, other=0.0)
        w = tl.load(weight_ptr + ch * K + j, mask=mask, other=0.0).to(tl.float32)
        acc += x.to(tl.float32) * w
    x = tl.load(row_ptr + ch, mask=mask, other=0.0).to(state_ty)
    w = tl.load(weight_ptr + ch * K + K - 1, mask=mask, other=0.0).to(tl.float32)
    acc += x.to(tl.float32) * w
    acc = acc.to(state_ty).to(tl.float32)
    out = (acc / (1.0 + tl.exp(-acc))).to(state_ty)
    return out.to(row_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _shift_conv_state(
    row_ptr,  # this sequence's conv inputs [conv_dim]
    conv_ptr,  # this slot's conv state [K - 1, conv_dim] contiguous
    ch,  # [B] channels
    mask,  # [B]
    keep,  # scalar: the conv state holds inputs (not fresh)
    conv_dim,
    K: tl.constexpr,
    KP: tl.constexpr,  # K - 1 rounded up to a power of two
):
    """The conv state after this input: its last K - 2 rows moved up, the input appended (a
    fresh sequence's zeros stay zeros). Threads holding copies of a channel each read it, so
    every read of the state (the conv's too) comes before the barrier, every write after."""
    rows = tl.arange(0, KP)[:, None]
    ptrs = conv_ptr + rows * conv_dim + ch[None, :]
    shifted = tl.load(ptrs + conv_dim, mask=(rows < K - 2) & mask[None, :] & keep, other=0.0)
    x = tl.load(row_ptr + ch, mask=mask, other=0.0).to(conv_ptr.dtype.element_ty)
    shifted = tl.where(rows == K - 2, x[None, :], shifted)
    tl.debug_barrier()
    tl.store(ptrs, shifted, mask=(rows < K - 1) & mask[None, :])


@triton.jit
def _norm_head(
    out_head_ptr,  # [Dv] the head's un-normed output, normed in place
    norm_weight_ptr,  # [Dv]
    gate_ptr,  # [Dv] the head's z
    sum_sq,  # fp32: the head's sum of squares
    Dv,
    norm_eps,
    BV: tl.constexpr,
    ROUND_PRODUCT: tl.constexpr,
):
    """RMSNorm of the head's output gated by silu(z), in place (rounded as the twin rounds)."""
    out_ty = out_head_ptr.dtype.element_ty
    rstd = tl.rsqrt(sum_sq / Dv + norm_eps)
    for v0 in range(0, Dv, BV):
        offs_v = v0 + tl.arange(0, BV)
        mask_v = offs_v < Dv
        core = tl.load(out_head_ptr + offs_v, mask=mask_v, other=0.0).to(tl.float32)
        w = tl.load(norm_weight_ptr + offs_v, mask=mask_v, other=0.0).to(tl.float32)
        y = (core * rstd).to(out_ty).to(tl.float32) * w
        if ROUND_PRODUCT:
            y = y.to(out_ty).to(tl.float32)
        gate = tl.load(gate_ptr + offs_v, mask=mask_v, other=0.0)
        gate = gate.to(tl.float32)
        y = y * (gate / (1.0 + tl.exp(-gate)))
        tl.debug_barrier()  # every copy of the un-normed block is read before it is replaced
        tl.store(out_head_ptr + offs_v, y.to(out_ty), mask=mask_v)


@triton.jit
def _gated_deltanet_decode_kernel(
    qkv_ptr,  # [S, conv_dim] row stride stride_qkv: q | k | v channels
    ba_ptr,  # [S, 2 * Hv] row stride stride_ba: b then a
    z_ptr,  # [S, Hv * Dv] row stride stride_z
    conv_weight_ptr,  # [conv_dim, K] contiguous
    a_log_ptr,  # [Hv]
    dt_bias_ptr,  # [Hv]
    norm_weight_ptr,  # [Dv]
    conv_ptr,  # [num_slots, K - 1, conv_dim] contiguous
    state_ptr,  # [num_slots, Hv, Dk, Dv] float32 contiguous
    slots_ptr,  # [S] int64 (-1: the last slot)
    fresh_ptr,  # [S] bool
    counters_ptr,  # [>= S * Hk (+ S * Hv with V_SPLITS > 1)] int32 zeros; left as zeros
    partial_ptr,  # [S * Hv * V_SPLITS] float32: each part's sum of squares (V_SPLITS > 1)
    out_ptr,  # [S, Hv * Dv] contiguous, qkv's dtype
    stride_qkv,
    stride_ba,
    stride_z,
    num_slots,
    Hk,
    Hv,
    Dk,
    Dv,
    groups,  # Hv // Hk: value heads per key head
    scale,  # Dk ** -0.5, on the normalised query
    l2_eps,
    norm_eps,
    K: tl.constexpr,
    KP: tl.constexpr,  # K - 1 rounded up to a power of two
    BK: tl.constexpr,
    BV: tl.constexpr,
    ROUND_PRODUCT: tl.constexpr,  # norm weight * normed x is rounded to the output dtype
    V_SPLITS: tl.constexpr,  # programs a value head's dims are split over
    PDL: tl.constexpr,  # launched with programmatic dependent launch (blockdraft.kernels.pdl)
):
    pdl_start(PDL)
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    part = tl.program_id(2)
    k_head = head // groups
    out_ty = out_ptr.dtype.element_ty
    conv_dim = 2 * Hk * Dk + Hv * Dv
    slot = tl.load(slots_ptr + seq)
    slot = tl.where(slot < 0, slot + num_slots, slot)
    keep = tl.load(fresh_ptr + seq) == 0
    row_ptr = qkv_ptr + seq * stride_qkv
    conv_slot_ptr = conv_ptr + slot * (K - 1) * conv_dim

    offs_k = tl.arange(0, BK)
    mask_k = offs_k < Dk
    q_ch = k_head * Dk + offs_k
    k_ch = Hk * Dk + q_ch
    q = _conv_channels(row_ptr, conv_weight_ptr, conv_slot_ptr, q_ch, mask_k, keep, conv_dim, K)
    k = _conv_channels(row_ptr, conv_weight_ptr, conv_slot_ptr, k_ch, mask_k, keep, conv_dim, K)
    # The reductions need every thread's loads of the q/k conv state done; the barrier then
    # puts all of them before the arrival, which releases them to the GPU.
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + l2_eps) * scale
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + l2_eps)
    tl.debug_barrier()
    counter = counters_ptr + seq * Hk + k_head
    if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == groups * V_SPLITS - 1:
        tl.store(counter, 0)  # ready for the next launch
        _shift_conv_state(row_ptr, conv_slot_ptr, q_ch, mask_k, keep, conv_dim, K, KP)
        _shift_conv_state(row_ptr, conv_slot_ptr, k_ch, mask_k, keep, conv_dim, K, KP)

    b = tl.load(ba_ptr + seq * stride_ba + head)
    a = tl.load(ba_ptr + seq * stride_ba + Hv + head)
    dt_bias = tl.load(dt_bias_ptr + head).to(tl.float32)
    g, beta = _gate_inputs(b, a, -tl.exp(tl.load(a_log_ptr + head).to(tl.float32)), dt_bias)
    decay = tl.exp(g)

    state_head_ptr = state_ptr + (slot * Hv + head) * Dk * Dv
    out_head_ptr = out_ptr + (seq * Hv + head) * Dv
    # This program's value dims: whole blocks of BV, the last part's cut at Dv.
    part_len = tl.cdiv(tl.cdiv(Dv, BV), V_SPLITS) * BV
    v_start = part * part_len
    v_stop = tl.minimum(v_start + part_len, Dv)
    sum_sq = 0.0
    for v0 in range(v_start, v_stop, BV):
        offs_v = v0 + tl.arange(0, BV)
        mask_v = offs_v < v_stop
        mask = mask_k[:, None] & mask_v[None, :]
        state_ptrs = state_head_ptr + offs_k[:, None].to(tl.int64) * Dv + offs_v[None, :]
        state = tl.load(state_ptrs, mask=mask & keep, other=0.0)  # in flight over the shift
        v_ch = 2 * Hk * Dk + head * Dv + offs_v
        v = _conv_channels(row_ptr, conv_weight_ptr, conv_slot_ptr, v_ch, mask_v, keep, conv_dim, K)
        _shift_conv_state(row_ptr, conv_slot_ptr, v_ch, mask_v, keep, conv_dim, K, KP)
        state = state * decay
        predicted = tl.sum(state * k[:, None], axis=0)  # [BV]: what the state recalls for k
        delta = (v - predicted) * beta
        state = state + k[:, None] * delta[None, :]
        tl.debug_barrier()  # (small blocks: copies of the state block are all read first)
        tl.store(state_ptrs, state, mask=mask)
        core = tl.sum(state * q[:, None], axis=0).to(out_ty)
        tl.store(out_head_ptr + offs_v, core, mask=mask_v)
        core = core.to(tl.float32)
        sum_sq += tl.sum(tl.where(mask_v, core * core, 0.0), axis=0)
    # The second pass reads the un-normed output that other threads of the program stored
    # (with V_SPLITS > 1, other programs too: the last of the head's parts to arrive runs it,
    # over the sums of squares in part order).
    tl.debug_barrier()
    last = True
    if V_SPLITS > 1:
        partials = partial_ptr + (seq * Hv + head) * V_SPLITS
        tl.store(partials + part, sum_sq)
        tl.debug_barrier()
        arrived = counters_ptr + (tl.num_programs(0) * Hk + seq * Hv + head)
        last = tl.atomic_add(arrived, 1, sem="acq_rel", scope="gpu") == V_SPLITS - 1
        if last:
            tl.store(arrived, 0)  # ready for the next launch
            sum_sq = 0.0
            for p in tl.static_range(V_SPLITS):
                sum_sq += tl.load(partials + p, volatile=True)
    if last:
        _norm_head(out_head_ptr, norm_weight_ptr, z_ptr + seq * stride_z + head * Dv, sum_sq,
                   Dv, norm_eps, BV, ROUND_PRODUCT)  # fmt: skip


def state_block_v(dv: int, block_v: int | None = None) -> int:
    """Value dims of a state block (the decode, verify and commit kernels' programs): `block_v`,
    else up to 32. Blocks of 32 value dims (4 warps), as the recurrence kernel: on sm_90 whole
    128-dim heads spill heavily (8 warps: 15 KB of spill stores a program; 32 dims: 96 bytes).
    A decode's head splits over at most cdiv(dv, this) programs."""
    return block_v or min(triton.next_power_of_2(dv), 32)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x with unit column stride (a column slice of a fused projection stays as it is)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def triton_gated_deltanet_decode(
    qkv: torch.Tensor,  # [S, conv_dim] conv inputs, one row a sequence: q | k | v channels
    b_a: torch.Tensor,  # [S, 2 * Hv]: b then a
    z: torch.Tensor,  # [S, Hv * Dv] output gate
    conv_weight: torch.Tensor,  # [conv_dim, K] depthwise taps
    a_log: torch.Tensor,  # [Hv]
    dt_bias: torch.Tensor,  # [Hv]
    norm_weight: torch.Tensor,  # [Dv]
    norm_eps: float,
    num_k_heads: int,
    conv_pool: torch.Tensor,  # [num_slots, K - 1, conv_dim] contiguous
    state_pool: torch.Tensor,  # [num_slots, Hv, Dk, Dv] float32 contiguous
    slots: torch.Tensor,  # [S] int64 each sequence's slot (-1: the spare last)
    fresh: torch.Tensor,  # [S] bool: start from zero states
    counters: torch.Tensor | None = None,  # [>= S * (Hk + Hv)] int32 zeros, kept between launches
    block_v: int | None = None,  # value dims of a program's state block (default: up to 32)
    v_splits: int | None = None,  # programs each value head's dims are split over
    fill_programs: int = 0,  # v_splits None: split until the launch has about this many
) -> torch.Tensor:  # [S, Hv * Dv] qkv's dtype
    """`gated_deltanet_decode_torch` in one launch. `counters` (zeros, left as zeros) saves an
    allocation per call. `v_splits` > 1 spreads a head's value dims over that many programs
    (more programs for few sequences; the last of a head's parts to finish norms the head);
    None: as many as bring the S * Hv programs up to `fill_programs` (0: no split)."""
    s, conv_dim = qkv.shape
    hv, dv = b_a.shape[-1] // 2, norm_weight.shape[0]
    hk, k_taps = num_k_heads, conv_weight.shape[-1]
    dk = (conv_dim - hv * dv) // (2 * hk)
    out = torch.empty(s, hv * dv, dtype=qkv.dtype, device=qkv.device)
    if s == 0:
        return out
    bk = triton.next_power_of_2(dk)
    bv = state_block_v(dv, block_v)
    blocks = triton.cdiv(dv, bv)
    if v_splits is None:
        v_splits = max(1, min(blocks, fill_programs // (s * hv)))
    if not 1 <= v_splits <= blocks:
        raise ValueError(f"v_splits {v_splits} must be in [1, {blocks}] (value blocks of {bv})")
    need = s * hk + (s * hv if v_splits > 1 else 0)
    if counters is None or counters.numel() < need:
        counters = torch.zeros(need, dtype=torch.int32, device=qkv.device)
    partial = out  # unread with one part
    if v_splits > 1:
        partial = torch.empty(s * hv * v_splits, dtype=torch.float32, device=qkv.device)
    qkv, b_a, z = _rows(qkv), _rows(b_a), _rows(z)
    round_product = torch.result_type(norm_weight, out) == out.dtype != torch.float32
    pdl = pdl_enabled(qkv.device)
    _gated_deltanet_decode_kernel[(s, hv, v_splits)](
        qkv, b_a, z, conv_weight.contiguous(), a_log, dt_bias, norm_weight,
        conv_pool, state_pool, slots, fresh, counters, partial, out,
        qkv.stride(0), b_a.stride(0), z.stride(0),
        state_pool.shape[0], hk, hv, dk, dv, hv // hk, dk**-0.5, 1e-6, norm_eps,
        K=k_taps, KP=triton.next_power_of_2(k_taps - 1), BK=bk, BV=bv,
        ROUND_PRODUCT=round_product, V_SPLITS=v_splits,
        PDL=pdl, num_warps=4, **launch_options(pdl),
    )  # fmt: skip
    return out
