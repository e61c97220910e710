"""The gated delta rule's recurrence (decode steps, verify blocks, state commits) in one launch:
one program per (sequence, value head, block of value dims) holds its [Dk, BV] slice of the
float32 state on chip across the sequence's T tokens, reads it from the request's slot once and
writes it back once. q and k are L2-normalised in the kernel.

`recurrent_gated_delta_rule_pool_torch` (blockdraft.kernels.gated_delta_rule) is the
specification: same arguments, same per-token arithmetic in float32 (reductions may round in a
different order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from blockdraft.kernels.gated_delta_rule import recurrent_gated_delta_rule_pool_torch
from blockdraft.kernels.triton_jit_options import unspecialised

__all__ = ["recurrent_gated_delta_rule_pool_torch", "triton_recurrent_gated_delta_rule"]


@triton.jit
def _gate_inputs(
    b,  # a step's b (or [BT] steps'), the projection's dtype
    a,  # and a
    neg_a,  # float32 -exp(A_log) of the head
    dt_bias,  # float32
):
    """(g, beta) in float32: the log decay and the sigmoid of b rounded to b's dtype."""
    beta = (1.0 / (1.0 + tl.exp(-b.to(tl.float32)))).to(b.dtype).to(tl.float32)
    a_f = a.to(tl.float32) + dt_bias
    return neg_a * tl.where(a_f > 20.0, a_f, tl.log(1.0 + tl.exp(a_f))), beta


@triton.jit
def _delta_step(
    state,  # [BK, BV] float32
    q,  # [BK] float32, not yet normalised
    k,  # [BK]
    v,  # [BV] float32
    decay,
    beta,
    scale,
    eps,
):
    """One token of the gated delta rule on a state slice: (new state, output [BV])."""
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + eps) * scale
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + eps)
    state = state * decay
    predicted = tl.sum(state * k[:, None], axis=0)  # [BV]: what the state recalls for k
    delta = (v - predicted) * beta
    state = state + k[:, None] * delta[None, :]
    return state, tl.sum(state * q[:, None], axis=0)


# A step's width (1 for decode rows, 1 + N for verify blocks) varies with the batch, and the
# per-sequence index tensors are read element by element: one compile for all of them.
@triton.jit(**unspecialised(["T"], ["slots_ptr", "fresh_ptr", "lengths_ptr", "write_ptr"]))
def _gated_delta_rule_recurrent_kernel(
    q_ptr,  # [S, T, Hk, Dk] contiguous
    k_ptr,  # [S, T, Hk, Dk] contiguous
    v_ptr,  # [S, T, Hv, Dv] contiguous
    g_ptr,  # [S, T, Hv] float32 contiguous
    beta_ptr,  # [S, T, Hv] contiguous
    out_ptr,  # [S, T, Hv, Dv] float32
    state_ptr,  # [num_slots, Hv, Dk, Dv] float32
    slots_ptr,  # [S] int64, in range
    fresh_ptr,  # [S] int8
    lengths_ptr,  # [S] int64
    write_ptr,  # [S] int8
    T,
    Hk,
    Hv,
    Dk,
    Dv,
    groups,  # Hv // Hk: value heads per key head
    scale,  # Dk ** -0.5, on the normalised query
    eps,
    BK: tl.constexpr,
    BV: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_k = tl.arange(0, BK)
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
    mask_k, mask_v = offs_k < Dk, offs_v < Dv
    mask = mask_k[:, None] & mask_v[None, :]
    slot = tl.load(slots_ptr + seq)
    fresh = tl.load(fresh_ptr + seq)
    length = tl.load(lengths_ptr + seq)
    state_ptrs = (
        state_ptr
        + (slot * Hv + head) * Dk * Dv
        + offs_k[:, None].to(tl.int64) * Dv
        + offs_v[None, :]
    )
    state = tl.load(state_ptrs, mask=mask & (fresh == 0), other=0.0)
    k_head = head // groups
    for t in range(0, T):
        row = seq * T + t
        qk_offs = (row * Hk + k_head) * Dk + offs_k
        q = tl.load(q_ptr + qk_offs, mask=mask_k, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + qk_offs, mask=mask_k, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + (row * Hv + head) * Dv + offs_v, mask=mask_v, other=0.0)
        decay = tl.exp(tl.load(g_ptr + row * Hv + head).to(tl.float32))
        beta = tl.load(beta_ptr + row * Hv + head).to(tl.float32)
        new, out = _delta_step(state, q, k, v.to(tl.float32), decay, beta, scale, eps)
        tl.store(out_ptr + (row * Hv + head) * Dv + offs_v, out, mask=mask_v)
        state = tl.where(t < length, new, state)
    if tl.load(write_ptr + seq) != 0:
        tl.store(state_ptrs, state, mask=mask)


def triton_recurrent_gated_delta_rule(
    query: torch.Tensor,  # [S, T, Hk, Dk]
    key: torch.Tensor,  # [S, T, Hk, Dk]
    value: torch.Tensor,  # [S, T, Hv, Dv]
    g: torch.Tensor,  # [S, T, Hv] float32 log decay (<= 0)
    beta: torch.Tensor,  # [S, T, Hv]
    state_pool: torch.Tensor,  # [num_slots, Hv, Dk, Dv] float32, contiguous
    slots: torch.Tensor,  # [S] int64 each sequence's slot (-1: the last)
    fresh: torch.Tensor,  # [S] bool: start from a zero state
    lengths: torch.Tensor,  # [S] int64 tokens each sequence takes
    write: torch.Tensor,  # [S] bool: store the state it reaches in its slot
) -> torch.Tensor:  # [S, T, Hv, Dv], value's dtype
    s, t, hk, dk = key.shape
    hv, dv = value.shape[2:]
    out = torch.empty(s, t, hv, dv, dtype=torch.float32, device=value.device)
    if s == 0 or t == 0:
        return out.to(value.dtype)
    bv = min(triton.next_power_of_2(dv), 32)
    grid = (s, hv, triton.cdiv(dv, bv))
    _gated_delta_rule_recurrent_kernel[grid](
        query.contiguous(), key.contiguous(), value.contiguous(), g.float().contiguous(),
        beta.contiguous(), out, state_pool, slots % state_pool.shape[0],
        fresh.to(torch.int8), lengths, write.to(torch.int8),
        t, hk, hv, dk, dv, hv // hk, dk**-0.5, 1e-6,
        BK=triton.next_power_of_2(dk), BV=bv,
    )  # fmt: skip
    return out.to(value.dtype)
