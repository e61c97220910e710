"""The paged attention kernels (the launcher is `triton_attention.triton_paged_attention`).

`_paged_attention_kernel`: one program per (tile of a sequence's query rows x its GQA group, kv
head, key split); it norms, rotates and stores the step's keys first when given them raw
(ROPE), streams its keys through the block table with an online softmax, and writes the output,
or its split's partials (SPLIT), merged by its group's last program on the decode path (MERGE).
`_paged_attention_reduce_kernel`: merges the split partials of the other launches.

Kept apart from the launcher so that the host-side shape rules (tile sizes, split counts) read
on their own; the per-tile maths is in `triton_attention_tiles`.
"""

import triton
import triton.language as tl

from blockdraft.kernels.pdl import pdl_start
from blockdraft.kernels.triton_attention_tiles import (
    _angles,
    _attend_tile,
    _merge_decode_group,
    _norm_rope_rows,
)


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
        )  # [KEYS, BLOCK_D]  # fmt: skip
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
