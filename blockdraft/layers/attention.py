"""Attention front-end: stores this step's keys/values in the paged cache, then attends through
the metadata of the current forward context.

A layer whose cache is a pool of its own (the drafter's sliding-window layers,
engine/window_pages.py) reaches it through `page_map`, the page of each of the target's blocks:
its block tables and slots are the forward's, translated once per forward."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from blockdraft.kernels.forward_context import (
    PAD_SLOT_ID,
    AttentionMetadata,
    get_attention_metadata,
)
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
        # [num_blocks + 1] int64 page of each target block in this layer's own pool; None:
        # the cache is indexed by the target's blocks.
        self.page_map: torch.Tensor | None = None
        # By the active kernel policy's backend; resolved again only when it or the device
        # changes.
        self._store_kv = PerDevice(get_store_kv_backend)
        self._attention = PerDevice(get_attention_backend)
        self._rope_store_attention = PerDevice(get_rope_store_attention_backend)

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        meta = self.metadata()
        self._store_kv(query.device)(
            key, value, self.key_cache, self.value_cache, meta.slot_mapping
        )
        return self.attend(query)

    def attend(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Attention over the cache alone: this step's keys and values are already in it (stored
        by the RoPE kernel, `KernelPolicy.fuse_kv_store_into_rope`)."""
        meta = self.metadata()
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
        cos_cache: torch.Tensor,  # [max_position, rotary_dim / 2] float32
        sin_cache: torch.Tensor,  # [max_position, rotary_dim / 2] float32
        q_norm_weight: torch.Tensor | None,  # [head_dim]; None: no q/k norm
        k_norm_weight: torch.Tensor | None,  # [head_dim]
        eps: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """q/k norm and RoPE, this step's keys and values into the cache, then `attend`: one
        kernel on the Triton path where the policy's `rope_in_attention_max_query_len` covers
        the forward (decode by default) and the table rotates whole heads, two otherwise."""
        meta = self.metadata()
        return self._rope_store_attention(query.device)(
            query, key, value, positions, cos_cache, sin_cache, q_norm_weight, k_norm_weight,
            eps, self.key_cache, self.value_cache, meta, self.scale, self.causal, self.window,
            split_counters=self.split_counters,
        )  # fmt: skip

    def metadata(self) -> AttentionMetadata:
        """The forward's metadata, in this layer's pages when it has a pool of its own."""
        meta = get_attention_metadata()
        if self.page_map is None:
            return meta
        key = ("pages", self.page_map.data_ptr())
        if key not in meta.cache:
            meta.cache[key] = dataclasses.replace(
                meta,
                slot_mapping=self.cache_slots(meta.slot_mapping, meta.block_size),
                block_tables=self.page_map[meta.block_tables],
                cache={},
            )
        return meta.cache[key]

    def cache_slots(
        self,
        slot_mapping: torch.Tensor,  # [num_tokens] int64 slots in the target's blocks
        block_size: int,
    ) -> torch.Tensor:  # [num_tokens] int64 slots in this layer's cache
        if self.page_map is None:
            return slot_mapping
        pages = self.page_map[slot_mapping.clamp(min=0) // block_size]
        slots = pages * block_size + slot_mapping % block_size
        return torch.where(slot_mapping == PAD_SLOT_ID, PAD_SLOT_ID, slots)
