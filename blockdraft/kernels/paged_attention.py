"""Paged attention, pure-torch implementation (the reference the Triton kernels are checked
against, and what CPU runs use).

Keys and values live in a block pool `[num_blocks, block_size, num_kv_heads, head_dim]` whose
last block is reserved for padded rows; a sequence's block table lists its blocks in order.
Query row j of sequence i sits at position `seq_lens[i] - query_lens[i] + j`. Causal rows see
keys at positions <= their own; non-causal rows (the DFlash drafter's block) see every key of
their sequence. A sliding window of W keeps
keys with |query position - key position| < W (only the past side when causal).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from blockdraft.kernels.forward_context import PAD_SLOT_ID, AttentionMetadata


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    # The pool's last block is never handed out: PAD_SLOT_ID (-1) wraps around to its last slot,
    # so padded rows write there instead of needing a (host-synchronising) boolean filter.
    assert PAD_SLOT_ID == -1
    flat_keys = key_cache.view(-1, *key_cache.shape[2:])
    slots = slot_mapping % flat_keys.shape[0]
    flat_keys.index_copy_(0, slots, key.to(key_cache.dtype))
    value_cache.view(-1, *value_cache.shape[2:]).index_copy_(0, slots, value.to(value_cache.dtype))


def _padded_layout(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each flat query row goes in a [num_seqs, max_query_len] grid, and the positions of
    the grid's queries and keys."""
    if "layout" not in meta.cache and meta.uniform_query_len:
        device, q = meta.seq_lens.device, meta.max_query_len
        meta.cache["layout"] = (
            torch.arange(meta.num_seqs * q, device=device),
            meta.seq_lens[:, None] - q + torch.arange(q, device=device)[None, :],
            torch.arange(meta.max_seq_len, device=device),
        )
    if "layout" not in meta.cache:
        device = meta.seq_lens.device
        query_lens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]  # [num_seqs]
        seq_of_row = torch.repeat_interleave(
            torch.arange(meta.num_seqs, device=device), query_lens
        )  # [num_tokens]
        row_in_seq = (
            torch.arange(seq_of_row.shape[0], device=device) - meta.query_start_loc[seq_of_row]
        )
        pad_index = seq_of_row * meta.max_query_len + row_in_seq  # [num_tokens]
        query_pos = (meta.seq_lens - query_lens)[:, None] + torch.arange(
            meta.max_query_len, device=device
        )[None, :]  # [num_seqs, max_query_len]
        key_pos = torch.arange(meta.max_seq_len, device=device)  # [max_seq_len]
        meta.cache["layout"] = (pad_index, query_pos, key_pos)
    return meta.cache["layout"]


def _attention_mask(meta: AttentionMetadata, causal: bool, window: int | None) -> torch.Tensor:
    key = ("mask", causal, window)
    if key not in meta.cache:
        _, query_pos, key_pos = _padded_layout(meta)
        qp = query_pos[:, :, None]  # [num_seqs, max_query_len, 1]
        kp = key_pos[None, None, :]  # [1, 1, max_seq_len]
        visible = kp < meta.seq_lens[:, None, None]
        if causal:
            visible = visible & (kp <= qp)
        if window is not None:
            visible = visible & (qp - kp < window)
            if not causal:
                visible = visible & (kp - qp < window)
        meta.cache[key] = visible[:, None]  # [num_seqs, 1, max_query_len, max_seq_len]
    return meta.cache[key]


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    causal: bool = True,
    window: int | None = None,
    *,
    split_counters: torch.Tensor | None = None,  # the Triton kernel's workspace; unused here
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    num_tokens, num_heads, head_dim = query.shape
    num_seqs, max_q = meta.num_seqs, meta.max_query_len
    pad_index, _, _ = _padded_layout(meta)
    num_kv_blocks = -(-meta.max_seq_len // meta.block_size)
    blocks = meta.block_tables[:, :num_kv_blocks]  # [num_seqs, num_kv_blocks]
    keys = key_cache[blocks].flatten(1, 2)[:, : meta.max_seq_len]  # [S, max_seq_len, Hkv, D]
    values = value_cache[blocks].flatten(1, 2)[:, : meta.max_seq_len]
    padded_query = query.new_zeros(num_seqs * max_q, num_heads, head_dim)
    padded_query[pad_index] = query
    padded_query = padded_query.view(num_seqs, max_q, num_heads, head_dim)
    out = F.scaled_dot_product_attention(
        padded_query.transpose(1, 2),
        keys.transpose(1, 2).to(query.dtype),
        values.transpose(1, 2).to(query.dtype),
        attn_mask=_attention_mask(meta, causal, window),
        scale=scale,
        enable_gqa=True,
    )  # [num_seqs, num_heads, max_q, head_dim]
    return out.transpose(1, 2).reshape(num_seqs * max_q, num_heads, head_dim)[pad_index]
