"""Fused q/k RMSNorm + rotary embedding: one launch for the query and key heads of all tokens.

`qk_norm_rope_torch` (in `blockdraft.kernels.rope`) is the specification: per head, RMSNorm in
float32 rounded back to the activation dtype and scaled by the weight (rounded to the dtype
torch promotion gives), then rotate-half RoPE in float32 rounded back to that dtype. The eager
version costs about a dozen launches per tensor (gathers, casts, chunk, muls, cat); a decode
step runs it twice per layer, where the launches, not the bytes, are the cost.

Two modes serve Qwen3.5 / Qwen3-Next's full-attention layers (`GatedSelfAttention`):
`norm_offset` takes the norm weights as offsets from one (`OffsetRMSNorm`: the scale `1 + weight`
applied in float32, one rounding to the activation dtype, which is also the output dtype), and
a cos/sin table narrower than the head (`[max_position, rotary_dim / 2]`, partial rotary)
rotates the first rotary_dim dimensions alone (i pairs with i + rotary_dim / 2) while the rest
of the head passes through, normed. Neither changes a thing for full rotary and plain norms.

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
def _norm_tile(
    x,  # [BLOCK_H, width] float32, one tile of the heads' dimensions
    rstd,  # [BLOCK_H] float32
    w_ptr,  # the weights of the tile's dimensions
    offs,  # [width] the tile's dimensions, relative to w_ptr
    ok_w,  # [width] the dimensions that exist
    in_ty: tl.constexpr,  # the activation dtype
    out_ty: tl.constexpr,  # the output dtype
    NORM_OFFSET: tl.constexpr,
):
    w = tl.load(w_ptr + offs, mask=ok_w, other=0.0).to(tl.float32)
    x = x * rstd[:, None]
    if NORM_OFFSET:
        # OffsetRMSNorm: the scale 1 + weight in float32 and a single rounding.
        x = x * (1.0 + w[None, :])
    else:
        # The same roundings as the eager norm (to the activation dtype, then weight * x to the
        # promoted one), so the rotation sees the very values the torch path rotates.
        x = x.to(in_ty).to(tl.float32) * w[None, :]
    return x.to(out_ty).to(tl.float32)


@triton.jit
def _norm_rope_heads(
    x_ptr,  # this token's first head, [num_heads, head_dim] with row stride stride_xh
    out_ptr,  # this token's first output head, row stride stride_oh
    w_ptr,  # [head_dim]; read when HAS_NORM
    stride_xh,
    stride_oh,
    head0,
    num_heads,
    cos,  # [BLOCK_D] float32, this token's angles (zero past half)
    sin,
    half,  # rotary_dim / 2: dimension i pairs with i + half
    rotary_dim,
    head_dim,
    eps,
    cache_ptr,  # this token's cache slot, [num_heads, head_dim] with row stride stride_ch
    stride_ch,
    cache_write,  # scalar bool: the slot is real (not PAD); read when STORE
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr,  # the pass-through tile (dimensions rotary_dim..head_dim)
    HAS_NORM: tl.constexpr,
    NORM_OFFSET: tl.constexpr,  # the norm weight is an offset from one (OffsetRMSNorm)
    PARTIAL: tl.constexpr,  # rotary_dim < head_dim: a third tile passes through unrotated
    STORE: tl.constexpr,  # also write the rotated heads into the cache slot
):
    heads = head0 + tl.arange(0, BLOCK_H)
    offs = tl.arange(0, BLOCK_D)
    ok_h = heads < num_heads
    ok_d = offs < half
    ok = ok_h[:, None] & ok_d[None, :]
    x_rows = x_ptr + heads[:, None] * stride_xh + offs[None, :]
    # Rotate-half pairs dimension i with i + rotary_dim/2: load the two halves as two tiles.
    x1 = tl.load(x_rows, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(x_rows + half, mask=ok, other=0.0).to(tl.float32)
    if PARTIAL:
        offs_p = rotary_dim + tl.arange(0, BLOCK_P)
        ok_p = offs_p < head_dim
        ok3 = ok_h[:, None] & ok_p[None, :]
        x3 = tl.load(x_ptr + heads[:, None] * stride_xh + offs_p[None, :], mask=ok3, other=0.0)
        x3 = x3.to(tl.float32)
    out_ty = out_ptr.dtype.element_ty
    if HAS_NORM:
        in_ty = x_ptr.dtype.element_ty
        sum_sq = tl.sum(x1 * x1 + x2 * x2, axis=1)
        if PARTIAL:
            sum_sq += tl.sum(x3 * x3, axis=1)
        rstd = 1.0 / tl.sqrt(sum_sq / head_dim + eps)
        x1 = _norm_tile(x1, rstd, w_ptr, offs, ok_d, in_ty, out_ty, NORM_OFFSET)
        x2 = _norm_tile(x2, rstd, w_ptr + half, offs, ok_d, in_ty, out_ty, NORM_OFFSET)
        if PARTIAL:
            x3 = _norm_tile(x3, rstd, w_ptr, offs_p, ok_p, in_ty, out_ty, NORM_OFFSET)
    cos = cos[None, :]
    sin = sin[None, :]
    y1 = (x1 * cos - x2 * sin).to(out_ty)
    y2 = (x2 * cos + x1 * sin).to(out_ty)
    out_rows = out_ptr + heads[:, None] * stride_oh + offs[None, :]
    tl.store(out_rows, y1, mask=ok)
    tl.store(out_rows + half, y2, mask=ok)
    if PARTIAL:
        y3 = x3.to(out_ty)  # normed (and rounded) already, or the input as it was
        tl.store(out_ptr + heads[:, None] * stride_oh + offs_p[None, :], y3, mask=ok3)
    if STORE:
        # The cache holds the returned keys cast to its dtype, as `store_kv` writes them.
        cache_ty = cache_ptr.dtype.element_ty
        cache_rows = cache_ptr + heads[:, None] * stride_ch + offs[None, :]
        tl.store(cache_rows, y1.to(cache_ty), mask=ok & cache_write)
        tl.store(cache_rows + half, y2.to(cache_ty), mask=ok & cache_write)
        if PARTIAL:
            cache_p = cache_ptr + heads[:, None] * stride_ch + offs_p[None, :]
            tl.store(cache_p, y3.to(cache_ty), mask=ok3 & cache_write)


@triton.jit
def _copy_heads(
    x_ptr,  # this token's first head, [num_heads, head_dim] with row stride stride_xh
    cache_ptr,  # this token's cache slot, [num_heads, head_dim] with row stride stride_ch
    stride_xh,
    stride_ch,
    head0,
    num_heads,
    half,  # rotary_dim / 2
    rotary_dim,
    head_dim,
    cache_write,  # scalar bool: the slot is real (not PAD)
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr,
    PARTIAL: tl.constexpr,
):
    # The same tiles as the rotation (two halves and the pass-through), so one program covers
    # the whole head.
    heads = head0 + tl.arange(0, BLOCK_H)
    offs = tl.arange(0, BLOCK_D)
    ok_h = (heads < num_heads)[:, None] & cache_write
    ok = ok_h & (offs < half)[None, :]
    x_rows = x_ptr + heads[:, None] * stride_xh + offs[None, :]
    cache_rows = cache_ptr + heads[:, None] * stride_ch + offs[None, :]
    cache_ty = cache_ptr.dtype.element_ty
    tl.store(cache_rows, tl.load(x_rows, mask=ok).to(cache_ty), mask=ok)
    tl.store(cache_rows + half, tl.load(x_rows + half, mask=ok).to(cache_ty), mask=ok)
    if PARTIAL:
        offs_p = rotary_dim + tl.arange(0, BLOCK_P)
        ok3 = ok_h & (offs_p < head_dim)[None, :]
        x_p = tl.load(x_ptr + heads[:, None] * stride_xh + offs_p[None, :], mask=ok3)
        tl.store(
            cache_ptr + heads[:, None] * stride_ch + offs_p[None, :], x_p.to(cache_ty), mask=ok3
        )


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr,  # [num_tokens, num_q_heads, head_dim], last dim contiguous
    k_ptr,  # [num_tokens, num_kv_heads, head_dim]
    q_out_ptr,  # [num_tokens, num_q_heads, head_dim]
    k_out_ptr,  # [num_tokens, num_kv_heads, head_dim]
    q_w_ptr,  # [head_dim]; read when HAS_Q_NORM
    k_w_ptr,  # [head_dim]; read when HAS_K_NORM
    positions_ptr,  # [num_tokens] int64
    cos_ptr,  # [max_position, rotary_dim / 2] float32
    sin_ptr,  # [max_position, rotary_dim / 2] float32
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
    half,  # rotary_dim / 2
    rotary_dim,
    head_dim,
    eps,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr,  # the pass-through tile; used when PARTIAL
    HAS_Q_NORM: tl.constexpr,
    HAS_K_NORM: tl.constexpr,
    NORM_OFFSET: tl.constexpr,  # norm weights are offsets from one (OffsetRMSNorm)
    PARTIAL: tl.constexpr,  # rotary_dim < head_dim
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
            rotary_dim,
            head_dim,
            eps,
            q_out_ptr,  # no cache for queries
            0,
            False,
            BLOCK_H,
            BLOCK_D,
            BLOCK_P,
            HAS_Q_NORM,
            NORM_OFFSET,
            PARTIAL,
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
                rotary_dim,
                head_dim,
                write,
                BLOCK_H,
                BLOCK_D,
                BLOCK_P,
                PARTIAL,
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
            rotary_dim,
            head_dim,
            eps,
            k_cache,
            stride_kch,
            write,
            BLOCK_H,
            BLOCK_D,
            BLOCK_P,
            HAS_K_NORM,
            NORM_OFFSET,
            PARTIAL,
            STORE_KV,
        )


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    # Heads sliced from a fused projection (or a query beside its output gate) keep arbitrary
    # token/head strides; the kernel only needs unit stride along head_dim.
    return x if x.stride(-1) == 1 else x.contiguous()


def _out_like(x: torch.Tensor, weight: torch.Tensor | None, norm_offset: bool) -> torch.Tensor:
    # The plain norm's weight * x promotes; the offset norm rounds to x's dtype.
    promote = weight is not None and not norm_offset
    dtype = torch.promote_types(weight.dtype, x.dtype) if promote else x.dtype
    return torch.empty(x.shape, dtype=dtype, device=x.device)


def triton_qk_norm_rope(
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
        norm_offset,
        None,
        block_h,
    )


def triton_qk_norm_rope_store(
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
    slot_mapping: torch.Tensor,  # [num_tokens] int64, PAD_SLOT_ID rows write nothing
    *,
    norm_offset: bool = False,  # the norm weights are offsets from one (OffsetRMSNorm)
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
        norm_offset,
        store,
        block_h,
    )


def _launch(
    query: torch.Tensor | None,  # [num_tokens, num_heads, head_dim]; None: keys only
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    positions: torch.Tensor,  # [num_tokens] int64
    cos_cache: torch.Tensor,  # [max_position, rotary_dim / 2] float32
    sin_cache: torch.Tensor,  # [max_position, rotary_dim / 2] float32
    q_norm_weight: torch.Tensor | None,  # [head_dim]; None: no q/k norm (Llama)
    k_norm_weight: torch.Tensor | None,  # [head_dim]
    eps: float,
    norm_offset: bool,  # the norm weights are offsets from one (OffsetRMSNorm)
    # (value, key_cache, value_cache, slot_mapping), checked by the caller; None: no store
    store: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None,
    block_h: int | None,  # heads per program; None: a tile of about 2048 elements
) -> tuple[torch.Tensor | None, torch.Tensor]:  # new (query, key), contiguous
    num_tokens, num_kv_heads, head_dim = key.shape
    # The table's width says how much of each head rotates (partial_rotary_factor).
    rotary_dim = 2 * cos_cache.shape[1]
    if not 0 < rotary_dim <= head_dim or sin_cache.shape != cos_cache.shape:
        raise ValueError(
            f"cos/sin tables {tuple(cos_cache.shape)}, {tuple(sin_cache.shape)} do not rotate "
            f"(part of) an even-sized head of {head_dim}"
        )
    key = _rows_contiguous(key)
    k_out = _out_like(key, k_norm_weight, norm_offset)
    num_q_heads = 0
    q_out = None
    if query is not None:
        if query.shape[0] != num_tokens or query.shape[2] != head_dim:
            raise ValueError(f"query {tuple(query.shape)} does not match key {tuple(key.shape)}")
        query = _rows_contiguous(query)
        q_out = _out_like(query, q_norm_weight, norm_offset)
        num_q_heads = query.shape[1]
    if num_tokens == 0:
        return q_out, k_out
    half = rotary_dim // 2
    block_d = triton.next_power_of_2(half)
    partial = rotary_dim < head_dim
    block_p = triton.next_power_of_2(head_dim - rotary_dim) if partial else 1
    width = 2 * block_d + (block_p if partial else 0)  # a head's lanes, padding included
    if block_h is None:
        fit = max(1, 2048 // width)
        fit = 1 << (fit.bit_length() - 1)  # heads per program: a power of two
        block_h = min(triton.next_power_of_2(max(num_q_heads, num_kv_heads)), fit)
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
        rotary_dim,
        head_dim,
        eps,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        BLOCK_P=block_p,
        HAS_Q_NORM=query is not None and q_norm_weight is not None,
        HAS_K_NORM=k_norm_weight is not None,
        NORM_OFFSET=norm_offset,
        PARTIAL=partial,
        STORE_KV=store is not None,
        PDL=pdl,
        num_warps=max(1, min(4, block_h * width // 512)),
        **launch_options(pdl),
    )
    return q_out, k_out
