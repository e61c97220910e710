"""Top-K of each row of a wide matrix (a drafter's logits over the vocabulary) in two launches.

The specification is `torch.topk(x, k, dim=-1)` (sorted, largest first); here ties go to the
lowest column, which torch leaves unspecified, so on tied values the two may pick different
columns of equal value. DFlash2's candidate selector takes K ~16 of ~150k logits for each draft
position: torch's radix select costs ~40 us there, several passes over [R, V].

`_group_max_kernel` takes every group of GROUP columns' maximum in one pass over [R, V];
`_top_k_groups_kernel`, one program per row, takes the K groups with the best maxima, then the
K best values of those groups, each by K rounds of (max, lowest column holding it). A group's
maximum precedes every other value of the group in that order, so the row's top K lie in its K
best groups. The rounds over the groups go by chunks of CHUNK groups: a round reduces the
chunks' maxima and reads one chunk, not all ~4,700 group maxima of a 150k vocabulary (H100,
k = 16 of 151,936 bf16 columns, both launches: 49 / 60 / 183 -> 40 / 55 / 155 us at 15 / 120 /
480 rows; torch.topk 75 / 253 / 651, argmax 16 / 42 / 102). Two passes over few bytes beat
per-program top Ks of column ranges merged afterwards: those programs' K rounds serialise where
the first pass only reads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from blockdraft.kernels.triton_sampling import BIG_INDEX

GROUP = 32  # columns per group: the first pass ranks the groups by their maxima first
CHUNK = 32  # groups per chunk of the second pass's ranking


@triton.jit
def _take_top(vals, cols, alive, k, BLOCK_K: tl.constexpr):
    # vals [B] float32, cols [B] int64, alive [B] bool -> ([BLOCK_K] values, [BLOCK_K] columns)
    ks = tl.arange(0, BLOCK_K)
    top_v = tl.full([BLOCK_K], float("-inf"), dtype=tl.float32)
    top_i = tl.full([BLOCK_K], BIG_INDEX, dtype=tl.int64)
    for t in range(k):
        best = tl.max(tl.where(alive, vals, float("-inf")), axis=0)
        col = tl.min(tl.where(alive & (vals == best), cols, BIG_INDEX), axis=0)
        top_v = tl.where(ks == t, best, top_v)
        top_i = tl.where(ks == t, col, top_i)
        alive = alive & (cols != col)
    return top_v, top_i


@triton.jit
def _best_groups(
    max_row_ptr,
    num_groups,
    k,
    GROUP: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # -> [BLOCK_K] the first columns of the k groups with the best maxima, best first
    # K rounds of (max, lowest index) over every group maximum would each reduce the whole row;
    # instead the groups come in chunks whose maxima (of their groups not yet taken) pick the
    # chunk a round takes from, and only that chunk is read again.
    cs = tl.arange(0, BLOCK_C)
    lanes = tl.arange(0, CHUNK).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    groups = cs.to(tl.int64)[:, None] * CHUNK + lanes[None, :]
    tile = tl.load(max_row_ptr + groups, mask=groups < num_groups, other=float("-inf"))
    chunk_max = tl.max(tile, axis=1)
    chunk_live = tl.minimum(tl.maximum(num_groups - cs * CHUNK, 0), CHUNK)
    taken = tl.full([BLOCK_K], BIG_INDEX, dtype=tl.int64)
    for t in range(k):
        live = chunk_live > 0
        best = tl.max(tl.where(live, chunk_max, float("-inf")), axis=0)
        c = tl.min(tl.where(live & (chunk_max == best), cs, BLOCK_C), axis=0)
        g = c.to(tl.int64) * CHUNK + lanes
        vals = tl.load(max_row_ptr + g, mask=g < num_groups, other=float("-inf"))
        dead = tl.max((g[:, None] == taken[None, :]).to(tl.int32), axis=1) > 0
        ok = (g < num_groups) & ~dead
        pick = tl.min(tl.where(ok & (vals == best), g, BIG_INDEX), axis=0)
        rest = ok & (g != pick)
        chunk_max = tl.where(
            cs == c, tl.max(tl.where(rest, vals, float("-inf")), axis=0), chunk_max
        )
        chunk_live = tl.where(cs == c, chunk_live - 1, chunk_live)
        taken = tl.where((ks == t) & (pick < BIG_INDEX), pick, taken)
    return tl.where(taken < BIG_INDEX, taken * GROUP, BIG_INDEX)


@triton.jit
def _top_of_groups(
    row_ptr, best_groups, vocab, k, GROUP: tl.constexpr, BLOCK_K: tl.constexpr
):  # -> the k best values of the groups starting at `best_groups` (BIG_INDEX: none), columns
    lanes = tl.arange(0, GROUP).to(tl.int64)
    picked = best_groups[:, None] + lanes[None, :]  # [BLOCK_K, GROUP]; BIG_INDEX rows unused
    ok = (best_groups < BIG_INDEX)[:, None] & (picked < vocab)
    cand = tl.load(row_ptr + picked, mask=ok, other=float("-inf"))
    return _take_top(
        tl.reshape(cand.to(tl.float32), [BLOCK_K * GROUP]),
        tl.reshape(tl.where(ok, picked, BIG_INDEX), [BLOCK_K * GROUP]),
        tl.reshape(ok, [BLOCK_K * GROUP]),
        k,
        BLOCK_K,
    )


@triton.jit
def _group_max_kernel(
    x_ptr,  # [R, V], unit column stride
    max_ptr,  # [R, num_groups] float32 out
    stride_x,
    vocab,
    num_groups,
    GROUP: tl.constexpr,
    GROUPS_PER_PROGRAM: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * GROUPS_PER_PROGRAM + tl.arange(0, GROUPS_PER_PROGRAM)
    cols = groups.to(tl.int64)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    vals = tl.load(x_ptr + row * stride_x + cols, mask=cols < vocab, other=float("-inf"))
    group_max = tl.max(vals.to(tl.float32), axis=1)
    tl.store(max_ptr + row * num_groups + groups, group_max, mask=groups < num_groups)


@triton.jit
def _top_k_groups_kernel(
    x_ptr,  # [R, V], unit column stride
    max_ptr,  # [R, num_groups] float32, each group's maximum
    out_vals_ptr,  # [R, k] float32
    out_cols_ptr,  # [R, k] int64
    stride_x,
    vocab,
    num_groups,
    k,
    GROUP: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    # The row's top k lie in its k best groups by their maxima (see the module's docstring).
    best_groups = _best_groups(
        max_ptr + row * num_groups, num_groups, k, GROUP, CHUNK, BLOCK_C, BLOCK_K
    )
    top_v, top_i = _top_of_groups(x_ptr + row * stride_x, best_groups, vocab, k, GROUP, BLOCK_K)
    ks = tl.arange(0, BLOCK_K)
    tl.store(out_vals_ptr + row * k + ks, top_v, mask=ks < k)
    tl.store(out_cols_ptr + row * k + ks, top_i, mask=ks < k)


def _rows_and_outputs(
    x: torch.Tensor,  # [..., V]
    k: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # rows [R, V], values [R, k], columns
    vocab = x.shape[-1]
    if not 1 <= k <= vocab:
        raise ValueError(f"top-k needs 1 <= k <= {vocab} (the row length), got k={k}")
    rows = x.reshape(-1, vocab)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    n = rows.shape[0]
    out_vals = torch.empty(n, k, dtype=torch.float32, device=x.device)
    return rows, out_vals, torch.empty(n, k, dtype=torch.int64, device=x.device)


def triton_top_k(
    x: torch.Tensor,  # [..., V]
    k: int,
    groups_per_program: int = 256,
    num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:  # values [..., k] float32, columns [..., k] int64
    """The k largest values of each row, largest first (ties: lowest column first).
    `groups_per_program`: groups a first-pass program takes the maxima of."""
    rows, out_vals, out_cols = _rows_and_outputs(x, k)
    n, vocab = rows.shape
    if n:
        num_groups = triton.cdiv(vocab, GROUP)
        gpp = min(groups_per_program, triton.next_power_of_2(num_groups))
        maxima = torch.empty(n, num_groups, dtype=torch.float32, device=x.device)
        _group_max_kernel[(n, triton.cdiv(num_groups, gpp))](
            rows, maxima, rows.stride(0), vocab, num_groups, GROUP=GROUP,
            GROUPS_PER_PROGRAM=gpp, num_warps=4,
        )  # fmt: skip
        _top_k_groups_kernel[(n,)](
            rows, maxima, out_vals, out_cols, rows.stride(0), vocab, num_groups, k, GROUP=GROUP,
            CHUNK=CHUNK, BLOCK_C=triton.next_power_of_2(triton.cdiv(num_groups, CHUNK)),
            BLOCK_K=triton.next_power_of_2(k),
            num_warps=num_warps,
        )  # fmt: skip
    return out_vals.view(*x.shape[:-1], k), out_cols.view(*x.shape[:-1], k)
