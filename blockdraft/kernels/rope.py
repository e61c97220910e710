"""Pure-torch twins of the per-layer elementwise kernels: q/k RMSNorm + rotary embedding (also
with the KV store after it), and the MLP's SiLU-and-multiply.

The q/k norms are Qwen3's `RMSNorm` or, with `norm_offset`, Qwen3.5 / Qwen3-Next's
`OffsetRMSNorm` (weights stored as offsets from one, see `rms_norm_torch`). A cos/sin table
narrower than the head (`[max_position, rotary_dim / 2]`, partial rotary) rotates the first
rotary_dim dimensions of each head alone; the rest pass through, as `RotaryEmbedding.rotate`
leaves them.

The specification of the Triton kernels in `triton_rope` and `triton_activation`, and what the
layers run off the Triton path (CPU, training). They live apart from the kernels because
importing triton early would fix TRITON_INTERPRET before `select` reads it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from blockdraft.kernels.forward_context import AttentionMetadata
from blockdraft.kernels.paged_attention import paged_attention, store_kv
from blockdraft.kernels.rmsnorm import rms_norm_torch


def rope_torch(
    x: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    positions: torch.Tensor,  # [num_tokens] int64
    cos_cache: torch.Tensor,  # [max_position, rotary_dim / 2] float32, rotary_dim <= head_dim
    sin_cache: torch.Tensor,  # [max_position, rotary_dim / 2] float32
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim], x's dtype
    """Rotate-half RoPE (dimension i pairs with i + rotary_dim/2), computed in float32 and
    rounded back to x's dtype, as the reference models do; dimensions past rotary_dim (partial
    rotary) pass through."""
    rotary_dim = 2 * cos_cache.shape[-1]
    if rotary_dim != x.shape[-1]:
        rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
        return torch.cat((rope_torch(rot, positions, cos_cache, sin_cache), rest), -1)
    cos = cos_cache[positions][:, None, :]  # [num_tokens, 1, D/2]
    sin = sin_cache[positions][:, None, :]
    x32 = x.float()
    x1, x2 = x32.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def norm_rope_torch(
    x: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    positions: torch.Tensor,  # [num_tokens] int64
    cos_cache: torch.Tensor,  # [max_position, rotary_dim / 2] float32
    sin_cache: torch.Tensor,  # [max_position, rotary_dim / 2] float32
    norm_weight: torch.Tensor | None,  # [head_dim]; None: no norm
    eps: float,
    *,
    norm_offset: bool = False,  # the weight is an offset from one (OffsetRMSNorm)
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """`rope(rms_norm(x))`: the norm's output dtype (weight * x promoted; x's own with
    norm_offset) is the one rotated and returned, so float32 norm weights under autocast give
    float32 heads, as before."""
    if norm_weight is not None:
        x = rms_norm_torch(x, norm_weight, eps, offset=norm_offset)
    return rope_torch(x, positions, cos_cache, sin_cache)


def qk_norm_rope_torch(
    query: torch.Tensor | None,  # [num_tokens, num_heads, head_dim]; None: keys only
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    positions: torch.Tensor,  # [num_tokens] int64
    cos_cache: torch.Tensor,  # [max_position, rotary_dim / 2] float32, rotary_dim <= head_dim
    sin_cache: torch.Tensor,  # [max_position, rotary_dim / 2] float32
    q_norm_weight: torch.Tensor | None,  # [head_dim]; None: no q/k norm (Llama)
    k_norm_weight: torch.Tensor | None,  # [head_dim]
    eps: float,
    *,
    norm_offset: bool = False,  # the norm weights are offsets from one (OffsetRMSNorm)
) -> tuple[torch.Tensor | None, torch.Tensor]:  # rotated (query, key), shapes as given
    """Qwen3's per-head RMSNorm of queries and keys (when weights are given; Qwen3.5's
    OffsetRMSNorm with norm_offset), then RoPE."""
    norm = dict(eps=eps, norm_offset=norm_offset)
    if query is not None:
        query = norm_rope_torch(query, positions, cos_cache, sin_cache, q_norm_weight, **norm)
    key = norm_rope_torch(key, positions, cos_cache, sin_cache, k_norm_weight, **norm)
    return query, key


def qk_norm_rope_store_torch(
    query: torch.Tensor | None,  # [num_tokens, num_heads, head_dim]; None: keys only
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    positions: torch.Tensor,  # [num_tokens] int64
    cos_cache: torch.Tensor,  # [max_position, rotary_dim / 2] float32, rotary_dim <= head_dim
    sin_cache: torch.Tensor,  # [max_position, rotary_dim / 2] float32
    q_norm_weight: torch.Tensor | None,  # [head_dim]; None: no q/k norm (Llama)
    k_norm_weight: torch.Tensor | None,  # [head_dim]
    eps: float,
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, PAD_SLOT_ID: see store_kv
    *,
    norm_offset: bool = False,  # the norm weights are offsets from one (OffsetRMSNorm)
) -> tuple[torch.Tensor | None, torch.Tensor]:  # rotated (query, key), shapes as given
    """`qk_norm_rope_torch`, then the rotated keys and the values as given stored at
    slot_mapping by `store_kv`. PAD rows wrap around into the pool's reserved last slot there,
    where the Triton kernel writes nothing: every slot a sequence can read ends up the same."""
    query, key = qk_norm_rope_torch(
        query, key, positions, cos_cache, sin_cache, q_norm_weight, k_norm_weight, eps,
        norm_offset=norm_offset,
    )  # fmt: skip
    store_kv(key, value, key_cache, value_cache, slot_mapping)
    return query, key


def rope_store_attention_torch(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], before q norm and RoPE
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], before k norm and RoPE
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    positions: torch.Tensor,  # [num_tokens] int64
    # No offset norms: the attention kernel's rotation (triton_rope_store_attention) has none.
    cos_cache: torch.Tensor,  # [max_position, rotary_dim / 2] float32, rotary_dim <= head_dim
    sin_cache: torch.Tensor,  # [max_position, rotary_dim / 2] float32
    q_norm_weight: torch.Tensor | None,  # [head_dim]; None: no q/k norm (Llama)
    k_norm_weight: torch.Tensor | None,  # [head_dim]
    eps: float,
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    causal: bool = True,
    window: int | None = None,
    *,
    split_counters: torch.Tensor | None = None,  # the Triton kernel's workspace; unused here
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """An attention layer's step after its q/k/v projection: `qk_norm_rope_store_torch` (the
    step's keys and values into the cache at meta.slot_mapping), then `paged_attention` of the
    rotated queries."""
    query, _ = qk_norm_rope_store_torch(
        query, key, value, positions, cos_cache, sin_cache, q_norm_weight, k_norm_weight, eps,
        key_cache, value_cache, meta.slot_mapping,
    )  # fmt: skip
    return paged_attention(query, key_cache, value_cache, meta, scale, causal, window)


def silu_mul_torch(
    gate: torch.Tensor,  # [..., intermediate]
    up: torch.Tensor,  # [..., intermediate]
) -> torch.Tensor:  # [..., intermediate]
    """The gated MLP's activation: `silu(gate) * up`, each op rounded to the activation dtype."""
    return F.silu(gate) * up
