"""Attention front-end: stores this step's keys/values in the paged cache, then attends through
the metadata of the current forward context."""

from __future__ import annotations

import torch
from torch import nn

from blockdraft.kernels.forward_context import get_attention_metadata
from blockdraft.kernels.select import (
    PerDevice,
    get_attention_backend,
    get_rope_store_attention_backend,
    get_store_kv_backend,
)


class PagedAttention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        causal: bool = True,
        window: int | None = None,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.causal, self.window = causal, window
        # Bound by the runner once the KV pool is allocated.
        self.key_cache: torch.Tensor | None = None  # [num_blocks, block_size, Hkv, D]
        self.value_cache: torch.Tensor | None = None
        # Zeroed int32 counters that let a split decode launch merge its splits in the
        # attention kernel (triton_paged_attention's split_counters); bound with the cache.
        self.split_counters: torch.Tensor | None = None
        # Triton on CUDA, the torch twin elsewhere; resolved once per device.
        self._store_kv = PerDevice(get_store_kv_backend)
        self._attention = PerDevice(get_attention_backend)
        self._rope_store_attention = PerDevice(get_rope_store_attention_backend)

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        meta = get_attention_metadata()
        self._store_kv(query.device)(
            key, value, self.key_cache, self.value_cache, meta.slot_mapping
        )
        return self.attend(query)

    def attend(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Attention over the cache alone: this step's keys and values are already in it (stored
        by the RoPE kernel, `blockdraft.layers.self_attention.FUSE_KV_STORE_INTO_ROPE`)."""
        meta = get_attention_metadata()
        return self._attention(query.device)(
            query, self.key_cache, self.value_cache, meta, self.scale, self.causal, self.window,
            split_counters=self.split_counters,
        )  # fmt: skip

    def rope_store_attend(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim], before q norm and RoPE
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], before k norm and RoPE
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        positions: torch.Tensor,  # [num_tokens] int64
        cos_cache: torch.Tensor,  # [max_position, head_dim / 2] float32
        sin_cache: torch.Tensor,  # [max_position, head_dim / 2] float32
        q_norm_weight: torch.Tensor | None,  # [head_dim]; None: no q/k norm
        k_norm_weight: torch.Tensor | None,  # [head_dim]
        eps: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """q/k norm and RoPE, this step's keys and values into the cache, then `attend`: one
        kernel for a decode forward on the Triton path, two otherwise."""
        meta = get_attention_metadata()
        return self._rope_store_attention(query.device)(
            query, key, value, positions, cos_cache, sin_cache, q_norm_weight, k_norm_weight,
            eps, self.key_cache, self.value_cache, meta, self.scale, self.causal, self.window,
            split_counters=self.split_counters,
        )  # fmt: skip
