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

This file is the host side: the launch rules (split counts, tile sizes, warps) and the launchers.
The kernels are in `triton_attention_kernels`, their per-tile device functions in
`triton_attention_tiles`. The launchers look the kernels up here, at call time.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton

from blockdraft.kernels.forward_context import AttentionMetadata, current_kernel_policy
from blockdraft.kernels.pdl import launch_options, num_sms, pdl_enabled
from blockdraft.kernels.triton_attention_kernels import (
    _paged_attention_kernel,
    _paged_attention_reduce_kernel,
)
from blockdraft.kernels.triton_rope import triton_qk_norm_rope_store

_LOG2E = 1.4426950408889634


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
    cos_cache: torch.Tensor,  # [max_position, rotary_dim / 2]
) -> str | None:
    """What keeps the attention kernel from norming, rotating and storing this step itself
    (`step_kv`), or None."""
    if query.shape[-1] % 2 or any(t.stride(-1) != 1 for t in (query, key, value)):
        return "RoPE needs an even, contiguous head_dim"
    if 2 * cos_cache.shape[-1] != query.shape[-1]:
        return "step_kv rotates whole heads (a partial rotary table takes the RoPE kernel)"
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
    problem = _step_kv_problem(
        query, kv.key, kv.value, kv.q_norm_weight, kv.k_norm_weight, kv.cos_cache
    )
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
    cos_cache: torch.Tensor,  # [max_position, rotary_dim / 2]
    meta: AttentionMetadata,
) -> bool:
    """Whether the attention kernel can norm, rotate and store this step itself (`step_kv`)."""
    rows, group = meta.max_query_len, query.shape[1] // max(key.shape[1], 1)
    return (
        0 < rows <= current_kernel_policy().rope_in_attention_max_query_len
        and group >= 1
        and _block_m(rows, group) // group >= rows  # one tile a sequence
        and _step_kv_problem(query, key, value, q_norm_weight, k_norm_weight, cos_cache) is None
    )


def triton_rope_store_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], before q norm and RoPE
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], before k norm and RoPE
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    positions: torch.Tensor,  # [num_tokens] int64
    cos_cache: torch.Tensor,  # [max_position, rotary_dim / 2] float32, rotary_dim <= head_dim
    sin_cache: torch.Tensor,  # [max_position, rotary_dim / 2] float32
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
    if rope_fits_attention(query, key, value, q_norm_weight, k_norm_weight, cos_cache, meta):
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
