"""Top-K of each row of a wide matrix (a drafter's logits over the vocabulary) in two launches.

The specification is `torch.topk(x, k, dim=-1)` (sorted, largest first); here ties go to the
lowest column, which torch leaves unspecified, so on tied values the two may pick different
columns of equal value. DFlash2's candidate selector takes K ~16 of ~150k logits for each draft
position: torch's radix select costs ~40 us there, several passes over [R, V].

`_group_max_kernel` takes every group of GROUP columns' maximum in one pass over [R, V];
`_top_k_groups_kernel`, one program per row, takes the K groups with the best maxima, then the
K best values of those groups, each by K rounds of (max, lowest column holding it). A group's
maximum precedes every other value of the group in that order, so the row's top K lie in its K
best groups. Two passes over few bytes beat per-chunk top Ks merged afterwards: the chunks' K
rounds over their groups serialise where this pass only reads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from blockdraft.kernels.triton_sampling import BIG_INDEX

GROUP = 32  # columns per group: the first pass ranks the groups by their maxima first


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
def _top_of_best_groups(
    row_ptr, group_max, first_col, alive, vocab, k, GROUP: tl.constexpr, BLOCK_K: tl.constexpr
):  # -> the k best values of the k groups with the best maxima, and their columns
    _, best_groups = _take_top(group_max, first_col, alive, k, BLOCK_K)
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
    BLOCK_G: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    gs = tl.arange(0, BLOCK_G)
    alive = gs < num_groups
    group_max = tl.load(max_ptr + row * num_groups + gs, mask=alive, other=float("-inf"))
    first_col = gs.to(tl.int64) * GROUP
    # The row's top k lie in its k best groups by their maxima (see the module's docstring).
    top_v, top_i = _top_of_best_groups(
        x_ptr + row * stride_x, group_max, first_col, alive, vocab, k, GROUP, BLOCK_K
    )
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
    num_warps: int = 8,
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
            BLOCK_G=triton.next_power_of_2(num_groups), BLOCK_K=triton.next_power_of_2(k),
            num_warps=num_warps,
        )  # fmt: skip
    return out_vals.view(*x.shape[:-1], k), out_cols.view(*x.shape[:-1], k)
