"""Paged attention in Triton; same contract as `blockdraft.kernels.paged_attention`.

One kernel serves every batch shape the engine produces: prefill chunks, decode rows of 1,
verify blocks of 1+N causal rows and the DFlash drafter's non-causal blocks, mixed freely in
one flat batch. A program owns a tile of query rows of one sequence and all query heads that
share one kv head: packing the GQA group into the tile's rows means a single decode row still
fills a 16-row tensor-core tile, and each key/value tile read from the paged cache serves the
whole group. Keys are streamed through the block table with an online softmax.

Long contexts with few query rows leave most of the GPU idle (num_seqs x num_kv_heads
programs); split-K then cuts each sequence's key range into `num_splits` pieces whose partial
(unnormalised output, running max, running sum of exponentials) are merged by a second kernel,
or, for decode rows (one query row per sequence, at most DECODE_MERGE_MAX_SPLITS splits), by
the attention kernel itself: each program counts itself done on a per-(sequence, kv head)
counter and the last one merges the group's partials (no second launch on the decode path).

A launch whose sequences' query rows each fit one tile (decode, by default only decode:
KernelPolicy.rope_in_attention_max_query_len) can also take the step's q/k/v raw (`step_kv`, through
`triton_rope_store_attention`): each program norms and rotates its queries, and stores the
step's keys (normed, rotated) and values whose positions fall in its key range before reading
its keys, which saves the RoPE kernel's launch.

Only meta's python ints (max_query_len, max_seq_len) and tensor shapes steer the launch, so
the call never waits on the device and can be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from blockdraft.kernels.forward_context import AttentionMetadata, current_kernel_policy
from blockdraft.kernels.pdl import launch_options, num_sms, pdl_enabled, pdl_start
from blockdraft.kernels.triton_rope import triton_qk_norm_rope_store

_LOG2E = 1.4426950408889634


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


# Runtime sizes are not specialised (Triton compiles values of 1 and multiples of 16 apart):
# an eager call whose block-table width or split count crosses one must not compile mid-serving.
@triton.jit(do_not_specialize=["stride_bt", "tiles_per_seq", "num_splits"])
def _paged_attention_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    out_ptr,  # [num_tokens, num_heads, head_dim]; written when not SPLIT
    part_out_ptr,  # [num_tokens, num_heads, num_splits, head_dim] f32; written when SPLIT
    part_max_ptr,  # [num_tokens, num_heads, num_splits] f32 (log2 domain)
    part_sum_ptr,  # [num_tokens, num_heads, num_splits] f32
    counters_ptr,  # [>= num_seqs * num_kv_heads] int32, zero between launches; with MERGE
    k_new_ptr,  # [num_tokens, num_kv_heads, head_dim] this step's keys, raw; with ROPE
    v_new_ptr,  # [num_tokens, num_kv_heads, head_dim] this step's values; with ROPE
    positions_ptr,  # [num_tokens] int64; with ROPE
    cos_ptr,  # [max_position, head_dim / 2] f32; with ROPE
    sin_ptr,  # [max_position, head_dim / 2] f32; with ROPE
    q_w_ptr,  # [head_dim] q norm weight; with ROPE and HAS_QK_NORM
    k_w_ptr,  # [head_dim] k norm weight; with ROPE and HAS_QK_NORM
    slot_mapping_ptr,  # [num_tokens] int, negative (PAD_SLOT_ID) = store nothing; with ROPE
    query_start_loc_ptr,  # [num_seqs + 1] int
    seq_lens_ptr,  # [num_seqs] int
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_bt,
    stride_knt,
    stride_knh,
    stride_vnt,
    stride_vnh,
    stride_cos,
    stride_sin,
    num_heads,
    tiles_per_seq,
    num_splits,
    block_size,
    window,
    qk_scale,  # softmax scale * log2(e): the kernel works with exp2
    eps,  # of the q/k norms; with ROPE and HAS_QK_NORM
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per kv head
    CAUSAL: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    SPLIT: tl.constexpr,
    MERGE: tl.constexpr,  # with SPLIT, one query row a sequence: the last split merges
    MERGE_SPLITS: tl.constexpr,  # with MERGE: DECODE_MERGE_MAX_SPLITS (one compile for all)
    ROPE: tl.constexpr,  # q raw: norm + rotate it, store the step's k/v (one tile a sequence)
    ONE_ROW: tl.constexpr,  # with ROPE: one query row a sequence (decode)
    HAS_QK_NORM: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch (blockdraft.kernels.pdl)
):
    pdl_start(PDL)
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = pid // tiles_per_seq
    tile = pid % tiles_per_seq
    # Rows of the tile are (query token, head of the group) pairs, token-major.
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP

    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    q_len = (tl.load(query_start_loc_ptr + seq + 1) - q_start).to(tl.int32)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    first_tok = tile * BLOCK_Q
    # The grid is sized by max_query_len, so shorter sequences own tiles with nothing to do.
    if first_tok >= q_len:
        return

    offs_m = tl.arange(0, BLOCK_M)
    tok = first_tok + offs_m // GROUP  # [BLOCK_M] query row within the sequence
    head = kv_head * GROUP + offs_m % GROUP  # [BLOCK_M]
    row_ok = (offs_m < BLOCK_Q * GROUP) & (tok < q_len)
    q_pos = seq_len - q_len + tok  # [BLOCK_M]
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    row = q_start + tok  # [BLOCK_M] flat token index

    if ROPE:
        if ONE_ROW:  # every row of the tile is the same token: one gather of its angles
            one = tl.zeros([1], dtype=tl.int64)
            pos = tl.load(positions_ptr + q_start + one)
            cos = _angles(cos_ptr, pos, one == 0, stride_cos, HEAD_DIM, BLOCK_D)  # [1, BLOCK_D]
            sin = _angles(sin_ptr, pos, one == 0, stride_sin, HEAD_DIM, BLOCK_D)
        else:
            pos = tl.load(positions_ptr + row, mask=row_ok, other=0)
            cos = _angles(cos_ptr, pos, row_ok, stride_cos, HEAD_DIM, BLOCK_D)  # [BLOCK_M, D]
            sin = _angles(sin_ptr, pos, row_ok, stride_sin, HEAD_DIM, BLOCK_D)
        q = _norm_rope_rows(
            q_ptr + row * stride_qt + head * stride_qh, row_ok, q_w_ptr, cos, sin, eps,
            HEAD_DIM, BLOCK_D, HAS_QK_NORM,
        )  # fmt: skip
    else:
        q = tl.load(
            q_ptr + row[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_D]

    # Key range this tile can see at all; tiles wholly outside it are never loaded.
    first_pos = seq_len - q_len + first_tok
    last_pos = seq_len - q_len + tl.minimum(first_tok + BLOCK_Q, q_len) - 1
    lo = 0
    hi = seq_len
    if CAUSAL:
        hi = last_pos + 1
    if USE_WINDOW:
        lo = tl.maximum(first_pos - window + 1, 0)
        if not CAUSAL:
            hi = tl.minimum(hi, last_pos + window)
    if SPLIT:
        # Whole key tiles per split, so no split starts mid-tile; trailing splits may be empty
        # and then report (max=-1e30, sum=0), which the merge weighs as nothing.
        tiles_per_split = tl.cdiv(tl.cdiv(hi - lo, BLOCK_N), num_splits)
        lo = lo + split * tiles_per_split * BLOCK_N
        hi = tl.minimum(hi, lo + tiles_per_split * BLOCK_N)

    if ROPE:
        # The sequence's step keys (all in this tile: first_tok is 0; decode has one, at
        # seq_len - 1) whose positions fall in this program's key range: normed, rotated and
        # stored with their values before any key is read (the barrier).
        KEYS: tl.constexpr = 1 if ONE_ROW else triton.next_power_of_2(BLOCK_Q)
        kt = tl.arange(0, KEYS)
        key_pos = seq_len - q_len + kt
        slots = tl.load(slot_mapping_ptr + q_start + kt, mask=kt < q_len, other=-1).to(tl.int64)
        write = (kt < q_len) & (key_pos >= lo) & (key_pos < hi) & (slots >= 0)
        if ONE_ROW:  # the query's own angles
            k_cos = cos
            k_sin = sin
        else:
            kpos = tl.load(positions_ptr + q_start + kt, mask=write, other=0)
            k_cos = _angles(cos_ptr, kpos, write, stride_cos, HEAD_DIM, BLOCK_D)
            k_sin = _angles(sin_ptr, kpos, write, stride_sin, HEAD_DIM, BLOCK_D)
        new_k = _norm_rope_rows(
            k_new_ptr + (q_start + kt) * stride_knt + kv_head * stride_knh, write, k_w_ptr,
            k_cos, k_sin, eps, HEAD_DIM, BLOCK_D, HAS_QK_NORM,
        )  # [KEYS, BLOCK_D] fmt: skip
        slots = tl.where(write, slots, 0)
        page = slots // block_size
        in_page = slots % block_size
        ok = write[:, None] & d_ok[None, :]
        k_dst = k_cache_ptr + page * stride_kb + in_page * stride_ks + kv_head * stride_kh
        tl.store(k_dst[:, None] + offs_d[None, :], new_k.to(k_cache_ptr.dtype.element_ty), mask=ok)
        v_src = v_new_ptr + (q_start + kt) * stride_vnt + kv_head * stride_vnh
        v_dst = v_cache_ptr + page * stride_vb + in_page * stride_vs + kv_head * stride_vh
        new_v = tl.load(v_src[:, None] + offs_d[None, :], mask=ok)
        tl.store(v_dst[:, None] + offs_d[None, :], new_v.to(v_cache_ptr.dtype.element_ty), mask=ok)
        tl.debug_barrier()

    # Tiles where every row sees every key skip the mask: with causal prefill and long cached
    # contexts that is nearly all of them. Full tiles are tiles [lo + i0 * BLOCK_N,
    # lo + i1 * BLOCK_N); tiles before and after them (diagonal, window edge, ragged end)
    # are masked.
    full_lo = lo
    full_hi = hi
    if CAUSAL:
        full_hi = tl.minimum(full_hi, first_pos + 1)
    if USE_WINDOW:
        full_lo = tl.maximum(full_lo, last_pos - window + 1)
        if not CAUSAL:
            full_hi = tl.minimum(full_hi, first_pos + window)
    num_tiles = tl.cdiv(hi - lo, BLOCK_N)
    i0 = tl.minimum(tl.cdiv(tl.maximum(full_lo - lo, 0), BLOCK_N), num_tiles)
    i1 = tl.maximum(tl.minimum(tl.maximum(full_hi - lo, 0) // BLOCK_N, num_tiles), i0)

    # The running max starts finite, so a row whose keys are all masked so far gets
    # exp2(-inf - (-1e30)) = 0 rather than exp2(-inf + inf) = NaN.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_head = k_cache_ptr + kv_head * stride_kh
    v_head = v_cache_ptr + kv_head * stride_vh
    for i in range(0, i0):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, q_pos, lo + i * BLOCK_N, hi, table, k_head, v_head,
            stride_kb, stride_ks, stride_vb, stride_vs, block_size, window, qk_scale,
            HEAD_DIM, BLOCK_D, BLOCK_N, CAUSAL, USE_WINDOW, True, INPUT_PRECISION,
        )  # fmt: skip
    for i in range(i0, i1):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, q_pos, lo + i * BLOCK_N, hi, table, k_head, v_head,
            stride_kb, stride_ks, stride_vb, stride_vs, block_size, window, qk_scale,
            HEAD_DIM, BLOCK_D, BLOCK_N, CAUSAL, USE_WINDOW, False, INPUT_PRECISION,
        )  # fmt: skip
    for i in range(i1, num_tiles):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, q_pos, lo + i * BLOCK_N, hi, table, k_head, v_head,
            stride_kb, stride_ks, stride_vb, stride_vs, block_size, window, qk_scale,
            HEAD_DIM, BLOCK_D, BLOCK_N, CAUSAL, USE_WINDOW, True, INPUT_PRECISION,
        )  # fmt: skip

    store_ok = row_ok[:, None] & d_ok[None, :]
    if SPLIT:
        part = (row * num_heads + head) * num_splits + split  # [BLOCK_M]
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=store_ok)
        tl.store(part_max_ptr + part, m_i, mask=row_ok)
        tl.store(part_sum_ptr + part, l_i, mask=row_ok)
        if MERGE:
            # Every thread's partial stores come before the count (the barrier), which
            # releases them to the GPU; the program that counts last acquires all of them.
            tl.debug_barrier()
            counter = counters_ptr + seq * tl.num_programs(1) + kv_head
            if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
                tl.store(counter, 0)  # ready for the next launch
                _merge_decode_group(
                    part_out_ptr, part_max_ptr, part_sum_ptr, out_ptr, q_start, kv_head,
                    num_heads, num_splits, stride_ot, stride_oh, HEAD_DIM, BLOCK_D, GROUP,
                    MERGE_SPLITS,
                )  # fmt: skip
    else:
        # l_i == 0 only for a row that sees no key (never for a valid causal row).
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + row[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=store_ok,
        )


@triton.jit(do_not_specialize=["num_splits"])
def _paged_attention_reduce_kernel(
    part_out_ptr,  # [num_tokens, num_heads, num_splits, head_dim] f32
    part_max_ptr,  # [num_tokens, num_heads, num_splits] f32 (log2 domain)
    part_sum_ptr,  # [num_tokens, num_heads, num_splits] f32
    out_ptr,  # [num_tokens, num_heads, head_dim]
    stride_ot,
    stride_oh,
    num_heads,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,  # splits merged per pass: one compile serves every split count
    PDL: tl.constexpr,
):
    pdl_start(PDL)
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    base = (tok * num_heads + head) * num_splits
    # Passes of BLOCK_S splits, each rescaled to the running max as the attention kernel's
    # online softmax does; empty splits carry max -1e30, sum 0 and a zero output.
    m_run = tl.full([], float("-inf"), dtype=tl.float32)
    total = tl.zeros([], dtype=tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        s_ok = s0 + offs_s < num_splits
        part = base + s0 + offs_s  # [BLOCK_S]
        m = tl.load(part_max_ptr + part, mask=s_ok, other=float("-inf"))
        m_new = tl.maximum(m_run, tl.max(m, axis=0))
        rescale = tl.exp2(m_run - m_new)  # 0 on the first pass
        w = tl.exp2(m - m_new)  # [BLOCK_S]
        total = total * rescale + tl.sum(
            tl.load(part_sum_ptr + part, mask=s_ok, other=0.0) * w, axis=0
        )
        o = tl.load(
            part_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
            mask=s_ok[:, None] & d_ok[None, :],
            other=0.0,
        )  # [BLOCK_S, BLOCK_D]
        acc = acc * rescale + tl.sum(o * w[:, None], axis=0)
        m_run = m_new
    out = acc / tl.where(total > 0.0, total, 1.0)
    tl.store(
        out_ptr + tok * stride_ot + head * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=d_ok,
    )


def choose_num_splits(
    max_query_len: int, max_seq_len: int, num_seqs: int, num_kv_heads: int, device: torch.device
) -> int:
    """Split-K pays off when the unsplit grid leaves SMs idle and each split still streams a
    few key tiles: few query rows (decode, verify, drafter blocks) over long contexts."""
    programs = max(num_seqs * num_kv_heads, 1)
    sms = num_sms(device)
    if max_query_len > 16 or max_seq_len < 512 or programs >= sms:
        return 1
    want = -(-2 * sms // programs)  # about two waves of programs
    # Splits of one 64-key tile still pay: a batch-1 decode over 512-1k keys is otherwise a
    # handful of programs walking the keys serially (H200, Qwen3-8B shapes, attention_bench:
    # 6.3-7.6 vs 8.5-8.9 us a layer with splits of two tiles at 512-768 keys).
    return max(1, min(want, max_seq_len // 64, 64))


# 2-16 query rows (verify, drafter blocks) take 32-key tiles where a program walks at most this
# many keys (split-K over a short context); over longer walks 64-key tiles are as fast or
# faster (H200, Qwen3-8B shapes, 16 rows, 1k-16k keys, `attention_bench.py --short-split-keys`).
SHORT_SPLIT_KEYS = 256


# Splits the reduction merges per pass: 16, or 64 past 16 splits (choose_num_splits' cap), not
# the next power of two of the split count, which grows with the context: each new one would be
# a Triton compile in the middle of serving (an eager launch, e.g. a prefix-cache hit's short
# tail). Two sizes, so that long contexts still merge in one pass (passes of 16 cost 0.8-1.0 us
# a layer more at batch 1 over 4k-16k keys, 33 splits; H200, attention_bench).
REDUCE_SPLITS_PER_PASS = (16, 64)

# Decode launches (one query row a sequence) with a split counter buffer merge their splits in
# the attention kernel's last program (KernelPolicy.fuse_decode_split_merge), up to this many
# splits (all in one [group, splits, head_dim] tile, at most DECODE_MERGE_MAX_TILE elements: a
# GQA group of 4 at head_dim 128 on the kernel's 2 warps); more go to the reduce kernel.
DECODE_MERGE_MAX_SPLITS = 16
DECODE_MERGE_MAX_TILE = 8192


def _reduce_splits_per_pass(num_splits: int) -> int:
    small, large = REDUCE_SPLITS_PER_PASS
    return small if num_splits <= small else large


def _block_m(max_query_len: int, group: int) -> int:
    # Enough rows for the whole GQA group of every query of a short sequence, at least 16 for
    # tl.dot, at most 64 (128-row tiles with fp32 accumulators spill at head_dim 128).
    rows = triton.next_power_of_2(max(max_query_len * group, group, 16))
    return min(rows, max(64, triton.next_power_of_2(group)))


def _block_n(max_query_len: int, head_dim: int, keys_per_program: int) -> int:
    if keys_per_program <= SHORT_SPLIT_KEYS and 1 < max_query_len <= 16:
        return 32  # verify and drafter blocks over short splits (SHORT_SPLIT_KEYS)
    return 64 if head_dim <= 128 else 32


def _num_warps(block_m: int, block_d: int) -> int:
    # A decode query's 16-row GQA tile on 2 warps: 10-21% faster than 4 warps at 1k-16k keys
    # and batch 1-32 (H200, attention_bench).
    if block_m <= 16:
        return 2
    return 4 if block_m * block_d <= 64 * 128 else 8


class StepKV(NamedTuple):
    """A step's raw keys and values and what norms, rotates and stores them (and norms and
    rotates the raw queries): `triton_paged_attention`'s `step_kv`."""

    key: torch.Tensor  # [num_tokens, num_kv_heads, head_dim], before norm and RoPE
    value: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    positions: torch.Tensor  # [num_tokens] int64
    cos_cache: torch.Tensor  # [max_position, head_dim / 2] float32
    sin_cache: torch.Tensor  # [max_position, head_dim / 2] float32
    q_norm_weight: torch.Tensor | None  # [head_dim]; None: no q/k norm (Llama)
    k_norm_weight: torch.Tensor | None  # [head_dim]
    eps: float
    slot_mapping: torch.Tensor  # [num_tokens] int64, PAD_SLOT_ID rows store nothing


def triton_paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    causal: bool = True,
    window: int | None = None,
    *,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim], written in place
    num_splits: int | None = None,  # None: choose_num_splits; 1 disables split-K
    block_m: int | None = None,  # launch overrides (tests, tuning); None picks by shape
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    split_counters: torch.Tensor | None = None,  # [n] int32 zeros, kept between launches
    step_kv: StepKV | None = None,  # query is raw, the step not yet stored: see below
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Paged attention (the `paged_attention` contract). `split_counters` lets a split decode
    launch merge its splits itself (see the module doc): an int32 buffer of at least
    num_seqs * num_kv_heads zeros that only this function touches and leaves zeroed.

    With `step_kv` (each sequence's query rows in one tile, one dtype for queries, keys and
    norm weights), the query is taken before its q norm and RoPE and the step's keys and values
    are not in the cache yet: the kernel norms and rotates both as `triton_qk_norm_rope_store`
    does and stores the keys and values first (`triton_rope_store_attention`'s fused path)."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} kv heads")
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    num_seqs = meta.num_seqs
    if num_tokens == 0 or num_seqs == 0 or meta.max_query_len == 0:
        return out
    if query.stride(2) != 1:
        query = query.contiguous()
    if key_cache.stride(3) != 1 or value_cache.stride(3) != 1 or out.stride(2) != 1:
        raise ValueError("key_cache, value_cache and out need a contiguous head_dim")

    if step_kv is not None:
        _check_step_kv(query, key_cache, step_kv)
    block_m = block_m or _block_m(meta.max_query_len, group)
    if block_m < group:
        raise ValueError(f"block_m {block_m} cannot hold a GQA group of {group}")
    block_q = block_m // group
    tiles_per_seq = -(-meta.max_query_len // block_q)
    if step_kv is not None and tiles_per_seq != 1:
        raise ValueError(f"step_kv needs each sequence's {meta.max_query_len} query rows in one "
                         f"tile of {block_q}")  # fmt: skip
    if num_splits is None:
        num_splits = (
            choose_num_splits(
                meta.max_query_len, meta.max_seq_len, num_seqs, num_kv_heads, query.device
            )
            if tiles_per_seq == 1
            else 1
        )
    split = num_splits > 1
    keys_per_program = -(-meta.max_seq_len // num_splits)  # at most: max_seq_len is a bound
    block_n = block_n or _block_n(meta.max_query_len, head_dim, keys_per_program)
    if split:
        part_out = torch.empty(
            (num_tokens, num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device
        )
        part_max = torch.empty(
            (num_tokens, num_heads, num_splits), dtype=torch.float32, device=query.device
        )
        part_sum = torch.empty_like(part_max)
    else:
        part_out = part_max = part_sum = out  # unused by the unsplit kernel
    block_d = max(16, triton.next_power_of_2(head_dim))
    merge = (
        split
        and current_kernel_policy().fuse_decode_split_merge
        and meta.max_query_len == 1
        and num_splits <= DECODE_MERGE_MAX_SPLITS
        and triton.next_power_of_2(group) * DECODE_MERGE_MAX_SPLITS * block_d
        <= DECODE_MERGE_MAX_TILE
        and split_counters is not None
        and split_counters.dtype == torch.int32
        and split_counters.numel() >= num_seqs * num_kv_heads
    )
    # fp32 inputs mean a test or a debugging run asking for exact maths, not TF32.
    precision = "ieee" if query.dtype == torch.float32 else "tf32"
    grid = (num_seqs * tiles_per_seq, num_kv_heads, num_splits)
    pdl = pdl_enabled(query.device)
    # Without step_kv the kernel never reads these: any tensors will do.
    kv = step_kv or StepKV(key_cache, value_cache, meta.seq_lens, out, out, None, None, 0.0,
                           meta.seq_lens)  # fmt: skip
    q_w = kv.q_norm_weight if kv.q_norm_weight is not None else query
    k_w = kv.k_norm_weight if kv.k_norm_weight is not None else query
    _paged_attention_kernel[grid](
        query,
        key_cache,
        value_cache,
        out,
        part_out,
        part_max,
        part_sum,
        split_counters if merge else meta.seq_lens,  # unused without MERGE
        kv.key,
        kv.value,
        kv.positions,
        kv.cos_cache,
        kv.sin_cache,
        q_w,
        k_w,
        kv.slot_mapping,
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_tables,
        query.stride(0),
        query.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        out.stride(0),
        out.stride(1),
        meta.block_tables.stride(0),
        kv.key.stride(0),
        kv.key.stride(1),
        kv.value.stride(0),
        kv.value.stride(1),
        kv.cos_cache.stride(0),
        kv.sin_cache.stride(0),
        num_heads,
        tiles_per_seq,
        num_splits,
        meta.block_size,
        window or 0,
        scale * _LOG2E,
        kv.eps,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        GROUP=group,
        CAUSAL=causal,
        USE_WINDOW=window is not None,
        SPLIT=split,
        MERGE=merge,
        MERGE_SPLITS=DECODE_MERGE_MAX_SPLITS if merge else 1,
        ROPE=step_kv is not None,
        ONE_ROW=meta.max_query_len == 1,
        HAS_QK_NORM=kv.q_norm_weight is not None,
        INPUT_PRECISION=precision,
        PDL=pdl,
        num_warps=num_warps or _num_warps(block_m, block_d),
        num_stages=num_stages or 2,
        **launch_options(pdl),
    )
    if split and not merge:
        _paged_attention_reduce_kernel[(num_tokens, num_heads)](
            part_out,
            part_max,
            part_sum,
            out,
            out.stride(0),
            out.stride(1),
            num_heads,
            num_splits,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_S=_reduce_splits_per_pass(num_splits),
            PDL=pdl,
            num_warps=1 if block_d <= 64 else 2,
            **launch_options(pdl),
        )
    return out


def _step_kv_problem(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
) -> str | None:
    """What keeps the attention kernel from norming, rotating and storing this step itself
    (`step_kv`), or None."""
    if query.shape[-1] % 2 or any(t.stride(-1) != 1 for t in (query, key, value)):
        return "RoPE needs an even, contiguous head_dim"
    if (q_norm_weight is None) != (k_norm_weight is None):
        return "q and k norms come together"
    weights = [w for w in (q_norm_weight, k_norm_weight) if w is not None]
    if any(t.dtype != query.dtype for t in (key, value, *weights)):
        return "step_kv needs one dtype for queries, keys, values and norm weights"
    return None


def _check_step_kv(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    kv: StepKV,
) -> None:
    num_tokens, _, head_dim = query.shape
    expected = (num_tokens, key_cache.shape[2], head_dim)
    if kv.key.shape != expected or kv.value.shape != expected:
        raise ValueError(f"step keys {tuple(kv.key.shape)} / values {tuple(kv.value.shape)} "
                         f"are not {expected}")  # fmt: skip
    problem = _step_kv_problem(query, kv.key, kv.value, kv.q_norm_weight, kv.k_norm_weight)
    if problem:
        raise ValueError(problem)
    if kv.slot_mapping.shape != (num_tokens,) or kv.positions.shape != (num_tokens,):
        raise ValueError("slot_mapping and positions need one entry per token")


def rope_fits_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], raw
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], raw
    value: torch.Tensor,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    meta: AttentionMetadata,
) -> bool:
    """Whether the attention kernel can norm, rotate and store this step itself (`step_kv`)."""
    rows, group = meta.max_query_len, query.shape[1] // max(key.shape[1], 1)
    return (
        0 < rows <= current_kernel_policy().rope_in_attention_max_query_len
        and group >= 1
        and _block_m(rows, group) // group >= rows  # one tile a sequence
        and _step_kv_problem(query, key, value, q_norm_weight, k_norm_weight) is None
    )


def triton_rope_store_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], before q norm and RoPE
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], before k norm and RoPE
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    positions: torch.Tensor,  # [num_tokens] int64
    cos_cache: torch.Tensor,  # [max_position, head_dim / 2] float32
    sin_cache: torch.Tensor,  # [max_position, head_dim / 2] float32
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
    split_counters: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """`triton_qk_norm_rope_store` then `triton_paged_attention` on the rotated queries: the
    `rope_store_attention_torch` contract. A decode forward does both in the attention kernel
    (KernelPolicy.rope_in_attention_max_query_len), one launch a layer less."""
    if rope_fits_attention(query, key, value, q_norm_weight, k_norm_weight, meta):
        step_kv = StepKV(key, value, positions, cos_cache, sin_cache, q_norm_weight,
                         k_norm_weight, eps, meta.slot_mapping)  # fmt: skip
        return triton_paged_attention(
            query, key_cache, value_cache, meta, scale, causal, window,
            split_counters=split_counters, step_kv=step_kv,
        )  # fmt: skip
    query, _ = triton_qk_norm_rope_store(
        query, key, value, positions, cos_cache, sin_cache, q_norm_weight, k_norm_weight, eps,
        key_cache, value_cache, meta.slot_mapping,
    )  # fmt: skip
    return triton_paged_attention(
        query, key_cache, value_cache, meta, scale, causal, window, split_counters=split_counters
    )
