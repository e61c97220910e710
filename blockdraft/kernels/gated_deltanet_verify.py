"""Pure-torch twins of a Gated DeltaNet layer's verify forward and of the commit after it, the
specifications of the one-launch Triton kernels (`triton_gated_deltanet_verify`).

A verify forward runs S verify blocks (every sequence of the forward one; padded [S, T] rows
with per-sequence lengths, as `StepBatch` gives them) through the layer's token mixer from
their slots' states without storing those: the causal conv (SiLU) over the slot's conv state
then the block's inputs, g and beta, the recurrence, the per-head gated RMSNorm. It keeps
what the commit needs in the slot's stash: the conv inputs (to shift the conv state), the conv
outputs (the recurrence's q, k and v) and g and beta. Once the step knows how many rows each
block accepted, the commit advances the slot's recurrent state over those rows of the stash
and shifts its conv state: the states that decoding the rows one by one reaches, bit for bit
(the recurrence's arithmetic never depends on a row's batch mates).

`gated_deltanet_verify_torch` computes what `GatedDeltaNet`'s step path computes for such a
forward, in the same order (the tests hold them equal bit for bit);
`gated_deltanet_commit_torch` is the layer's commit, with the recurrence's backend as an
argument.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from blockdraft.kernels.gated_delta_rule import (
    causal_conv1d_torch,
    gate_inputs_torch,
    recurrent_gated_delta_rule_pool_torch,
    rms_norm_gated_torch,
    split_heads,
    store_conv_state_torch,
)

# The longest conv the Triton verify kernel takes (it holds the window in registers); layers
# with longer ones verify through their torch steps.
MAX_CONV_TAPS = 4
# The widest verify block the chunked Triton form takes (a published drafter's block, 1 + 15
# drafts); wider ones take the row kernel (`triton_gated_deltanet_verify_chunk`: why).
MAX_CHUNK_ROWS = 16


def gated_deltanet_verify_torch(
    qkv: torch.Tensor,  # [N, conv_dim] the forward's conv inputs: q | k | v channels
    b_a: torch.Tensor,  # [N, 2 * Hv]: b then a
    z: torch.Tensor,  # [N, Hv * Dv] output gate
    conv_weight: torch.Tensor,  # [conv_dim, K] depthwise taps
    a_log: torch.Tensor,  # [Hv]
    dt_bias: torch.Tensor,  # [Hv]
    norm_weight: torch.Tensor,  # [Dv]
    norm_eps: float,
    num_k_heads: int,
    conv_pool: torch.Tensor,  # [num_slots, K - 1, conv_dim] per-request conv states
    state_pool: torch.Tensor,  # [num_slots, Hv, Dk, Dv] float32 per-request states
    stash_qkv: torch.Tensor,  # [num_slots, W, conv_dim] kept conv inputs
    stash_mixed: torch.Tensor,  # [num_slots, W, conv_dim] kept conv outputs
    stash_gb: torch.Tensor,  # [num_slots, W, 2 * Hv] float32 kept g, then beta
    slots: torch.Tensor,  # [S] int64 each sequence's slot (-1: the spare last)
    fresh: torch.Tensor,  # [S] bool: start from zero states (the slot is not read)
    rows: torch.Tensor,  # [S, T] int64 flat row of each step; past a sequence's length, its last
    lengths: torch.Tensor,  # [S] int64 rows of each sequence (T >= each >= 1)
) -> torch.Tensor:  # [N, Hv * Dv] qkv's dtype: the gated-normed core, out_proj's input
    """S verify blocks through the token mixer from their slots' states, which stay as they
    were; rows 0..T-1 of each slot's stash hold the block's conv inputs, conv outputs, g and
    beta (padded rows repeat the last)."""
    num_v_heads, k_head_dim = state_pool.shape[1:3]
    width = rows.shape[1]
    if width > stash_qkv.shape[1]:
        raise ValueError(f"verify blocks of {width} rows exceed the stash's {stash_qkv.shape[1]}")
    conv_old = conv_pool[slots]
    keep = ~fresh[:, None, None]
    x = qkv[rows]  # [S, T, conv_dim]
    window = torch.cat((torch.where(keep, conv_old, 0), x.to(conv_old.dtype)), dim=1)
    mixed = causal_conv1d_torch(window, conv_weight).to(qkv.dtype)  # [S, T, conv_dim]
    g, beta = gate_inputs_torch(b_a[rows], a_log, dt_bias)
    stash_qkv[slots, :width] = x.to(stash_qkv.dtype)
    stash_mixed[slots, :width] = mixed.to(stash_mixed.dtype)
    stash_gb[slots, :width] = torch.cat((g, beta.float()), -1)
    q, k, v = split_heads(mixed, num_k_heads, k_head_dim, num_v_heads)
    never = torch.zeros_like(fresh)
    core = recurrent_gated_delta_rule_pool_torch(
        q, k, v, g, beta, state_pool, slots, fresh, lengths, never
    )  # [S, T, Hv, Dv]
    real = torch.arange(width, device=rows.device)[None, :] < lengths[:, None]
    out = core.new_empty(qkv.shape[0], *core.shape[2:])
    out[rows[real]] = core[real]
    return rms_norm_gated_torch(out, z.reshape(out.shape), norm_weight, norm_eps).flatten(1)


def gated_deltanet_commit_torch(
    num_k_heads: int,
    conv_pool: torch.Tensor,  # [num_slots, K - 1, conv_dim] per-request conv states
    state_pool: torch.Tensor,  # [num_slots, Hv, Dk, Dv] float32 per-request states
    stash_qkv: torch.Tensor,  # [num_slots, W, conv_dim] kept conv inputs
    stash_mixed: torch.Tensor,  # [num_slots, W, conv_dim] kept conv outputs
    stash_gb: torch.Tensor,  # [num_slots, W, 2 * Hv] float32 kept g, then beta
    slots: torch.Tensor,  # [V] int64 slots of the verified sequences (-1: the spare last)
    lengths: torch.Tensor,  # [V] int64 rows to keep (past W: W; 0: the slot stays as it is)
    recurrence: Callable[..., torch.Tensor] = recurrent_gated_delta_rule_pool_torch,
) -> None:
    """Advances each slot's states over the first `lengths` rows of its stash, as decoding
    them would have: the recurrent state by the recurrence, the conv state shifted. Both
    continue from what the slot holds, the states the verify started from (a verify block
    never starts a request, so the slot is not fresh)."""
    num_v_heads, k_head_dim = state_pool.shape[1:3]
    lengths = lengths.clamp(max=stash_qkv.shape[1])
    write = torch.ones_like(slots, dtype=torch.bool)
    q, k, v = split_heads(stash_mixed[slots], num_k_heads, k_head_dim, num_v_heads)
    g, beta = stash_gb[slots].split(num_v_heads, dim=-1)
    recurrence(q, k, v, g, beta, state_pool, slots, ~write, lengths, write)
    conv_old = conv_pool[slots]
    window = torch.cat((conv_old, stash_qkv[slots]), 1)
    store_conv_state_torch(conv_pool, window, conv_old, slots, lengths, write)
