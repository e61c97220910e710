"""The gated delta rule's chunked form (prefill) over variable-length sequences packed along one
token axis (`cu_seqlens`), in three launches instead of a torch loop per request and chunk.

Prepare: one program per (64-token chunk, value head). A chunk never crosses a sequence's end
(a sequence's last chunk is partial, its rows past the end masked to zero), so the programs
are independent. Each forms the chunk's cumulative log decay, the strictly lower
`A = (beta k k^T) * exp(cum_i - cum_j)`, `T = (I + A)^-1` by forward substitution, and stores
`w = T (beta k exp(cum))` and `u = T (beta v)` (float32) by token.

State: one program per (sequence, value head, block of value dims) holds its float32 [Dk, BV]
state slice on chip across the sequence's chunks, starting from the sequence's initial state.
For each chunk it stores the state at the chunk's start (`h`, at the chunk's index in the
packed layout) and `v_new = u - w S` (over u, which nothing reads again), then steps
`S = S exp(cum_last) + (k exp(cum_last - cum))^T v_new`; it writes the final state.

Output: one program per (chunk, value head, block of value dims), independent as prepare's are:
`o = (q exp(cum)) h + causal(q k^T exp(cum_i - cum_j)) v_new`.

Why the state and the outputs are two launches: one serial scan that also formed the outputs
held the state, q, k, the scores and the output at once (ptxas for sm_90 at Dk = Dv = 128:
~1.5 KB of spills a thread), and did in its serial loop work that needs nothing but the
chunk's starting state, so it can run over all chunks at once. The price is the `h` buffer
(`triton_chunk_gated_delta_rule` says how large).

q and k are L2-normalised wherever they are read (q also scaled by Dk^-0.5), as `_prepare`
does. `chunk_gated_delta_rule_varlen_torch` (blockdraft.kernels.gated_delta_rule) is the
specification: same arguments, same float32 arithmetic up to rounding order. Float32 values
make ieee dots; 16-bit models take tf32 dots (their outputs round to 16 bits anyway).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from blockdraft.kernels.gated_delta_rule import chunk_gated_delta_rule_varlen_torch

__all__ = ["chunk_gated_delta_rule_varlen_torch", "triton_chunk_gated_delta_rule"]

CHUNK = 64  # tokens a chunk: one triangular system of this size per (chunk, value head)


@triton.jit
def _load_tile(
    ptr,  # the chunk's row 0 (64-bit scalar offset already in), rows `stride` apart
    stride,
    offs_t,  # [BT] rows in the chunk
    mask_t,  # [BT]
    offs_d,  # [BD] columns
    mask_d,  # [BD]
):
    """[BT, BD] float32, zero where masked. Offsets inside the chunk are 32-bit: a tile of
    64-bit pointers would cost twice the registers."""
    ptrs = ptr + offs_t[:, None] * stride + offs_d[None, :]
    return tl.load(ptrs, mask=mask_t[:, None] & mask_d[None, :], other=0.0).to(tl.float32)


@triton.jit
def _normed(
    x,  # [BT, BK] float32
    scale,
    eps,
):
    """Each row L2-normalised, then scaled (`l2norm_torch`)."""
    return x * (tl.rsqrt(tl.sum(x * x, axis=1) + eps) * scale)[:, None]


# Sequences a chunk's lookup reads at once. The count itself is a runtime argument (not a block
# size, and not specialised on): a prefill batch of a new number of sequences would otherwise
# compile two kernels in the middle of serving (Qwen3.5-27B on an H100: a 1.7 s step when
# 15 prompts were admitted where warm-up and earlier steps had 16).
SEQ_TILE = 16


@triton.jit
def _chunk_rows(
    chunk,  # index in the packed layout: cu_chunks[seq] + the chunk's index in its sequence
    cu_seqlens_ptr,  # [P + 1] int32
    cu_chunks_ptr,  # [P + 1] int32 chunks before each sequence
    P,
    BT: tl.constexpr,
    SEQ_TILE: tl.constexpr,
):
    """(sequence, first row, end of the sequence's rows) of a chunk. The grids over chunks are
    a bound on their count (no host sync): past the count the sequence is P, and the rows
    mean nothing."""
    seq = chunk * 0  # a sequence precedes the chunk's when its chunks end at or before it
    for first in range(0, P, SEQ_TILE):
        offs_p = first + tl.arange(0, SEQ_TILE)
        ends = tl.load(cu_chunks_ptr + 1 + offs_p, mask=offs_p < P, other=2**30)
        seq += tl.sum((ends <= chunk).to(tl.int32), axis=0)
    last = tl.minimum(seq, P - 1)  # in bounds for the loads
    start = tl.load(cu_seqlens_ptr + last) + (chunk - tl.load(cu_chunks_ptr + last)) * BT
    return seq, start, tl.load(cu_seqlens_ptr + last + 1)


@triton.jit(do_not_specialize=["P"])
def _chunk_prepare_kernel(
    k_ptr,  # [N, Hk, Dk] last dim contiguous
    v_ptr,  # [N, Hv, Dv] last dim contiguous
    g_ptr,  # [N, Hv] float32 contiguous
    beta_ptr,  # [N, Hv] contiguous
    w_ptr,  # [N, Hv, Dk] float32 contiguous, out
    u_ptr,  # [N, Hv, Dv] float32 contiguous, out
    cu_seqlens_ptr,  # [P + 1] int32
    cu_chunks_ptr,  # [P + 1] int32 chunks before each sequence
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    P,
    Hv,
    Dk,
    Dv,
    groups,  # Hv // Hk
    eps,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    SEQ_TILE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    chunk = tl.program_id(0)
    head = tl.program_id(1)
    seq, start, end = _chunk_rows(chunk, cu_seqlens_ptr, cu_chunks_ptr, P, BT, SEQ_TILE)
    if seq >= P:
        return
    row0 = start.to(tl.int64)
    offs_t = tl.arange(0, BT)
    mask_t = start + offs_t < end
    offs_k = tl.arange(0, BK)
    mask_k = offs_k < Dk
    k_base = k_ptr + row0 * stride_kt + (head // groups) * stride_kh
    k = _normed(_load_tile(k_base, stride_kt, offs_t, mask_t, offs_k, mask_k), 1.0, eps)
    # Rows past the end take no decay and no beta: zero rows of A, w and u, as the torch
    # twin's zero padding gives.
    g = tl.load(g_ptr + row0 * Hv + offs_t * Hv + head, mask=mask_t, other=0.0)
    beta = tl.load(beta_ptr + row0 * Hv + offs_t * Hv + head, mask=mask_t, other=0.0)
    beta = beta.to(tl.float32)
    cum = tl.cumsum(g, axis=0)
    lower = offs_t[:, None] > offs_t[None, :]
    # exp only where i > j (cum falls, so above the diagonal it could overflow)
    pair_decay = tl.exp(tl.where(lower, cum[:, None] - cum[None, :], 0.0))
    a = tl.dot(k * beta[:, None], tl.trans(k), input_precision=PRECISION)
    a = tl.where(lower, a * pair_decay, 0.0)
    # T = (I + A)^-1 row by row: T_i = e_i - sum_{j < i} A_ij T_j (rows >= i of T still 0).
    # k is loaded again after the loop, so that only A and T stay live across it.
    t_inv = tl.zeros((BT, BT), dtype=tl.float32)
    for i in range(0, BT):
        a_i = tl.sum(tl.where(offs_t[:, None] == i, a, 0.0), axis=0)  # row i of A by column
        t_i = tl.where(offs_t == i, 1.0, 0.0) - tl.sum(a_i[:, None] * t_inv, axis=0)
        t_inv = tl.where(offs_t[:, None] == i, t_i[None, :], t_inv)
    k = _normed(_load_tile(k_base, stride_kt, offs_t, mask_t, offs_k, mask_k), 1.0, eps)
    w = tl.dot(t_inv, k * (beta * tl.exp(cum))[:, None], input_precision=PRECISION)
    w_ptrs = w_ptr + (row0 * Hv + head) * Dk + offs_t[:, None] * (Hv * Dk) + offs_k[None, :]
    tl.store(w_ptrs, w, mask=mask_t[:, None] & mask_k[None, :])
    v_base = v_ptr + row0 * stride_vt + head * stride_vh
    u_base = u_ptr + (row0 * Hv + head) * Dv
    for v0 in range(0, Dv, BV):
        offs_v = v0 + tl.arange(0, BV)
        mask_v = offs_v < Dv
        v = _load_tile(v_base, stride_vt, offs_t, mask_t, offs_v, mask_v)
        u = tl.dot(t_inv, v * beta[:, None], input_precision=PRECISION)
        u_ptrs = u_base + offs_t[:, None] * (Hv * Dv) + offs_v[None, :]
        tl.store(u_ptrs, u, mask=mask_t[:, None] & mask_v[None, :])


@triton.jit
def _chunk_state_kernel(
    k_ptr,  # [N, Hk, Dk] last dim contiguous
    g_ptr,  # [N, Hv] float32 contiguous
    w_ptr,  # [N, Hv, Dk] float32 contiguous
    u_ptr,  # [N, Hv, Dv] float32 contiguous: u in, v_new out
    h_ptr,  # [C, Hv, Dk, Dv] contiguous, out: each chunk's starting state, C >= chunks
    state_ptr,  # [P, Hv, Dk, Dv] float32 contiguous: initial states
    final_ptr,  # [P, Hv, Dk, Dv] float32 contiguous, out
    cu_seqlens_ptr,  # [P + 1] int32
    cu_chunks_ptr,  # [P + 1] int32 chunks before each sequence
    stride_kt,
    stride_kh,
    Hv,
    Dk,
    Dv,
    groups,  # Hv // Hk
    eps,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_k = tl.arange(0, BK)
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
    mask_k, mask_v = offs_k < Dk, offs_v < Dv
    state_offs = offs_k[:, None] * Dv + offs_v[None, :]
    mask_s = mask_k[:, None] & mask_v[None, :]
    state_base = (seq.to(tl.int64) * Hv + head) * Dk * Dv
    state = tl.load(state_ptr + state_base + state_offs, mask=mask_s, other=0.0)
    offs_t = tl.arange(0, BT)
    start = tl.load(cu_seqlens_ptr + seq)
    end = tl.load(cu_seqlens_ptr + seq + 1)
    first_chunk = tl.load(cu_chunks_ptr + seq)
    for c in range(0, tl.cdiv(end - start, BT)):
        # h is indexed like the output grid, by chunk in the packed layout
        h_base = ((first_chunk + c).to(tl.int64) * Hv + head) * Dk * Dv
        tl.store(h_ptr + h_base + state_offs, state.to(h_ptr.dtype.element_ty), mask=mask_s)
        t0 = start + c * BT
        row0 = t0.to(tl.int64)
        mask_t = t0 + offs_t < end
        g = tl.load(g_ptr + row0 * Hv + offs_t * Hv + head, mask=mask_t, other=0.0)
        cum = tl.cumsum(g, axis=0)
        cum_last = tl.sum(g, axis=0)
        w = _load_tile(w_ptr + (row0 * Hv + head) * Dk, Hv * Dk, offs_t, mask_t, offs_k, mask_k)
        # The chunk's values less what the state already predicts for its keys. Only this
        # program reads these u entries, once, so v_new takes their place: no [N, Hv, Dv]
        # buffer of its own. Rows past the end stay zero (masked u, w).
        u_ptrs = u_ptr + (row0 * Hv + head) * Dv + offs_t[:, None] * (Hv * Dv) + offs_v[None, :]
        mask_tv = mask_t[:, None] & mask_v[None, :]
        v_new = tl.load(u_ptrs, mask=mask_tv, other=0.0)
        v_new -= tl.dot(w, state, input_precision=PRECISION)
        tl.store(u_ptrs, v_new, mask=mask_tv)
        # k read only once w is dead, so that the two [BT, Dk] tiles need not be live together
        k_base = k_ptr + row0 * stride_kt + (head // groups) * stride_kh
        k = _normed(_load_tile(k_base, stride_kt, offs_t, mask_t, offs_k, mask_k), 1.0, eps)
        k_to_end = k * tl.exp(cum_last - cum)[:, None]
        state = state * tl.exp(cum_last) + tl.dot(
            tl.trans(k_to_end), v_new, input_precision=PRECISION
        )
    tl.store(final_ptr + state_base + state_offs, state, mask=mask_s)


@triton.jit(do_not_specialize=["P"])
def _chunk_output_kernel(
    q_ptr,  # [N, Hk, Dk] last dim contiguous
    k_ptr,  # [N, Hk, Dk] last dim contiguous, q's strides
    g_ptr,  # [N, Hv] float32 contiguous
    v_new_ptr,  # [N, Hv, Dv] float32 contiguous
    h_ptr,  # [C, Hv, Dk, Dv] contiguous: each chunk's starting state, C >= chunks
    out_ptr,  # [N, Hv, Dv] contiguous, value's dtype, out
    cu_seqlens_ptr,  # [P + 1] int32
    cu_chunks_ptr,  # [P + 1] int32 chunks before each sequence
    stride_qt,
    stride_qh,
    P,
    Hv,
    Dk,
    Dv,
    groups,  # Hv // Hk
    scale,  # Dk ** -0.5, on the normalised query
    eps,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    SEQ_TILE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    chunk = tl.program_id(0)
    head = tl.program_id(1)
    seq, start, end = _chunk_rows(chunk, cu_seqlens_ptr, cu_chunks_ptr, P, BT, SEQ_TILE)
    if seq >= P:
        return
    row0 = start.to(tl.int64)
    offs_t = tl.arange(0, BT)
    mask_t = start + offs_t < end
    offs_k = tl.arange(0, BK)
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
    mask_k, mask_v = offs_k < Dk, offs_v < Dv
    g = tl.load(g_ptr + row0 * Hv + offs_t * Hv + head, mask=mask_t, other=0.0)
    cum = tl.cumsum(g, axis=0)
    qk_base = row0 * stride_qt + (head // groups) * stride_qh
    q = _normed(_load_tile(q_ptr + qk_base, stride_qt, offs_t, mask_t, offs_k, mask_k), scale, eps)
    k = _normed(_load_tile(k_ptr + qk_base, stride_qt, offs_t, mask_t, offs_k, mask_k), 1.0, eps)
    causal = offs_t[:, None] >= offs_t[None, :]
    # exp only where i >= j (cum falls, so above the diagonal it could overflow)
    pair_decay = tl.exp(tl.where(causal, cum[:, None] - cum[None, :], 0.0))
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    scores = tl.where(causal, scores * pair_decay, 0.0)
    h_ptrs = h_ptr + (chunk.to(tl.int64) * Hv + head) * Dk * Dv
    h_ptrs += offs_k[:, None] * Dv + offs_v[None, :]
    h = tl.load(h_ptrs, mask=mask_k[:, None] & mask_v[None, :], other=0.0).to(tl.float32)
    out = tl.dot(q * tl.exp(cum)[:, None], h, input_precision=PRECISION)
    v_new_base = v_new_ptr + (row0 * Hv + head) * Dv
    v_new = _load_tile(v_new_base, Hv * Dv, offs_t, mask_t, offs_v, mask_v)
    out += tl.dot(scores, v_new, input_precision=PRECISION)
    out_ptrs = out_ptr + (row0 * Hv + head) * Dv + offs_t[:, None] * (Hv * Dv)
    tl.store(
        out_ptrs + offs_v[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=mask_t[:, None] & mask_v[None, :],
    )


def triton_chunk_gated_delta_rule(
    query: torch.Tensor,  # [N, Hk, Dk] tokens of all sequences, packed; last dim contiguous
    key: torch.Tensor,  # [N, Hk, Dk] query's strides
    value: torch.Tensor,  # [N, Hv, Dv] last dim contiguous
    g: torch.Tensor,  # [N, Hv] float32 log decay (<= 0)
    beta: torch.Tensor,  # [N, Hv]
    state: torch.Tensor,  # [P, Hv, Dk, Dv] float32, each sequence's state before its first token
    cu_seqlens: torch.Tensor,  # [P + 1] int: sequence i is tokens cu_seqlens[i] .. [i + 1]
    host_cu_seqlens: list[int] | None = None,  # the twin's; the kernels read cu_seqlens
) -> tuple[torch.Tensor, torch.Tensor]:  # out [N, Hv, Dv] value's dtype, final [P, Hv, Dk, Dv]
    n, hk, dk = key.shape
    hv, dv = value.shape[1:]
    p = cu_seqlens.shape[0] - 1
    # The output kernel reads q and k with one set of strides, unit along the head dim.
    if query.stride() != key.stride() or query.stride(-1) != 1:
        query, key = query.contiguous(), key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    out = torch.empty(n, hv, dv, dtype=value.dtype, device=value.device)
    final = torch.empty(p, hv, dk, dv, dtype=torch.float32, device=value.device)
    if p == 0 or n == 0:
        final.copy_(state)
        return out, final
    g, beta, state = g.float().contiguous(), beta.contiguous(), state.float().contiguous()
    cu_seqlens = cu_seqlens.to(torch.int32)
    # Chunks before each sequence, on the device. The grids over chunks, and h, take a bound
    # on their count (sum of ceil(len / CHUNK) <= (N + P (CHUNK - 1)) / CHUNK), so nothing
    # syncs; the programs past the count return at once.
    cu_chunks = torch.zeros_like(cu_seqlens)
    torch.cumsum((cu_seqlens.diff() + CHUNK - 1) // CHUNK, 0, dtype=torch.int32, out=cu_chunks[1:])
    max_chunks = triton.cdiv(n + p * (CHUNK - 1), CHUNK)
    w = torch.empty(n, hv, dk, dtype=torch.float32, device=value.device)
    u = torch.empty(n, hv, dv, dtype=torch.float32, device=value.device)  # then v_new
    # Hv Dk Dv 4 bytes a chunk: at Dk = Dv = 128 as much as w and u together (Qwen3.5-27B's
    # 48 value heads: 3 MiB a chunk; 16 sequences of 512 tokens bound it at 144 chunks, 432
    # MiB, where w and u take 384). fla keeps it in 16 bits for 16-bit models, which would
    # halve it; float32 keeps the outputs' rounding that of one scan carrying the state on
    # chip (tf32 dots still round it on the way in). The kernels cast to and from h's dtype,
    # so this allocation alone would change.
    h = torch.empty(max_chunks, hv, dk, dv, dtype=torch.float32, device=value.device)
    precision = "ieee" if value.dtype == torch.float32 else "tf32"
    # dot operands need dims of 16 or more: smaller heads are padded by the masks
    bk = max(triton.next_power_of_2(dk), 16)
    # Warps, blocks and stages of the state and output kernels are not yet tuned on a GPU.
    # Before them, one scan kernel (H100, Qwen3.5-27B heads (16 key / 48 value of 128), 6,573
    # packed bf16 tokens: 4.1 ms with prepare against the torch twin's 27.7) spilled ~1.5 KB a
    # thread at 4 or 8 warps alike (ptxas for sm_90, Dk = Dv = 128, bf16), and pipelining its
    # loads took 164 KB of shared memory. Prepare spills nothing with 8 warps (84 bytes
    # with 4).
    prepare_warps = 8 if dk > 64 else 4
    _chunk_prepare_kernel[(max_chunks, hv)](
        key, value, g, beta, w, u, cu_seqlens, cu_chunks,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        p, hv, dk, dv, hv // hk, 1e-6,
        BT=CHUNK, BK=bk, BV=min(max(triton.next_power_of_2(dv), 16), 64),
        SEQ_TILE=SEQ_TILE, PRECISION=precision, num_warps=prepare_warps,
    )  # fmt: skip
    # The state kernel holds the [Dk, BV] state, a [BT, Dk] tile (w, then k) and [BT, BV] u:
    # BV 32 and 4 warps, one stage as the scan had (a second would double the tiles' shared
    # memory, untried).
    state_bv = min(max(triton.next_power_of_2(dv), 16), 32)
    _chunk_state_kernel[(p, hv, triton.cdiv(dv, state_bv))](
        key, g, w, u, h, state, final, cu_seqlens, cu_chunks,
        key.stride(0), key.stride(1),
        hv, dk, dv, hv // hk, 1e-6,
        BT=CHUNK, BK=bk, BV=state_bv, PRECISION=precision, num_warps=4, num_stages=1,
    )  # fmt: skip
    # No loop, nothing carried: q, k, the scores and a [Dk, BV] state at BV 64 and 4 warps.
    out_bv = min(max(triton.next_power_of_2(dv), 16), 64)
    _chunk_output_kernel[(max_chunks, hv, triton.cdiv(dv, out_bv))](
        query, key, g, u, h, out, cu_seqlens, cu_chunks,
        query.stride(0), query.stride(1),
        p, hv, dk, dv, hv // hk, dk**-0.5, 1e-6,
        BT=CHUNK, BK=bk, BV=out_bv, SEQ_TILE=SEQ_TILE, PRECISION=precision,
        num_warps=4,
    )  # fmt: skip
    return out, final
