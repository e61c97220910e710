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
chunks' best and reads one chunk, not all ~4,700 group maxima of a 150k vocabulary (H100,
k = 16 of 151,936 bf16 columns, both launches: 49 / 60 / 183 -> 40 / 55 / 155 us at 15 / 120 /
480 rows; torch.topk 75 / 253 / 651, argmax 16 / 42 / 102). Two passes over few bytes beat
per-program top Ks of column ranges merged afterwards: those programs' K rounds serialise where
the first pass only reads. The second pass's time is its rounds' reductions, one program's
warps meeting in shared memory each time: a candidate is one int64 key (`_keys`), so a round is
one reduction where a value and then its lowest column took two, and a chunk's next best is its
largest key below the one taken, where a list of the groups taken was searched (H100, k = 16
of 151,936, both launches in a CUDA graph: 32.9 / 41.8 / 144.1 -> 28.1 / 42.2 / 136.9 us at
15 / 120 / 480 rows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GROUP = 32  # columns per group: the first pass ranks the groups by their maxima first
CHUNK = 32  # groups per chunk of the second pass's ranking
# The second pass runs 8 warps up to this many rows, 4 past it: at 4 warps a program spills
# (255 registers, 72 bytes a thread on sm_90; 183 and none at 8), and 8 warps took 11-16% off
# 15 and 120 rows (151,936 columns, k = 8 and 16; H100, CUDA graphs) but added 1-10% at 480,
# where every SM has several programs to switch between anyway.
WIDE_MAX_ROWS = 128


# A candidate is one int64 key, (value's order-preserving bits) << 32 | (LOW_BITS - column):
# keys order as values do, ties by the lowest column, and no two are equal, so each round of
# (max, lowest column holding it) is one reduction, and the next best is the largest key below
# the last one taken (no list of those taken).
LOW_BITS: tl.constexpr = tl.constexpr(2**32 - 1)
NO_KEY: tl.constexpr = tl.constexpr(-(2**63))  # below every key: masked candidates


@triton.jit
def _keys(vals, cols):  # float32 [..], int64 [..] (< 2**32) -> int64 keys
    # -0.0 ranks as 0.0 (torch's order: equal values).
    bits = tl.where(vals == 0.0, 0.0, vals).to(tl.int32, bitcast=True)
    # Negative floats order backwards as integers: flip their magnitude bits.
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    low = tl.full([], LOW_BITS, tl.int64)
    return (ordered.to(tl.int64) << 32) | (low - cols)


@triton.jit
def _key_columns(keys):  # int64 keys -> int64 columns
    low = tl.full([], LOW_BITS, tl.int64)
    return low - (keys & low)


@triton.jit
def _key_values(keys):  # int64 keys -> float32 values
    ordered = (keys >> 32).to(tl.int32)
    bits = tl.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _take_top(keys, k, BLOCK_K: tl.constexpr):
    # keys [B] int64 (NO_KEY: none) -> the k largest, best first ([BLOCK_K], NO_KEY past k)
    ks = tl.arange(0, BLOCK_K)
    top = tl.full([BLOCK_K], NO_KEY, dtype=tl.int64)
    for t in range(k):
        best = tl.max(keys, axis=0)
        top = tl.where(ks == t, best, top)
        keys = tl.where(keys == best, NO_KEY, keys)
    return top


@triton.jit
def _best_groups(
    max_row_ptr,
    num_groups,
    k,
    CHUNK: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # -> [BLOCK_K] the k groups with the best maxima, best first (-1: none)
    # K rounds over every group maximum would each reduce the whole row; instead each chunk of
    # CHUNK groups keeps its best key not taken yet, a round takes the best of those, and only
    # that chunk is read again (for its best key below the one taken).
    cs = tl.arange(0, BLOCK_C)
    lanes = tl.arange(0, CHUNK).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    groups = cs.to(tl.int64)[:, None] * CHUNK + lanes[None, :]
    real = groups < num_groups
    tile = tl.load(max_row_ptr + groups, mask=real, other=float("-inf"))
    chunk_key = tl.max(tl.where(real, _keys(tile, groups), NO_KEY), axis=1)
    taken = tl.full([BLOCK_K], -1, dtype=tl.int64)
    for t in range(k):
        best = tl.max(chunk_key, axis=0)
        group = _key_columns(best)
        c = group // CHUNK
        g = c * CHUNK + lanes
        ok = g < num_groups
        vals = tl.load(max_row_ptr + g, mask=ok, other=float("-inf"))
        keys = tl.where(ok, _keys(vals, g), NO_KEY)
        rest = tl.max(tl.where(keys < best, keys, NO_KEY), axis=0)
        chunk_key = tl.where(cs == c, rest, chunk_key)
        taken = tl.where((ks == t) & (best > NO_KEY), group, taken)
    return taken


@triton.jit
def _top_of_groups(
    row_ptr, best_groups, vocab, k, GROUP: tl.constexpr, BLOCK_K: tl.constexpr
):  # -> the k best keys of the groups `best_groups` (-1: none), best first
    lanes = tl.arange(0, GROUP).to(tl.int64)
    picked = best_groups[:, None] * GROUP + lanes[None, :]  # [BLOCK_K, GROUP]; -1 rows unused
    ok = (best_groups >= 0)[:, None] & (picked < vocab)
    cand = tl.load(row_ptr + picked, mask=ok, other=float("-inf"))
    keys = tl.where(ok, _keys(cand.to(tl.float32), picked), NO_KEY)
    return _take_top(tl.reshape(keys, [BLOCK_K * GROUP]), k, BLOCK_K)


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
    best_groups = _best_groups(max_ptr + row * num_groups, num_groups, k, CHUNK, BLOCK_C, BLOCK_K)
    top = _top_of_groups(x_ptr + row * stride_x, best_groups, vocab, k, GROUP, BLOCK_K)
    ks = tl.arange(0, BLOCK_K)
    tl.store(out_vals_ptr + row * k + ks, _key_values(top), mask=ks < k)
    tl.store(out_cols_ptr + row * k + ks, _key_columns(top), mask=ks < k)


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
    num_warps: int | None = None,  # the second pass's; None: 8 up to WIDE_MAX_ROWS rows, else 4
) -> tuple[torch.Tensor, torch.Tensor]:  # values [..., k] float32, columns [..., k] int64
    """The k largest values of each row, largest first (ties: lowest column first).
    `groups_per_program`: groups a first-pass program takes the maxima of."""
    rows, out_vals, out_cols = _rows_and_outputs(x, k)
    n, vocab = rows.shape
    if n:
        if num_warps is None:
            num_warps = 8 if n <= WIDE_MAX_ROWS else 4
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
