"""The mixture-of-experts kernels (the launchers, their tile tables and the design are in
`triton_moe`): the router, the on-device grouping of (token, slot) pairs by expert, the grouped
SwiGLU GEMMs on tensor cores, the decode GEMVs that stream one chosen expert per program, and
the fixed-order sum over a token's slots.

Kept apart from the launchers so that the device code and the host-side tile tables each read
on their own.
"""

import triton
import triton.language as tl

from blockdraft.kernels.pdl import pdl_start


@triton.jit
def _moe_route_kernel(
    logits_ptr,  # [T, E] (+ the shared expert's gate column with SHARED)
    weights_ptr,  # [T, TOP_K + SHARED] fp32
    ids_ptr,  # [T, TOP_K + SHARED] int64
    E,  # the routed experts
    stride_lt,
    TOP_K: tl.constexpr,
    BLOCK_E: tl.constexpr,  # next_power_of_2(E)
    BLOCK_K: tl.constexpr,  # next_power_of_2(TOP_K)
    RENORMALIZE: tl.constexpr,
    SHARED: tl.constexpr,  # slot TOP_K: expert E (the shared one), weight sigmoid(logit E)
    PDL: tl.constexpr,  # launched with programmatic dependent launch (blockdraft.kernels.pdl)
):
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    ok = offs < E
    logits = tl.load(logits_ptr + t * stride_lt + offs, mask=ok, other=float("-inf"))
    logits = logits.to(tl.float32)
    p = tl.exp(logits - tl.max(logits, axis=0))
    probs = p / tl.sum(tl.where(ok, p, 0.0), axis=0)
    # Probabilities are >= 0, so -1 marks lanes past E and experts already taken.
    work = tl.where(ok, probs, -1.0)
    kk = tl.arange(0, BLOCK_K)
    top_w = tl.zeros((BLOCK_K,), dtype=tl.float32)
    top_id = tl.zeros((BLOCK_K,), dtype=tl.int64)
    for k in tl.static_range(TOP_K):
        best = tl.max(work, axis=0)
        # The lowest index among equal probabilities. A NaN row (a padded token's garbage)
        # matches nothing: the clamp keeps its ids valid, which is all such a row needs.
        idx = tl.min(tl.where(work == best, offs, BLOCK_E), axis=0)
        idx = tl.minimum(idx, E - 1)
        top_w = tl.where(kk == k, best, top_w)
        top_id = tl.where(kk == k, idx.to(tl.int64), top_id)
        work = tl.where(offs == idx, -1.0, work)
    if RENORMALIZE:
        top_w = top_w / tl.sum(tl.where(kk < TOP_K, top_w, 0.0), axis=0)
    out_k = TOP_K + SHARED
    tl.store(weights_ptr + t * out_k + kk, top_w, mask=kk < TOP_K)
    tl.store(ids_ptr + t * out_k + kk, top_id, mask=kk < TOP_K)
    if SHARED:
        gate = tl.load(logits_ptr + t * stride_lt + E).to(tl.float32)
        tl.store(weights_ptr + t * out_k + TOP_K, 1.0 / (1.0 + tl.exp(-gate)))
        tl.store(ids_ptr + t * out_k + TOP_K, E.to(tl.int64))


@triton.jit
def _moe_count_kernel(
    ids_ptr,  # [S] flat expert ids of the (token, slot) pairs
    counts_ptr,  # [num_chunks, BLOCK_E] int32: pairs per expert in each chunk
    S,
    E,
    CHUNK: tl.constexpr,  # pairs a program counts, a multiple of SUB
    SUB: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    chunk = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for sub in tl.range(0, CHUNK, SUB):
        offs = chunk * CHUNK + sub + tl.arange(0, SUB)
        e = tl.load(ids_ptr + offs, mask=offs < S, other=-1)
        onehot = (e[:, None] == experts[None, :]) & (experts < E)[None, :]
        counts += tl.sum(onehot.to(tl.int32), axis=0)
    tl.store(counts_ptr + chunk * BLOCK_E + experts, counts)


@triton.jit
def _moe_offsets_kernel(
    counts_ptr,  # [num_chunks, BLOCK_E] int32, from _moe_count_kernel
    chunk_base_ptr,  # [num_chunks, BLOCK_E] int32: where each chunk's pairs of an expert start
    block_expert_ptr,  # [max_blocks] int32: each BLOCK_M-row block's expert, -1 past the end
    block_rows_ptr,  # [max_blocks] int32: its rows that hold a pair
    num_chunks,
    max_blocks,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    ROWS: tl.constexpr,  # chunks read at a time
    BLOCK_B: tl.constexpr,  # blocks written at a time
):
    experts = tl.arange(0, BLOCK_E)
    rows = tl.arange(0, ROWS)
    totals = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for c0 in tl.range(0, num_chunks, ROWS):
        ok = (c0 + rows < num_chunks)[:, None]
        ptrs = counts_ptr + (c0 + rows)[:, None] * BLOCK_E + experts[None, :]
        totals += tl.sum(tl.load(ptrs, mask=ok, other=0), axis=0)
    # Each expert's run of rows padded to whole blocks, the runs in expert order.
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    # Chunk c's pairs of expert e follow those of chunks < c: the scatter is a stable sort.
    base = starts
    for c0 in tl.range(0, num_chunks, ROWS):
        ok = (c0 + rows < num_chunks)[:, None]
        offs = (c0 + rows)[:, None] * BLOCK_E + experts[None, :]
        c = tl.load(counts_ptr + offs, mask=ok, other=0)
        tl.store(chunk_base_ptr + offs, base[None, :] + tl.cumsum(c, axis=0) - c, mask=ok)
        base += tl.sum(c, axis=0)
    run_ends = starts + totals  # past an expert's last real row
    total = tl.sum(padded, axis=0)
    for b0 in tl.range(0, max_blocks, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        pos = b * BLOCK_M
        # The expert whose run holds pos: the number of runs ending at or before it (empty
        # runs of earlier experts included, lanes past E never: their ends equal the total).
        expert = tl.sum((ends[None, :] <= pos[:, None]).to(tl.int32), axis=1)
        run_end = tl.sum(tl.where(experts[None, :] == expert[:, None], run_ends[None, :], 0), 1)
        used = pos < total
        tl.store(block_expert_ptr + b, tl.where(used, expert, -1), mask=b < max_blocks)
        n_rows = tl.minimum(run_end - pos, BLOCK_M)
        tl.store(block_rows_ptr + b, tl.where(used, n_rows, 0), mask=b < max_blocks)


@triton.jit
def _moe_scatter_kernel(
    ids_ptr,  # [S] flat expert ids
    chunk_base_ptr,  # [num_chunks, BLOCK_E] int32, from _moe_offsets_kernel
    sorted_ptr,  # [max_blocks * BLOCK_M] int32: the pair index at each grouped row
    S,
    E,
    CHUNK: tl.constexpr,
    SUB: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    chunk = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    base = tl.load(chunk_base_ptr + chunk * BLOCK_E + experts)
    for sub in tl.range(0, CHUNK, SUB):
        offs = chunk * CHUNK + sub + tl.arange(0, SUB)
        ok = offs < S
        e = tl.load(ids_ptr + offs, mask=ok, other=-1)
        onehot = ((e[:, None] == experts[None, :]) & (experts < E)[None, :]).to(tl.int32)
        rank = tl.cumsum(onehot, axis=0) - onehot  # earlier pairs of the same expert
        pos = tl.sum(onehot * (base[None, :] + rank), axis=1)
        # Ids outside [0, E) match no expert and are never computed.
        tl.store(sorted_ptr + pos, offs, mask=ok & (tl.sum(onehot, axis=1) > 0))
        base += tl.sum(onehot, axis=0)


@triton.jit
def _silu_mul(gate, up, dtype: tl.constexpr):  # fp32 [...] x2 -> [...] dtype
    # As experts_torch: gate and up rounded to the activations' dtype (F.linear's output),
    # silu in fp32 rounded, then the product rounded once.
    g = gate.to(dtype).to(tl.float32)
    u = up.to(dtype).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    return (s * u).to(dtype)


@triton.jit
def _weighted(acc, weight, dtype: tl.constexpr):  # fp32 [...], fp32 broadcastable -> dtype
    # As experts_torch: the down projection rounded, times the weight rounded to the dtype.
    y = acc.to(dtype).to(tl.float32)
    return (y * weight.to(dtype).to(tl.float32)).to(dtype)


@triton.jit
def _moe_grouped_gate_up_kernel(
    x_ptr,  # [T, H], unit column stride
    w_ptr,  # [E, 2I, H], unit column stride: gate rows then up rows
    out_ptr,  # [max_blocks * BLOCK_M, INTER]: silu(gate) * up at each grouped row
    sorted_ptr,  # [max_blocks * BLOCK_M] int32 pair indices
    block_expert_ptr,  # [max_blocks] int32
    block_rows_ptr,  # [max_blocks] int32
    H,
    INTER,
    top_k,
    stride_xt,
    stride_we,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # H % BLOCK_K == 0
    NUM_STAGES: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:  # past the last expert's run: the grid is sized for the worst case
        return
    n_rows = tl.load(block_rows_ptr + pid_m)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < n_rows
    row0 = pid_m.to(tl.int64) * BLOCK_M
    # Rows without a pair read token 0 (a valid row) and are never stored.
    pair = tl.load(sorted_ptr + row0 + offs_m, mask=m_ok, other=0)
    token = (pair // top_k).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_n = tl.minimum(offs_n, INTER - 1).to(tl.int64)  # clamped; the store drops them
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + token[:, None] * stride_xt + offs_k[None, :]
    g_ptrs = w_ptr + expert.to(tl.int64) * stride_we + rows_n[:, None] * stride_wn + offs_k[None, :]
    u_ptrs = g_ptrs + INTER * stride_wn
    # Transposed ([N, M], "swap AB"): the weight tile is the left operand, so BLOCK_N, not a
    # block's few rows, is the tensor-core tile's long side (Hopper's wgmma needs 64 there).
    acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in tl.range(0, H, BLOCK_K, num_stages=NUM_STAGES):
        if EVEN_K:
            x = tl.load(x_ptrs)
            wg = tl.load(g_ptrs)
            wu = tl.load(u_ptrs)
        else:
            k_ok = offs_k[None, :] < H - k
            x = tl.load(x_ptrs, mask=k_ok, other=0.0)
            wg = tl.load(g_ptrs, mask=k_ok, other=0.0)
            wu = tl.load(u_ptrs, mask=k_ok, other=0.0)
        # fp32 stays fp32 ("ieee"), as F.linear without TF32; ignored for 16-bit inputs.
        acc_g = tl.dot(wg, tl.trans(x), acc_g, input_precision="ieee")
        acc_u = tl.dot(wu, tl.trans(x), acc_u, input_precision="ieee")
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    h = _silu_mul(acc_g, acc_u, out_ptr.dtype.element_ty)
    # Every row of the block, those without a pair too (token 0's, finite): the down GEMM
    # reads whole blocks, and no garbage (NaN) enters its tiles.
    out_ptrs = out_ptr + (row0 + offs_m)[None, :] * stride_om + offs_n[:, None]
    tl.store(out_ptrs, h, mask=(offs_n < INTER)[:, None])


@triton.jit
def _moe_grouped_down_kernel(
    h_ptr,  # [max_blocks * BLOCK_M, INTER], from _moe_grouped_gate_up_kernel
    w_ptr,  # [E, H, INTER], unit column stride
    weights_ptr,  # [S] fp32 routing weights of the pairs
    out_ptr,  # [S, H]: each pair's weighted expert output
    sorted_ptr,
    block_expert_ptr,
    block_rows_ptr,
    H,
    INTER,
    stride_hm,
    stride_we,
    stride_wn,
    stride_os,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # INTER % BLOCK_K == 0
    NUM_STAGES: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    n_rows = tl.load(block_rows_ptr + pid_m)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < n_rows
    row0 = pid_m.to(tl.int64) * BLOCK_M
    pair = tl.load(sorted_ptr + row0 + offs_m, mask=m_ok, other=0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_n = tl.minimum(offs_n, H - 1).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    # Rows of a block past its pairs hold token 0's activations: they feed only rows never
    # stored.
    h_ptrs = h_ptr + (row0 + offs_m)[:, None] * stride_hm + offs_k[None, :]
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + rows_n[:, None] * stride_wn + offs_k[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # transposed, as in gate_up
    for k in tl.range(0, INTER, BLOCK_K, num_stages=NUM_STAGES):
        if EVEN_K:
            h = tl.load(h_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_ok = offs_k[None, :] < INTER - k
            h = tl.load(h_ptrs, mask=k_ok, other=0.0)
            w = tl.load(w_ptrs, mask=k_ok, other=0.0)
        acc = tl.dot(w, tl.trans(h), acc, input_precision="ieee")
        h_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    weight = tl.load(weights_ptr + pair, mask=m_ok, other=0.0)
    y = _weighted(acc, weight[None, :], out_ptr.dtype.element_ty)
    out_ptrs = out_ptr + pair[None, :] * stride_os + offs_n[:, None]
    tl.store(out_ptrs, y, mask=m_ok[None, :] & (offs_n < H)[:, None])


@triton.jit
def _moe_decode_gate_up_kernel(
    x_ptr,  # [T, H], unit column stride
    w_ptr,  # [E, 2I, H], unit column stride
    ids_ptr,  # [S] expert ids of the pairs; outside [0, E): no expert
    out_ptr,  # [S, INTER]: silu(gate) * up of each pair
    E,
    H,
    INTER,
    top_k,
    stride_xt,
    stride_we,
    stride_wn,
    stride_os,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PDL: tl.constexpr,
):
    pair = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    if PDL:  # the expert ids and x come from earlier kernels
        tl.extra.cuda.gdc_wait()
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    if (expert < 0) | (expert >= E):  # another rank's expert: the sum skips the pair
        return
    token = pair // top_k
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_n = tl.minimum(offs_n, INTER - 1).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + token * stride_xt + offs_k
    g_ptrs = w_ptr + expert * stride_we + rows_n[:, None] * stride_wn + offs_k[None, :]
    u_ptrs = g_ptrs + INTER * stride_wn
    # One fp32 [BLOCK_N, BLOCK_K] accumulator each, reduced over K once after the loop.
    acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in tl.range(0, H, BLOCK_K, num_stages=NUM_STAGES):
        if EVEN_K:
            x = tl.load(x_ptrs)
            wg = tl.load(g_ptrs, eviction_policy="evict_first")
            wu = tl.load(u_ptrs, eviction_policy="evict_first")
        else:
            k_ok = offs_k < H - k
            x = tl.load(x_ptrs, mask=k_ok, other=0.0)
            wg = tl.load(g_ptrs, mask=k_ok[None, :], other=0.0, eviction_policy="evict_first")
            wu = tl.load(u_ptrs, mask=k_ok[None, :], other=0.0, eviction_policy="evict_first")
        x = x.to(tl.float32)[None, :]
        acc_g += wg.to(tl.float32) * x
        acc_u += wu.to(tl.float32) * x
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    if PDL:  # every weight chunk read: the successor's launch overlaps the stores and tail
        tl.extra.cuda.gdc_launch_dependents()
    h = _silu_mul(tl.sum(acc_g, axis=1), tl.sum(acc_u, axis=1), out_ptr.dtype.element_ty)
    tl.store(out_ptr + pair * stride_os + offs_n, h, mask=offs_n < INTER)


@triton.jit
def _moe_decode_down_kernel(
    h_ptr,  # [S, INTER], from _moe_decode_gate_up_kernel
    w_ptr,  # [E, H, INTER], unit column stride
    ids_ptr,  # [S]; outside [0, E): no expert
    weights_ptr,  # [S] fp32
    out_ptr,  # [S, H]
    E,
    H,
    INTER,
    stride_hs,
    stride_we,
    stride_wn,
    stride_os,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PDL: tl.constexpr,
):
    pair = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    if PDL:
        tl.extra.cuda.gdc_wait()
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    if (expert < 0) | (expert >= E):
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_n = tl.minimum(offs_n, H - 1).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + pair * stride_hs + offs_k
    w_ptrs = w_ptr + expert * stride_we + rows_n[:, None] * stride_wn + offs_k[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in tl.range(0, INTER, BLOCK_K, num_stages=NUM_STAGES):
        if EVEN_K:
            h = tl.load(h_ptrs)
            w = tl.load(w_ptrs, eviction_policy="evict_first")
        else:
            k_ok = offs_k < INTER - k
            h = tl.load(h_ptrs, mask=k_ok, other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0, eviction_policy="evict_first")
        acc += w.to(tl.float32) * h.to(tl.float32)[None, :]
        h_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    y = _weighted(tl.sum(acc, axis=1), tl.load(weights_ptr + pair), out_ptr.dtype.element_ty)
    tl.store(out_ptr + pair * stride_os + offs_n, y, mask=offs_n < H)


@triton.jit
def _moe_sum_kernel(
    pairs_ptr,  # [T * top_k, H]: the pairs' weighted outputs, a token's top_k rows together
    ids_ptr,  # [T * top_k]: a pair outside [0, E) adds nothing (its row was never written)
    out_ptr,  # [T, H]
    E,
    H,
    top_k,
    stride_ps,
    stride_ot,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in tl.range(0, top_k):  # slot order: the same sum on every run, no atomics
        expert = tl.load(ids_ptr + t * top_k + k)
        live = ok & (expert >= 0) & (expert < E)
        row = pairs_ptr + (t * top_k + k) * stride_ps + offs
        acc += tl.load(row, mask=live, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)
