"""Rotary position embedding (rotate-half layout), with Llama-3 frequency scaling, fused with
the optional per-head q/k RMSNorm that precedes it (Qwen3's RMSNorm, or Qwen3.5's OffsetRMSNorm
with `norm_offset`). Partial rotary (Hugging Face's `partial_rotary_factor`) rotates only the
first `rotary_dim` dimensions of each head, in the fused kernels as in `rotate`."""

from __future__ import annotations

import math

import torch
from torch import nn

from blockdraft.kernels.rope import qk_norm_rope_torch, rope_torch
from blockdraft.kernels.select import (
    PerDevice,
    get_rope_backend,
    get_rope_store_backend,
    needs_autograd,
)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    original_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = original_len / low_freq_factor
    high_freq_wavelen = original_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept; the band between is blended.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """The fused kernels (`forward`, `forward_store`) and `rotate` read the width of the
    rotated part of each head off the cos/sin tables (rotary_dim / 2 columns)."""

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float,
        scaling: dict | None = None,
        partial_rotary_factor: float = 1.0,
    ) -> None:
        super().__init__()
        # Hugging Face's rounding: int(), then the frequencies of the rotated dimensions alone.
        self.rotary_dim = dim = int(head_dim * partial_rotary_factor)
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif rope_type not in ("default", None):
            raise ValueError(f"unsupported rope_scaling type {rope_type!r}; supported: llama3")
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        self.register_buffer("cos_cache", freqs.cos(), persistent=False)  # [max_pos, rotary_dim/2]
        self.register_buffer("sin_cache", freqs.sin(), persistent=False)
        self._backend = PerDevice(get_rope_backend)  # Triton on CUDA, else torch
        self._store_backend = PerDevice(get_rope_store_backend)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens] int64
        query: torch.Tensor | None,  # [num_tokens, num_heads, head_dim]; None: keys only
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        q_norm_weight: torch.Tensor | None = None,  # [head_dim]; None: no q/k norm
        k_norm_weight: torch.Tensor | None = None,  # [head_dim]
        eps: float = 1e-6,  # of the q/k norms
        *,
        norm_offset: bool = False,  # the norm weights are offsets from one (OffsetRMSNorm)
    ) -> tuple[torch.Tensor | None, torch.Tensor]:  # rotated (query, key)
        """`(rope(q_norm(query)), rope(k_norm(key)))`, one kernel for both on the Triton path."""
        if needs_autograd(query, key, q_norm_weight, k_norm_weight):
            fn = qk_norm_rope_torch
        else:
            fn = self._backend(key.device)
        return fn(
            query, key, positions, self.cos_cache, self.sin_cache, q_norm_weight, k_norm_weight,
            eps, norm_offset=norm_offset,
        )  # fmt: skip

    def forward_store(
        self,
        positions: torch.Tensor,  # [num_tokens] int64
        query: torch.Tensor | None,  # [num_tokens, num_heads, head_dim]; None: keys only
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # [num_tokens] int64, PAD_SLOT_ID rows write nothing
        q_norm_weight: torch.Tensor | None = None,  # [head_dim]; None: no q/k norm
        k_norm_weight: torch.Tensor | None = None,  # [head_dim]
        eps: float = 1e-6,  # of the q/k norms
        *,
        norm_offset: bool = False,  # the norm weights are offsets from one (OffsetRMSNorm)
    ) -> tuple[torch.Tensor | None, torch.Tensor]:  # rotated (query, key)
        """`forward`, and the rotated keys and the values stored in the paged cache at
        slot_mapping by the same kernel on the Triton path. Inference only: the caches take no
        gradient, so training keeps `forward` and a separate store."""
        return self._store_backend(key.device)(
            query,
            key,
            value,
            positions,
            self.cos_cache,
            self.sin_cache,
            q_norm_weight,
            k_norm_weight,
            eps,
            key_cache,
            value_cache,
            slot_mapping,
            norm_offset=norm_offset,
        )

    def rotate(
        self,
        positions: torch.Tensor,  # [num_tokens] int64
        x: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """RoPE alone, in torch (the drafter's training forward norms and rotates by hand); the
        dimensions past rotary_dim pass through."""
        return rope_torch(x, positions, self.cos_cache, self.sin_cache)
