"""Writes this step's keys and values into the paged KV cache; same contract as
`blockdraft.kernels.paged_attention.store_kv`.

PAD rows (PAD_SLOT_ID) write nothing here. The torch version, to avoid a host sync, lets them
wrap around into the pool's reserved last slot, which no sequence ever reads; every slot that
a sequence can read ends up identical either way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["num_tokens"])  # any row count, one compile
def _store_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int, negative (PAD_SLOT_ID) = write nothing
    num_tokens,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    block_size,
    HEAD_DIM: tl.constexpr,
    ROW: tl.constexpr,  # num_kv_heads * head_dim: the elements of one token
    BLOCK_T: tl.constexpr,  # tokens per program
    BLOCK_E: tl.constexpr,  # >= ROW
):
    # A tile is [BLOCK_T tokens, all heads x head_dim], so one program moves a few KiB
    # whatever the head count, and PAD rows are just masked out of the tile.
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    slot = tl.load(slot_mapping_ptr + tokens, mask=tokens < num_tokens, other=-1).to(tl.int64)
    write = slot >= 0
    block = tl.where(write, slot, 0) // block_size
    in_block = tl.where(write, slot, 0) % block_size
    offs_e = tl.arange(0, BLOCK_E)
    head = offs_e // HEAD_DIM  # [BLOCK_E]
    dim = offs_e % HEAD_DIM
    ok = write[:, None] & (offs_e < ROW)[None, :]  # [BLOCK_T, BLOCK_E]
    tok = tokens.to(tl.int64)[:, None]
    k = tl.load(key_ptr + tok * stride_kt + (head * stride_kh + dim)[None, :], mask=ok)
    v = tl.load(value_ptr + tok * stride_vt + (head * stride_vh + dim)[None, :], mask=ok)
    kc = (block * stride_kcb + in_block * stride_kcs)[:, None] + (head * stride_kch + dim)[None, :]
    vc = (block * stride_vcb + in_block * stride_vcs)[:, None] + (head * stride_vch + dim)[None, :]
    tl.store(key_cache_ptr + kc, k.to(key_cache_ptr.dtype.element_ty), mask=ok)
    tl.store(value_cache_ptr + vc, v.to(value_cache_ptr.dtype.element_ty), mask=ok)


def triton_store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, PAD_SLOT_ID rows write nothing
) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    # Rows of key/value may be strided (views into a fused qkv output); only head_dim must be
    # contiguous, in the inputs and in the caches.
    if key.stride(2) != 1:
        key = key.contiguous()
    if value.stride(2) != 1:
        value = value.contiguous()
    if key_cache.stride(3) != 1 or value_cache.stride(3) != 1:
        raise ValueError("key_cache and value_cache need a contiguous head_dim")
    row = num_kv_heads * head_dim
    block_e = triton.next_power_of_2(row)
    block_t = max(1, min(32, 4096 // block_e))
    _store_kv_kernel[(triton.cdiv(num_tokens, block_t),)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        num_tokens,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        key_cache.shape[1],
        HEAD_DIM=head_dim,
        ROW=row,
        BLOCK_T=block_t,
        BLOCK_E=block_e,
        num_warps=4,
    )
