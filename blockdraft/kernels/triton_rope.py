"""Fused q/k RMSNorm + rotary embedding: one launch for the query and key heads of all tokens.

`qk_norm_rope_torch` (in `blockdraft.kernels.rope`) is the specification: per head, RMSNorm in
float32 rounded back to the activation dtype and scaled by the weight (rounded to the dtype
torch promotion gives), then rotate-half RoPE in float32 rounded back to that dtype. The eager
version costs about a dozen launches per tensor (gathers, casts, chunk, muls, cat); a decode
step runs it twice per layer, where the launches, not the bytes, are the cost.

`triton_qk_norm_rope_store` also writes each token's rotated keys and its values into the
paged KV cache (the work of `triton_kv_store`) from the programs that rotate the keys, saving
the store kernel's launch. Its twin, `qk_norm_rope_store_torch`, is the rotation followed by
`blockdraft.kernels.paged_attention.store_kv`; as with `triton_kv_store`, PAD rows
(PAD_SLOT_ID) write nothing here, while the torch store lets them wrap around into the pool's
reserved last slot, which no sequence ever reads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from blockdraft.kernels.pdl import launch_options, pdl_enabled, pdl_start
from blockdraft.kernels.rope import qk_norm_rope_store_torch, qk_norm_rope_torch

__all__ = [
    "qk_norm_rope_store_torch",
    "qk_norm_rope_torch",
    "triton_qk_norm_rope",
    "triton_qk_norm_rope_store",
]


@triton.jit
def _norm_rope_heads(
    x_ptr,  # this token's first head, [num_heads, head_dim] with row stride stride_xh
    out_ptr,  # this token's first output head, row stride stride_oh
    w_ptr,  # [head_dim]; read when HAS_NORM
    stride_xh,
    stride_oh,
    head0,
    num_heads,
    cos,  # [BLOCK_D] float32, this token's angles (zero past head_dim / 2)
    sin,
    half,
    head_dim,
    eps,
    cache_ptr,  # this token's cache slot, [num_heads, head_dim] with row stride stride_ch
    stride_ch,
    cache_write,  # scalar bool: the slot is real (not PAD); read when STORE
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_NORM: tl.constexpr,
    STORE: tl.constexpr,  # also write the rotated heads into the cache slot
):
    heads = head0 + tl.arange(0, BLOCK_H)
    offs = tl.arange(0, BLOCK_D)
    ok_d = offs < half
    ok = (heads < num_heads)[:, None] & ok_d[None, :]
    x_rows = x_ptr + heads[:, None] * stride_xh + offs[None, :]
    # Rotate-half pairs dimension i with i + head_dim/2: load the two halves as two tiles.
    x1 = tl.load(x_rows, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(x_rows + half, mask=ok, other=0.0).to(tl.float32)
    out_ty = out_ptr.dtype.element_ty
    if HAS_NORM:
        in_ty = x_ptr.dtype.element_ty
        rstd = 1.0 / tl.sqrt(tl.sum(x1 * x1 + x2 * x2, axis=1) / head_dim + eps)
        w1 = tl.load(w_ptr + offs, mask=ok_d, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + half + offs, mask=ok_d, other=0.0).to(tl.float32)
        # The same roundings as the eager norm (to the activation dtype, then weight * x to the
        # promoted one), so the rotation sees the very values the torch path rotates.
        x1 = (x1 * rstd[:, None]).to(in_ty).to(tl.float32) * w1[None, :]
        x2 = (x2 * rstd[:, None]).to(in_ty).to(tl.float32) * w2[None, :]
        x1 = x1.to(out_ty).to(tl.float32)
        x2 = x2.to(out_ty).to(tl.float32)
    cos = cos[None, :]
    sin = sin[None, :]
    y1 = (x1 * cos - x2 * sin).to(out_ty)
    y2 = (x2 * cos + x1 * sin).to(out_ty)
    out_rows = out_ptr + heads[:, None] * stride_oh + offs[None, :]
    tl.store(out_rows, y1, mask=ok)
    tl.store(out_rows + half, y2, mask=ok)
    if STORE:
        # The cache holds the returned keys cast to its dtype, as `store_kv` writes them.
        cache_ty = cache_ptr.dtype.element_ty
        cache_rows = cache_ptr + heads[:, None] * stride_ch + offs[None, :]
        tl.store(cache_rows, y1.to(cache_ty), mask=ok & cache_write)
        tl.store(cache_rows + half, y2.to(cache_ty), mask=ok & cache_write)


@triton.jit
def _copy_heads(
    x_ptr,  # this token's first head, [num_heads, head_dim] with row stride stride_xh
    cache_ptr,  # this token's cache slot, [num_heads, head_dim] with row stride stride_ch
    stride_xh,
    stride_ch,
    head0,
    num_heads,
    half,
    cache_write,  # scalar bool: the slot is real (not PAD)
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # The same [heads, half] tiles as the rotation, so one program covers both halves.
    heads = head0 + tl.arange(0, BLOCK_H)
    offs = tl.arange(0, BLOCK_D)
    ok = (heads < num_heads)[:, None] & (offs < half)[None, :] & cache_write
    x_rows = x_ptr + heads[:, None] * stride_xh + offs[None, :]
    cache_rows = cache_ptr + heads[:, None] * stride_ch + offs[None, :]
    cache_ty = cache_ptr.dtype.element_ty
    tl.store(cache_rows, tl.load(x_rows, mask=ok).to(cache_ty), mask=ok)
    tl.store(cache_rows + half, tl.load(x_rows + half, mask=ok).to(cache_ty), mask=ok)


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr,  # [num_tokens, num_q_heads, head_dim], last dim contiguous
    k_ptr,  # [num_tokens, num_kv_heads, head_dim]
    q_out_ptr,  # [num_tokens, num_q_heads, head_dim]
    k_out_ptr,  # [num_tokens, num_kv_heads, head_dim]
    q_w_ptr,  # [head_dim]; read when HAS_Q_NORM
    k_w_ptr,  # [head_dim]; read when HAS_K_NORM
    positions_ptr,  # [num_tokens] int64
    cos_ptr,  # [max_position, head_dim / 2] float32
    sin_ptr,  # [max_position, head_dim / 2] float32
    v_ptr,  # [num_tokens, num_kv_heads, head_dim]; read when STORE_KV
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]; written when STORE_KV
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]; written when STORE_KV
    slot_mapping_ptr,  # [num_tokens] int, negative (PAD_SLOT_ID) = write nothing
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_oqt,
    stride_oqh,
    stride_okt,
    stride_okh,
    stride_cos,
    stride_sin,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    block_size,  # of the paged cache
    num_q_heads,
    num_kv_heads,
    num_q_blocks,  # programs along axis 1 that take query heads; the rest take key heads
    half,
    head_dim,
    eps,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_Q_NORM: tl.constexpr,
    HAS_K_NORM: tl.constexpr,
    STORE_KV: tl.constexpr,  # the key programs also write their keys and values to the cache
    PDL: tl.constexpr,  # launched with programmatic dependent launch (blockdraft.kernels.pdl)
):
    pdl_start(PDL)
    token = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    offs = tl.arange(0, BLOCK_D)
    ok_d = offs < half
    pos = tl.load(positions_ptr + token).to(tl.int64)
    # One gather of the token's angles, shared by all the heads this program rotates.
    cos = tl.load(cos_ptr + pos * stride_cos + offs, mask=ok_d, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_sin + offs, mask=ok_d, other=0.0).to(tl.float32)
    if blk < num_q_blocks:
        _norm_rope_heads(
            q_ptr + token * stride_qt,
            q_out_ptr + token * stride_oqt,
            q_w_ptr,
            stride_qh,
            stride_oqh,
            blk * BLOCK_H,
            num_q_heads,
            cos,
            sin,
            half,
            head_dim,
            eps,
            q_out_ptr,  # no cache for queries
            0,
            False,
            BLOCK_H,
            BLOCK_D,
            HAS_Q_NORM,
            False,
        )
    else:
        head0 = (blk - num_q_blocks) * BLOCK_H
        if STORE_KV:
            slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
            write = slot >= 0
            slot = tl.where(write, slot, 0)  # PAD rows address a real slot under a false mask
            block = slot // block_size
            in_block = slot % block_size
            k_cache = key_cache_ptr + block * stride_kcb + in_block * stride_kcs
            v_cache = value_cache_ptr + block * stride_vcb + in_block * stride_vcs
            # The values of the heads whose keys this program stores: the same slot rows.
            _copy_heads(
                v_ptr + token * stride_vt,
                v_cache,
                stride_vh,
                stride_vch,
                head0,
                num_kv_heads,
                half,
                write,
                BLOCK_H,
                BLOCK_D,
            )
        else:
            k_cache = k_out_ptr  # unused
            write = False
        _norm_rope_heads(
            k_ptr + token * stride_kt,
            k_out_ptr + token * stride_okt,
            k_w_ptr,
            stride_kh,
            stride_okh,
            head0,
            num_kv_heads,
            cos,
            sin,
            half,
            head_dim,
            eps,
            k_cache,
            stride_kch,
            write,
            BLOCK_H,
            BLOCK_D,
            HAS_K_NORM,
            STORE_KV,
        )


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    # Heads sliced from a fused projection keep arbitrary token/head strides; the kernel only
    # needs unit stride along head_dim.
    return x if x.stride(-1) == 1 else x.contiguous()


def _out_like(x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    dtype = x.dtype if weight is None else torch.promote_types(weight.dtype, x.dtype)
    return torch.empty(x.shape, dtype=dtype, device=x.device)


def triton_qk_norm_rope(
    query: torch.Tensor | None,  # [num_tokens, num_heads, head_dim]; None: keys only
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    positions: torch.Tensor,  # [num_tokens] int64
    cos_cache: torch.Tensor,  # [max_position, head_dim / 2] float32
    sin_cache: torch.Tensor,  # [max_position, head_dim / 2] float32
    q_norm_weight: torch.Tensor | None,  # [head_dim]; None: no q/k norm (Llama)
    k_norm_weight: torch.Tensor | None,  # [head_dim]
    eps: float,
    *,
    block_h: int | None = None,  # heads per program; None: a tile of about 2048 elements
) -> tuple[torch.Tensor | None, torch.Tensor]:  # new (query, key), contiguous
    return _launch(
        query,
        key,
        positions,
        cos_cache,
        sin_cache,
        q_norm_weight,
        k_norm_weight,
        eps,
        None,
        block_h,
    )


def triton_qk_norm_rope_store(
    query: torch.Tensor | None,  # [num_tokens, num_heads, head_dim]; None: keys only
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    positions: torch.Tensor,  # [num_tokens] int64
    cos_cache: torch.Tensor,  # [max_position, head_dim / 2] float32
    sin_cache: torch.Tensor,  # [max_position, head_dim / 2] float32
    q_norm_weight: torch.Tensor | None,  # [head_dim]; None: no q/k norm (Llama)
    k_norm_weight: torch.Tensor | None,  # [head_dim]
    eps: float,
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, PAD_SLOT_ID rows write nothing
    *,
    block_h: int | None = None,  # heads per program; None: a tile of about 2048 elements
) -> tuple[torch.Tensor | None, torch.Tensor]:  # new (query, key), contiguous
    """`triton_qk_norm_rope`, and the new keys and the values (as given: neither normed nor
    rotated) written into the caches at slot_mapping, cast to the caches' dtypes, in the same
    launch."""
    if value.shape != key.shape:
        raise ValueError(f"value {tuple(value.shape)} does not match key {tuple(key.shape)}")
    if slot_mapping.shape != key.shape[:1]:
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)} is not one slot per token")
    for cache in (key_cache, value_cache):
        if cache.shape[2:] != key.shape[1:] or cache.shape != key_cache.shape:
            raise ValueError(
                f"caches {tuple(key_cache.shape)}, {tuple(value_cache.shape)} do not hold keys "
                f"of {tuple(key.shape[1:])}"
            )
        if cache.stride(3) != 1:
            raise ValueError("key_cache and value_cache need a contiguous head_dim")
    store = (_rows_contiguous(value), key_cache, value_cache, slot_mapping)
    return _launch(
        query,
        key,
        positions,
        cos_cache,
        sin_cache,
        q_norm_weight,
        k_norm_weight,
        eps,
        store,
        block_h,
    )


def _launch(
    query: torch.Tensor | None,  # [num_tokens, num_heads, head_dim]; None: keys only
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    positions: torch.Tensor,  # [num_tokens] int64
    cos_cache: torch.Tensor,  # [max_position, head_dim / 2] float32
    sin_cache: torch.Tensor,  # [max_position, head_dim / 2] float32
    q_norm_weight: torch.Tensor | None,  # [head_dim]; None: no q/k norm (Llama)
    k_norm_weight: torch.Tensor | None,  # [head_dim]
    eps: float,
    # (value, key_cache, value_cache, slot_mapping), checked by the caller; None: no store
    store: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None,
    block_h: int | None,  # heads per program; None: a tile of about 2048 elements
) -> tuple[torch.Tensor | None, torch.Tensor]:  # new (query, key), contiguous
    num_tokens, num_kv_heads, head_dim = key.shape
    if head_dim % 2:
        raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")
    key = _rows_contiguous(key)
    k_out = _out_like(key, k_norm_weight)
    num_q_heads = 0
    q_out = None
    if query is not None:
        if query.shape[0] != num_tokens or query.shape[2] != head_dim:
            raise ValueError(f"query {tuple(query.shape)} does not match key {tuple(key.shape)}")
        query = _rows_contiguous(query)
        q_out = _out_like(query, q_norm_weight)
        num_q_heads = query.shape[1]
    if num_tokens == 0:
        return q_out, k_out
    half = head_dim // 2
    block_d = triton.next_power_of_2(half)
    if block_h is None:
        block_h = min(
            triton.next_power_of_2(max(num_q_heads, num_kv_heads)), max(1, 1024 // block_d)
        )
    num_q_blocks = triton.cdiv(num_q_heads, block_h)
    grid = (num_tokens, num_q_blocks + triton.cdiv(num_kv_heads, block_h))
    # Without a query, the key tensors stand in for the unused query arguments; without a
    # store, for the unused value and cache ones.
    q, qo = (query, q_out) if query is not None else (key, k_out)
    q_w = q_norm_weight if q_norm_weight is not None else key
    k_w = k_norm_weight if k_norm_weight is not None else key
    value, key_cache, value_cache, slot_mapping = store or (key, k_out, k_out, positions)
    kc = key_cache.stride() if store else (0,) * 4
    vc = value_cache.stride() if store else (0,) * 4
    pdl = pdl_enabled(key.device)
    _qk_norm_rope_kernel[grid](
        q,
        key,
        qo,
        k_out,
        q_w,
        k_w,
        positions,
        cos_cache,
        sin_cache,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        q.stride(0),
        q.stride(1),
        key.stride(0),
        key.stride(1),
        qo.stride(0),
        qo.stride(1),
        k_out.stride(0),
        k_out.stride(1),
        cos_cache.stride(0),
        sin_cache.stride(0),
        value.stride(0),
        value.stride(1),
        kc[0],
        kc[1],
        kc[2],
        vc[0],
        vc[1],
        vc[2],
        key_cache.shape[1] if store else 1,
        num_q_heads,
        num_kv_heads,
        num_q_blocks,
        half,
        head_dim,
        eps,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        HAS_Q_NORM=query is not None and q_norm_weight is not None,
        HAS_K_NORM=k_norm_weight is not None,
        STORE_KV=store is not None,
        PDL=pdl,
        num_warps=max(1, min(4, block_h * block_d // 256)),
        **launch_options(pdl),
    )
    return q_out, k_out
