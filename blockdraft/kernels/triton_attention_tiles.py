"""Device functions of the paged attention kernel (`triton_attention_kernels`): one key tile's
online-softmax step, the decode path's in-kernel merge of a GQA group's split partials, and the
q/k norm + RoPE of a tile of raw rows (the `step_kv` path).

They sit apart from the kernels so that each file reads as one level: here the per-tile maths,
there the programs that walk the block table and call it.
"""

import triton
import triton.language as tl


@triton.jit
def _attend_tile(
    acc,  # [BLOCK_M, BLOCK_D] f32 running output (unnormalised)
    m_i,  # [BLOCK_M] f32 running max (log2 domain)
    l_i,  # [BLOCK_M] f32 running sum of exponentials
    q,  # [BLOCK_M, BLOCK_D]
    q_pos,  # [BLOCK_M] int32 position of each row's query
    start,  # first key position of the tile
    hi,  # keys at or past hi are out of range
    table,  # pointer to this sequence's block-table row
    k_head,  # key cache pointer offset to this kv head
    v_head,  # value cache pointer offset to this kv head
    stride_kb,
    stride_ks,
    stride_vb,
    stride_vs,
    block_size,
    window,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    MASKED: tl.constexpr,  # False: every row sees every key of the tile, all in range
    INPUT_PRECISION: tl.constexpr,
):
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    key_pos = start + offs_n  # [BLOCK_N]
    key_ok = key_pos < hi
    # Per-key page lookup: any block_size works and tiles need not align with pages.
    if MASKED:
        page = tl.load(table + key_pos // block_size, mask=key_ok, other=0).to(tl.int64)
    else:
        page = tl.load(table + key_pos // block_size).to(tl.int64)
    in_page = (key_pos % block_size).to(tl.int64)
    k_ptrs = k_head + (page * stride_kb + in_page * stride_ks)[None, :] + offs_d[:, None]
    v_ptrs = v_head + (page * stride_vb + in_page * stride_vs)[:, None] + offs_d[None, :]
    # Unmasked loads where nothing can be out of range: full tiles of a full head_dim.
    if MASKED:
        k = tl.load(k_ptrs, mask=key_ok[None, :] & d_ok[:, None], other=0.0)
    elif EVEN_D:
        k = tl.load(k_ptrs)
    else:
        k = tl.load(k_ptrs, mask=d_ok[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
    s = tl.dot(q, k.to(q.dtype), input_precision=INPUT_PRECISION) * qk_scale
    if MASKED:
        # Rows past the sequence's queries are left unmasked: they stay finite and are never
        # stored.
        visible = key_ok[None, :]
        if CAUSAL:
            visible = visible & (key_pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            visible = visible & (q_pos[:, None] - key_pos[None, :] < window)
            if not CAUSAL:
                visible = visible & (key_pos[None, :] - q_pos[:, None] < window)
        s = tl.where(visible, s, float("-inf"))  # [BLOCK_M, BLOCK_N]
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if MASKED:
        v = tl.load(v_ptrs, mask=key_ok[:, None] & d_ok[None, :], other=0.0)
    elif EVEN_D:
        v = tl.load(v_ptrs)
    else:
        v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
    acc = acc * alpha[:, None] + tl.dot(
        p.to(q.dtype), v.to(q.dtype), input_precision=INPUT_PRECISION
    )
    return acc, m_new, l_i


@triton.jit
def _merge_decode_group(
    part_out_ptr,  # [num_tokens, num_heads, num_splits, head_dim] f32
    part_max_ptr,  # [num_tokens, num_heads, num_splits] f32 (log2 domain)
    part_sum_ptr,  # [num_tokens, num_heads, num_splits] f32
    out_ptr,  # [num_tokens, num_heads, head_dim]
    row,  # int64 flat token index of the sequence's one query row
    kv_head,
    num_heads,
    num_splits,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_S: tl.constexpr,  # >= num_splits: one pass
):
    """The reduce kernel's merge for the GQA group's heads of one decode row, all splits at
    once: [group, splits, head_dim] partials, loaded past L1 (other SMs wrote them)."""
    BLOCK_G: tl.constexpr = triton.next_power_of_2(GROUP)
    offs_g = tl.arange(0, BLOCK_G)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    head = kv_head * GROUP + offs_g  # [G]
    g_ok = offs_g < GROUP
    d_ok = offs_d < HEAD_DIM
    ok = g_ok[:, None] & (offs_s < num_splits)[None, :]  # [G, S]
    part = (row * num_heads + head)[:, None] * num_splits + offs_s[None, :]  # [G, S]
    # Masked entries weigh nothing: max -1e30 (as an empty split reports), sum 0, output 0.
    m = tl.load(part_max_ptr + part, mask=ok, other=-1.0e30, cache_modifier=".cg")
    w = tl.exp2(m - tl.max(m, axis=1)[:, None])  # [G, S]
    total = tl.sum(tl.load(part_sum_ptr + part, mask=ok, other=0.0, cache_modifier=".cg") * w, 1)
    o = tl.load(
        part_out_ptr + part[:, :, None] * HEAD_DIM + offs_d[None, None, :],
        mask=ok[:, :, None] & d_ok[None, None, :],
        other=0.0,
        cache_modifier=".cg",
    )  # [G, S, D]
    out = tl.sum(o * w[:, :, None], axis=1) / tl.where(total > 0.0, total, 1.0)[:, None]
    tl.store(
        out_ptr + row * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=g_ok[:, None] & d_ok[None, :],
    )


@triton.jit
def _norm_rope_rows(
    row_ptrs,  # [R] pointers to each row's first element (one head of one token)
    row_ok,  # [R] bool
    w_ptr,  # [head_dim] norm weight; read when HAS_NORM
    cos,  # [R or 1, BLOCK_D] f32, each row's angles (i and i + head_dim / 2 share one)
    sin,  # [R or 1, BLOCK_D] f32
    eps,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_NORM: tl.constexpr,
):  # [R, BLOCK_D] in the rows' dtype
    """`triton_rope`'s per-head RMSNorm and rotate-half RoPE on whole rows, with the same
    roundings: each dimension's rotation partner (i +- head_dim / 2) is loaded as a second
    tile, so y = x * cos - partner * sin below half and x * cos + partner * sin above."""
    HALF: tl.constexpr = HEAD_DIM // 2
    offs_d = tl.arange(0, BLOCK_D)
    partner = tl.where(offs_d < HALF, offs_d + HALF, offs_d - HALF)
    d_ok = offs_d < HEAD_DIM
    ok = row_ok[:, None] & d_ok[None, :]
    ty = row_ptrs.dtype.element_ty
    x = tl.load(row_ptrs[:, None] + offs_d[None, :], mask=ok, other=0.0).to(tl.float32)
    xp = tl.load(row_ptrs[:, None] + partner[None, :], mask=ok, other=0.0).to(tl.float32)
    if HAS_NORM:
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)[:, None]
        w = tl.load(w_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        wp = tl.load(w_ptr + partner, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        x = ((x * rstd).to(ty).to(tl.float32) * w).to(ty).to(tl.float32)
        xp = ((xp * rstd).to(ty).to(tl.float32) * wp).to(ty).to(tl.float32)
    sign = tl.where(offs_d < HALF, -1.0, 1.0)
    return (x * cos + sign[None, :] * (xp * sin)).to(ty)


@triton.jit
def _angles(
    table_ptr,  # [max_position, head_dim / 2] f32 (cos or sin)
    pos,  # [R] int positions
    ok,  # [R] bool
    stride,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # [R, BLOCK_D] f32: dimension i and i + head_dim / 2 take angle i
    offs_d = tl.arange(0, BLOCK_D)
    mask = ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    cols = (offs_d % (HEAD_DIM // 2))[None, :]
    return tl.load(table_ptr + pos[:, None] * stride + cols, mask=mask, other=0.0).to(tl.float32)
