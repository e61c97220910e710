"""Pure-torch kernels of Gated DeltaNet (the `linear_attention` layers of Qwen3.5 / Qwen3-Next):
the causal depthwise convolution over a window that starts with the request's conv state, and
the gated delta rule, as a recurrence (decode, verify, state commits) and in its chunked form
(prefill).

Per value head the rule keeps a float32 state S [k_dim, v_dim]; for each token
`S = exp(g) S;  S += k (beta (v - S^T k))^T;  o = S^T q` with q, k L2-normalised and q scaled
by k_dim^-0.5. The recurrence runs over padded [B, T] batches with per-row lengths: steps past
a row's length leave its state as it was, so one call advances requests by different numbers
of tokens and a step's arithmetic never depends on its batch mates (a verify's state at any
accepted length is bit for bit the one plain decoding reaches). The recurrence over the
engine's state slots (`recurrent_gated_delta_rule_pool_torch`) has a Triton twin
(`triton_gated_delta_rule`); so has the chunked form over packed variable-length sequences,
a prefill step's chunks in one call (`chunk_gated_delta_rule_varlen_torch`,
`triton_chunk_gated_delta_rule`). A decode step's whole token mixer between the input and
output projections (conv, gates, recurrence, gated norm: `gated_deltanet_decode_torch`) has a
one-launch Triton twin (`triton_gated_deltanet_step`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

# A multiple of the stride of torch's CPU vector loops (two 16-float AVX-512 vectors).
_LANES = 64


def lanewise(
    fn: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,  # [..., D]
) -> torch.Tensor:  # fn(x) [..., D]
    """`fn(x)` with each row padded to whole vector strides, so that on the CPU every element
    takes the SIMD path: torch rounds sigmoid, softplus and SiLU differently in its scalar
    tail loop, which would make a row's result depend on the size of its batch."""
    if x.device.type != "cpu":
        return fn(x)
    d = x.shape[-1]
    return fn(F.pad(x, (0, (-d) % _LANES)))[..., :d]


def causal_conv1d_torch(
    window: torch.Tensor,  # [B, K - 1 + T, C]: the conv state (last K - 1 inputs), then T new
    weight: torch.Tensor,  # [C, K] depthwise taps
) -> torch.Tensor:  # [B, T, C] silu(conv) of the T new inputs, window's dtype
    """Depthwise causal convolution with SiLU, as a sum over the K taps in a fixed order
    (elementwise, so a row's output does not depend on the batch it runs in), accumulated in
    float32 and rounded to the window's dtype before the SiLU, as a half-precision conv1d."""
    k = weight.shape[1]
    t = window.shape[1] - (k - 1)
    x, w = window.float(), weight.float()
    out = x[:, 0:t] * w[:, 0]
    for j in range(1, k):
        out = out + x[:, j : j + t] * w[:, j]
    return lanewise(F.silu, out.to(window.dtype))


def split_heads(
    mixed: torch.Tensor,  # [S, T, conv_dim] conv outputs: q | k | v channels
    num_k_heads: int,
    k_head_dim: int,
    num_v_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # q, k [S, T, Hk, Dk], v [S, T, Hv, Dv]
    s, t = mixed.shape[:2]
    key_dim = num_k_heads * k_head_dim
    q, k, v = mixed.split((key_dim, key_dim, mixed.shape[-1] - 2 * key_dim), dim=-1)
    heads = (s, t, num_k_heads, k_head_dim)
    return q.reshape(heads), k.reshape(heads), v.reshape(s, t, num_v_heads, -1)


def store_conv_state_torch(
    conv_pool: torch.Tensor,  # [num_slots, K - 1, conv_dim] per-request conv states
    window: torch.Tensor,  # [S, K - 1 + T, conv_dim] each slot's conv state, then T inputs
    conv_old: torch.Tensor,  # [S, K - 1, conv_dim] the slots' conv states
    slots: torch.Tensor,  # [S] int64
    lengths: torch.Tensor,  # [S] int64 inputs each sequence took
    write: torch.Tensor,  # [S] bool
) -> None:
    """The conv state after each sequence's rows (the last K - 1 inputs of its window) into
    the slots that `write`."""
    kept = conv_pool.shape[1]
    idx = lengths[:, None] + torch.arange(kept, device=window.device)[None, :]
    conv_new = window.gather(1, idx[..., None].expand(-1, -1, window.shape[-1]))
    conv_pool[slots] = torch.where(write[:, None, None], conv_new, conv_old)


def gate_inputs_torch(
    b_a: torch.Tensor,  # [..., 2 * Hv]: b then a
    a_log: torch.Tensor,  # [Hv]
    dt_bias: torch.Tensor,  # [Hv]
) -> tuple[torch.Tensor, torch.Tensor]:  # g [..., Hv] float32 log decay, beta [..., Hv] b's dtype
    """`g = -exp(A_log) softplus(a + dt_bias)` (float32) and `beta = sigmoid(b)`."""
    b, a = b_a.split(b_a.shape[-1] // 2, dim=-1)
    beta = lanewise(torch.sigmoid, b)
    g = -a_log.float().exp() * lanewise(F.softplus, a.float() + dt_bias)
    return g, beta


def rms_norm_gated_torch(
    x: torch.Tensor,  # [..., D]
    gate: torch.Tensor,  # [..., D]
    weight: torch.Tensor,  # [D]
    eps: float,
) -> torch.Tensor:  # [..., D], x's dtype
    """`weight * rms_norm(x) * silu(gate)`: normalised in float32, rounded back to x's dtype
    before the weight, gated in float32 (transformers' `Qwen3_5RMSNormGated`)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * x32.to(x.dtype)
    return (out * F.silu(gate.float())).to(x.dtype)


def l2norm_torch(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:  # [..., D] float32
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(
    query: torch.Tensor,  # [B, T, Hk, Dk]
    key: torch.Tensor,  # [B, T, Hk, Dk]
    value: torch.Tensor,  # [B, T, Hv, Dv]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # float32 [B, T, Hv, D] each
    """q and k L2-normalised in float32 (q also scaled by Dk^-0.5), each key head repeated for
    the Hv / Hk consecutive value heads it serves."""
    groups = value.shape[2] // key.shape[2]
    q = l2norm_torch(query.float()) * query.shape[-1] ** -0.5
    k = l2norm_torch(key.float())
    if groups > 1:
        q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
    return q, k, value.float()


def recurrent_gated_delta_rule_torch(
    query: torch.Tensor,  # [B, T, Hk, Dk]
    key: torch.Tensor,  # [B, T, Hk, Dk]
    value: torch.Tensor,  # [B, T, Hv, Dv]
    g: torch.Tensor,  # [B, T, Hv] float32 log decay (<= 0)
    beta: torch.Tensor,  # [B, T, Hv]
    state: torch.Tensor,  # [B, Hv, Dk, Dv] float32, the state before the first token
    lengths: torch.Tensor | None = None,  # [B] int64 tokens to take per row; None: all T
) -> tuple[torch.Tensor, torch.Tensor]:  # out [B, T, Hv, Dv] value's dtype, state [B, Hv, Dk, Dv]
    """The rule token by token; rows stop advancing their state at their length (their outputs
    past it are computed from the held state and mean nothing)."""
    q, k, v = _prepare(query, key, value)
    decay, b = g.float().exp(), beta.float()
    out = torch.empty_like(v)
    for t in range(q.shape[1]):
        s = state * decay[:, t, :, None, None]
        kv_mem = (s * k[:, t, :, :, None]).sum(dim=-2)  # [B, Hv, Dv]
        delta = (v[:, t] - kv_mem) * b[:, t, :, None]
        s = s + k[:, t, :, :, None] * delta[:, :, None, :]
        out[:, t] = (s * q[:, t, :, :, None]).sum(dim=-2)
        if lengths is None:
            state = s
        else:
            state = torch.where((t < lengths)[:, None, None, None], s, state)
    return out.to(value.dtype), state


def recurrent_gated_delta_rule_pool_torch(
    query: torch.Tensor,  # [S, T, Hk, Dk]
    key: torch.Tensor,  # [S, T, Hk, Dk]
    value: torch.Tensor,  # [S, T, Hv, Dv]
    g: torch.Tensor,  # [S, T, Hv] float32 log decay (<= 0)
    beta: torch.Tensor,  # [S, T, Hv]
    state_pool: torch.Tensor,  # [num_slots, Hv, Dk, Dv] float32, per-request states
    slots: torch.Tensor,  # [S] int64 each sequence's slot
    fresh: torch.Tensor,  # [S] bool: start from a zero state (the slot is not read)
    lengths: torch.Tensor,  # [S] int64 tokens each sequence takes
    write: torch.Tensor,  # [S] bool: store the state it reaches in its slot
) -> torch.Tensor:  # [S, T, Hv, Dv], value's dtype
    """`recurrent_gated_delta_rule_torch` from and into the slots of a state pool: the decode
    and verify step of the engine (the Triton kernel's specification)."""
    state0 = torch.where(fresh[:, None, None, None], 0, state_pool[slots])
    out, state = recurrent_gated_delta_rule_torch(query, key, value, g, beta, state0, lengths)
    state_pool[slots] = torch.where(write[:, None, None, None], state, state_pool[slots])
    return out


def chunk_gated_delta_rule_torch(
    query: torch.Tensor,  # [B, T, Hk, Dk]
    key: torch.Tensor,  # [B, T, Hk, Dk]
    value: torch.Tensor,  # [B, T, Hv, Dv]
    g: torch.Tensor,  # [B, T, Hv] float32 log decay (<= 0)
    beta: torch.Tensor,  # [B, T, Hv]
    state: torch.Tensor,  # [B, Hv, Dk, Dv] float32, the state before the first token
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:  # out [B, T, Hv, Dv] value's dtype, state [B, Hv, Dk, Dv]
    """The same rule over whole chunks (every row takes all T tokens): within a chunk the
    delta-rule updates are one lower-triangular solve (the WY / UT transform), so a prefill
    costs a few matmuls per chunk instead of T state updates."""
    q, k, v = (x.transpose(1, 2) for x in _prepare(query, key, value))  # [B, Hv, T, D]
    b, decay = beta.float().transpose(1, 2), g.float().transpose(1, 2)  # [B, Hv, T]
    num_tokens = q.shape[2]
    pad = (-num_tokens) % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    b, decay = (F.pad(x, (0, pad)) for x in (b, decay))
    chunks = (num_tokens + pad) // chunk_size

    def by_chunk(x: torch.Tensor) -> torch.Tensor:  # [B, Hv, T, ...] -> [B, Hv, n, C, ...]
        return x.reshape(*x.shape[:2], chunks, chunk_size, *x.shape[3:])

    q, k, v, b, decay = map(by_chunk, (q, k, v, b, decay))
    cum = decay.cumsum(dim=-1)  # [B, Hv, n, C] log decay from the chunk start
    future = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    pair_decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(future, float("-inf")).exp()
    k_beta, v_beta = k * b[..., None], v * b[..., None]
    # (I + A) u = v_beta with A the strictly lower part of (k_beta k^T) * pair_decay: the
    # intra-chunk delta-rule corrections, solved at once.
    system = (k_beta @ k.transpose(-1, -2)) * pair_decay
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(
        system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True
    )
    intra = (q @ k.transpose(-1, -2)) * pair_decay  # causal scores inside the chunk
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [B, Hv, n, 1, 1]
    out = torch.empty_like(v)
    for i in range(chunks):
        v_new = u[:, :, i] - w[:, :, i] @ state  # the values less what the state predicts
        out[:, :, i] = q_decayed[:, :, i] @ state + intra[:, :, i] @ v_new
        state = state * chunk_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ v_new
    out = out.reshape(*out.shape[:2], -1, out.shape[-1])[:, :, :num_tokens]
    return out.transpose(1, 2).to(value.dtype), state


def chunk_gated_delta_rule_varlen_torch(
    query: torch.Tensor,  # [N, Hk, Dk] tokens of all sequences, packed
    key: torch.Tensor,  # [N, Hk, Dk]
    value: torch.Tensor,  # [N, Hv, Dv]
    g: torch.Tensor,  # [N, Hv] float32 log decay (<= 0)
    beta: torch.Tensor,  # [N, Hv]
    state: torch.Tensor,  # [P, Hv, Dk, Dv] float32, each sequence's state before its first token
    cu_seqlens: torch.Tensor,  # [P + 1] int: sequence i is tokens cu_seqlens[i] .. [i + 1]
    host_cu_seqlens: list[int] | None = None,  # cu_seqlens on the host, if the caller has it
) -> tuple[torch.Tensor, torch.Tensor]:  # out [N, Hv, Dv] value's dtype, final [P, Hv, Dk, Dv]
    """`chunk_gated_delta_rule_torch` of each packed sequence on its own (a batch of one, as
    a prefill chunk always ran): the Triton kernel's specification. `host_cu_seqlens` spares
    the loop a read of the device (the engine reads it back once a step, for the tokens)."""
    out = value.new_empty(value.shape)
    finals = []
    bounds = cu_seqlens.tolist() if host_cu_seqlens is None else host_cu_seqlens
    for i, (first, stop) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        rows = slice(first, stop)
        core, final = chunk_gated_delta_rule_torch(
            query[None, rows], key[None, rows], value[None, rows], g[None, rows],
            beta[None, rows], state[i : i + 1],
        )  # fmt: skip
        out[rows] = core[0]
        finals.append(final)
    return out, torch.cat(finals) if finals else state.float().clone()


def gated_deltanet_decode_torch(
    qkv: torch.Tensor,  # [S, conv_dim] conv inputs, one row a sequence: q | k | v channels
    b_a: torch.Tensor,  # [S, 2 * Hv]: b then a
    z: torch.Tensor,  # [S, Hv * Dv] output gate
    conv_weight: torch.Tensor,  # [conv_dim, K] depthwise taps
    a_log: torch.Tensor,  # [Hv]
    dt_bias: torch.Tensor,  # [Hv]
    norm_weight: torch.Tensor,  # [Dv]
    norm_eps: float,
    num_k_heads: int,
    conv_pool: torch.Tensor,  # [num_slots, K - 1, conv_dim] per-request conv states
    state_pool: torch.Tensor,  # [num_slots, Hv, Dk, Dv] float32 per-request states
    slots: torch.Tensor,  # [S] int64 each sequence's slot (-1: the spare last)
    fresh: torch.Tensor,  # [S] bool: start from zero states (the slot is not read)
) -> torch.Tensor:  # [S, Hv * Dv] qkv's dtype: the gated-normed core, out_proj's input
    """One decode token of S sequences through a Gated DeltaNet layer's token mixer, from and
    into their slots: the causal conv (SiLU) over the slot's conv state and the new input, g
    and beta, the recurrence, the per-head gated RMSNorm; both states are stored. The same
    operations, in the same order, as `GatedDeltaNet`'s step path for one-row sequences."""
    s, num_v_heads, v_head_dim = qkv.shape[0], b_a.shape[-1] // 2, norm_weight.shape[0]
    key_dim = (qkv.shape[-1] - num_v_heads * v_head_dim) // 2
    conv_old = conv_pool[slots]
    keep = ~fresh[:, None, None]
    window = torch.cat((torch.where(keep, conv_old, 0), qkv[:, None].to(conv_old.dtype)), dim=1)
    mixed = causal_conv1d_torch(window, conv_weight).to(qkv.dtype)  # [S, 1, conv_dim]
    g, beta = gate_inputs_torch(b_a[:, None], a_log, dt_bias)
    q, k, v = mixed.split((key_dim, key_dim, num_v_heads * v_head_dim), dim=-1)
    heads = (s, 1, num_k_heads, key_dim // num_k_heads)
    q, k, v = q.reshape(heads), k.reshape(heads), v.reshape(s, 1, num_v_heads, v_head_dim)
    ones = torch.ones_like(slots)
    core = recurrent_gated_delta_rule_pool_torch(
        q, k, v, g, beta, state_pool, slots, fresh, ones, ones.bool()
    )[:, 0]  # [S, Hv, Dv]
    conv_pool[slots] = window[:, 1:]
    return rms_norm_gated_torch(core, z.reshape(core.shape), norm_weight, norm_eps).flatten(1)
