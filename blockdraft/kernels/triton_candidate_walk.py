"""`candidate_walk.candidate_walk_torch` in two launches (the torch twin is about thirty).

`_candidate_table_kernel`, one program per (request, position i): gathers the K candidates'
successor rows and the K predecessors' rows (position i - 1's candidates, or the anchor) from
the codebooks, scores every (predecessor j, candidate k) pair, and writes the softmax of row j
at the request's temperature and the candidate row j leads to: the best score for a greedy row,
else the exponential race over the probabilities with the uniforms of (seed, position + i) —
the same uniforms, columns and tie rule as the twin's race. `_candidate_path_kernel`, one
program per request, follows the tables from the anchor (N dependent loads) and writes the
tokens and each position's q (its softmax row given the previous pick, one-hot when greedy).

Scores are fp32 dot products (FMAs, no tf32) summed in another order than the twin's matmul,
the softmax's exp is Triton's and the log libdevice's (numpy's under the interpreter): values
agree to a few ulps, so only a near-exact tie between two candidates can go the other way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from blockdraft.kernels.sampling import salted_row_init
from blockdraft.kernels.triton_env import triton_interpreting
from blockdraft.kernels.triton_sampling import BIG_INDEX, _column_uniforms, _seed_position_hash


@triton.jit
def _first_argmax_rows(vals, idx):  # [J, B] float32, [J, B] int64 -> [J] lowest best index
    # torch.argmax order per row: NaN above everything, then the largest value, lowest index.
    is_nan = vals != vals
    any_nan = tl.max(is_nan.to(tl.int32), axis=1) > 0
    best = tl.max(tl.where(is_nan, float("-inf"), vals), axis=1)
    hit = tl.where(any_nan[:, None], is_nan, vals == best[:, None])
    return tl.min(tl.where(hit, idx, BIG_INDEX), axis=1)


@triton.jit(do_not_specialize=["h_salt"])
def _candidate_table_kernel(
    proj_ptr,  # [R, N, rank], contiguous
    unary_ptr,  # [R, N, K] float32, contiguous
    cand_ptr,  # [R, N, K] int64, contiguous
    anchor_ptr,  # [R] int64
    pred_cb_ptr,  # [V, rank], unit column stride
    succ_cb_ptr,  # [V, rank], unit column stride
    temp_ptr,  # [R] float32
    seed_ptr,  # [R] int64
    pos_ptr,  # [R] int64, first draft position
    choice_ptr,  # [R, N, K] int64 out: the candidate predecessor j leads to
    probs_ptr,  # [R, N, K, K] float32 out: softmax row of predecessor j
    n,
    top_k,
    rank,
    stride_pred_cb,
    stride_succ_cb,
    h_salt,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PRECISE_LOG: tl.constexpr,
):
    req = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    k_ok = ks < top_k
    row = req * n + i  # this position's row of K candidates
    cand = tl.load(cand_ptr + row * top_k + ks, mask=k_ok, other=0)
    prev = tl.load(cand_ptr + (row - 1) * top_k + ks, mask=k_ok & (i > 0), other=0)
    pred = tl.where(i > 0, prev, tl.load(anchor_ptr + req))
    acc = tl.zeros([BLOCK_K, BLOCK_K], dtype=tl.float32)  # [j, k]
    for start in range(0, rank, BLOCK_R):
        rs = start + tl.arange(0, BLOCK_R)
        r_ok = rs < rank
        both = k_ok[:, None] & r_ok[None, :]
        h = tl.load(proj_ptr + row * rank + rs, mask=r_ok, other=0.0).to(tl.float32)
        succ = tl.load(
            succ_cb_ptr + cand[:, None] * stride_succ_cb + rs[None, :], mask=both, other=0.0
        ).to(tl.float32)
        prd = tl.load(
            pred_cb_ptr + pred[:, None] * stride_pred_cb + rs[None, :], mask=both, other=0.0
        ).to(tl.float32)
        # fp32 FMAs, not tf32: the scores are the twin's to a few ulps
        acc = tl.dot(prd, tl.trans(succ * h[None, :]), acc, input_precision="ieee")
    unary = tl.load(unary_ptr + row * top_k + ks, mask=k_ok, other=0.0)
    scores = tl.where(k_ok[None, :], unary[None, :] + acc, float("-inf"))
    idx = tl.broadcast_to(tl.where(k_ok, ks.to(tl.int64), BIG_INDEX)[None, :], [BLOCK_K, BLOCK_K])
    temp = tl.load(temp_ptr + req)
    greedy = temp == 0.0
    z = tl.math.div_rn(scores, tl.where(greedy, 1.0, temp))
    e = tl.exp(z - tl.max(z, axis=1)[:, None])
    probs = tl.math.div_rn(e, tl.sum(e, axis=1)[:, None])
    position = tl.load(pos_ptr + req).to(tl.int64) + i
    u = _column_uniforms(
        _seed_position_hash(tl.load(seed_ptr + req).to(tl.int64), position, h_salt),
        ks.to(tl.int64),
    )
    if PRECISE_LOG:  # as the sampler's race (triton_sampling)
        neg_log_u = -libdevice.log(u)
    else:
        neg_log_u = -tl.log(u)
    race = tl.where(k_ok[None, :], tl.math.div_rn(probs, neg_log_u[None, :]), float("-inf"))
    choice = tl.where(greedy, _first_argmax_rows(scores, idx), _first_argmax_rows(race, idx))
    tl.store(choice_ptr + row * top_k + ks, choice, mask=k_ok)
    out = probs_ptr + (row * top_k + ks[:, None]) * top_k + ks[None, :]
    tl.store(out, probs, mask=k_ok[:, None] & k_ok[None, :])


@triton.jit
def _candidate_path_kernel(
    choice_ptr,  # [R, N, K] int64
    probs_ptr,  # [R, N, K, K] float32
    cand_ptr,  # [R, N, K] int64
    temp_ptr,  # [R] float32
    tokens_ptr,  # [R, N] int64 out
    q_ptr,  # [R, N, K] float32 out
    n,
    top_k,
    BLOCK_K: tl.constexpr,
):
    req = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    k_ok = ks < top_k
    greedy = tl.load(temp_ptr + req) == 0.0
    prev = tl.zeros([], dtype=tl.int64)  # position 0's rows are equal: row 0
    for i in range(n):
        row = req * n + i
        pick = tl.load(choice_ptr + row * top_k + prev)
        tl.store(tokens_ptr + row, tl.load(cand_ptr + row * top_k + pick))
        probs = tl.load(probs_ptr + (row * top_k + prev) * top_k + ks, mask=k_ok, other=0.0)
        q = tl.where(greedy, (ks == pick).to(tl.float32), probs)
        tl.store(q_ptr + row * top_k + ks, q, mask=k_ok)
        prev = pick


def triton_candidate_walk(
    projected: torch.Tensor,  # [R, N, r]
    unary: torch.Tensor,  # [R, N, K] float32
    candidates: torch.Tensor,  # [R, N, K] int64
    anchors: torch.Tensor,  # [R] int64
    predecessor_codebook: torch.Tensor,  # [V, r]
    successor_codebook: torch.Tensor,  # [V, r]
    temperature: torch.Tensor,  # [R] float32; 0 => greedy
    seed: torch.Tensor,  # [R] int64
    position: torch.Tensor,  # [R] int64, first draft position
    salt: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # tokens [R, N] int64, q [R, N, K] float32
    """`candidate_walk.candidate_walk_torch` in two launches, no host sync."""
    num_reqs, n, top_k = candidates.shape
    rank = projected.shape[-1]
    if projected.shape != (num_reqs, n, rank) or unary.shape != candidates.shape:
        raise ValueError(
            f"projected {tuple(projected.shape)} and unary {tuple(unary.shape)} do not match "
            f"candidates {tuple(candidates.shape)}"
        )
    for name, book in (("predecessor", predecessor_codebook), ("successor", successor_codebook)):
        if book.dim() != 2 or book.shape[1] != rank:
            raise ValueError(f"{name} codebook {tuple(book.shape)} does not have rank {rank}")
    predecessor_codebook, successor_codebook = (
        book if book.stride(1) == 1 else book.contiguous()
        for book in (predecessor_codebook, successor_codebook)
    )
    device = candidates.device
    tokens = torch.empty(num_reqs, n, dtype=torch.int64, device=device)
    q = torch.empty(num_reqs, n, top_k, dtype=torch.float32, device=device)
    if num_reqs == 0 or n == 0:
        return tokens, q
    choice = torch.empty(num_reqs, n, top_k, dtype=torch.int64, device=device)
    probs = torch.empty(num_reqs, n, top_k, top_k, dtype=torch.float32, device=device)
    candidates = candidates.contiguous()
    temperature = temperature.to(torch.float32).contiguous()
    block_k = max(16, triton.next_power_of_2(top_k))  # tl.dot tiles are >= 16 a side
    _candidate_table_kernel[(num_reqs, n)](
        projected.contiguous(),
        unary.to(torch.float32).contiguous(),
        candidates,
        anchors.to(torch.int64).contiguous(),
        predecessor_codebook,
        successor_codebook,
        temperature,
        seed.to(torch.int64).contiguous(),
        position.to(torch.int64).contiguous(),
        choice,
        probs,
        n,
        top_k,
        rank,
        predecessor_codebook.stride(0),
        successor_codebook.stride(0),
        salted_row_init(salt),
        BLOCK_K=block_k,
        BLOCK_R=max(16, min(64, triton.next_power_of_2(rank))),
        PRECISE_LOG=not triton_interpreting(),
        num_warps=4,
    )
    _candidate_path_kernel[(num_reqs,)](
        choice, probs, candidates, temperature, tokens, q, n, top_k, BLOCK_K=block_k, num_warps=1
    )
    return tokens, q
