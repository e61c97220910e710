"""Mixture-of-experts routing and SwiGLU experts in Triton, the twins of `route_torch` and
`experts_torch` (`blockdraft.kernels.moe`), with their signatures.

Routing (`triton_route`): one program per token takes the softmax over its E logits in fp32,
then the top-k by k rounds of max-and-remove (the lowest expert index among equal
probabilities), optionally renormalised, in one launch; with a shared expert's gate as a last
logit column, one more slot for expert E weighted sigmoid(gate) (the shared expert stacked
after the routed ones: `layers.moe.SparseMoE.fuse_projections`).

Experts (`triton_experts`): each token's k choices make T*k (token, slot) pairs, and every pair
is an expert MLP over one row. Two paths, both without a host sync (the grids and buffers are
sized by T, k and E alone, so the calls can be captured in CUDA graphs):

- grouped (prefill chunks, verify blocks, batches): the pairs are grouped by expert on the
  device (a stable counting sort in three launches: per-chunk counts, each expert's run of rows
  padded to whole BLOCK_M blocks, the scatter), into a row order whose blocks each belong to
  one expert. The padded size is bounded by T*k + min(E, T*k) * (BLOCK_M - 1) rows; blocks past
  the last run exit at once. Then one grouped GEMM launch for gate_up on tensor cores, with
  SiLU(gate) * up in its epilogue, and one for down, with the routing weight in its epilogue
  (both with the weight tile as the left operand, "swap AB", so that a block's few rows are
  the short side of Hopper's wgmma tile instead of forcing the older mma):
  each program owns one expert's block of rows and streams that expert's weight tile once for
  all of them, so an expert is read once per step however many of the step's tokens chose it
  (once per BLOCK_M of them, exactly).
- decode (T*k <= DECODE_MAX_PAIRS): no grouping; one program per (pair, N tile) streams its
  expert's weight rows against the pair's single activation row (the skinny GEMM's broadcast
  multiply, `triton_linear`), so a batch-1 step reads exactly its k experts.

Both write each pair's weighted output to a [T*k, H] buffer and a last kernel sums a token's k
rows in slot order in fp32: deterministic, no atomics. Rounding follows the twin: gate and up
rounded to x's dtype, silu rounded, the product rounded; the down projection rounded, times
the weight rounded to x's dtype; only the sum over slots is kept in fp32 (the twin adds in x's
dtype, expert by expert).

A pair whose id lies outside [0, E) has no expert and adds nothing: its programs exit at once
on the decode path, the grouping drops it, and the sum skips its row. Tensor parallelism routes
another rank's experts so (the router itself clamps: a NaN row of a padded token still gets
valid experts).

The router, the decode GEMVs and the sum are launched with programmatic dependent launch where
the active policy has it on (`blockdraft.kernels.pdl`: decode forwards on Hopper), as the
skinny GEMM and the norms are: a batch-1 MoE layer is a chain of four short launches. The
grouped path's launches are plain.

Launch parameters come from `GROUPED_CONFIGS` (by the number of pairs) and `DECODE_CONFIG`,
untuned first guesses for H200; `benchmarks/moe_bench.py` times them at Qwen3-30B-A3B shapes.
This file is the host side; the kernels are in `triton_moe_kernels`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton

from blockdraft.kernels.pdl import launch_options, pdl_enabled
from blockdraft.kernels.triton_moe_kernels import (
    _moe_count_kernel,
    _moe_decode_down_kernel,
    _moe_decode_gate_up_kernel,
    _moe_grouped_down_kernel,
    _moe_grouped_gate_up_kernel,
    _moe_offsets_kernel,
    _moe_route_kernel,
    _moe_scatter_kernel,
    _moe_sum_kernel,
)

__all__ = [
    "DECODE_CONFIG",
    "DECODE_MAX_PAIRS",
    "GROUPED_CONFIGS",
    "DecodeConfig",
    "GroupedConfig",
    "triton_experts",
    "triton_route",
]


class GroupedConfig(NamedTuple):
    """Launch parameters of the grouped path: the GEMM tiles and the grouping's chunk."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    pairs_per_program: int = 1024  # the grouping's chunk; a multiple of SORT_SUB

    def __repr__(self) -> str:
        return f"GroupedConfig{tuple(self)!r}"


class DecodeConfig(NamedTuple):
    """Launch parameters of the decode path (per GEMV; gate_up keeps two accumulators)."""

    block_n: int = 16
    gate_up_block_k: int = 256
    down_block_k: int = 512
    num_warps: int = 4
    num_stages: int = 1

    def __repr__(self) -> str:
        return f"DecodeConfig{tuple(self)!r}"


# Most pairs -> config. Few pairs a step (verify blocks, batched decode) leave each hit expert
# a row or two: 16-row tiles (the tensor cores' least), wide K chunks to keep the weight stream
# deep. Prefill chunks fill larger tiles, which reuse each weight tile across more rows.
GROUPED_CONFIGS: dict[int, GroupedConfig] = {
    512: GroupedConfig(16, 64, 128, 4, 3),
    4096: GroupedConfig(32, 64, 64, 4, 3),
    1 << 62: GroupedConfig(64, 128, 64, 8, 3),
}
DECODE_CONFIG = DecodeConfig()
# Up to here the per-pair GEMVs; past it experts repeat across pairs. Two tokens of top-8 with
# a shared expert's slot (18 pairs) still take them, as two tokens of plain top-8 (16) do.
DECODE_MAX_PAIRS = 18
SORT_SUB = 32  # pairs one step of the grouping compares against all experts


def pick_grouped_config(num_pairs: int) -> GroupedConfig:
    return GROUPED_CONFIGS[min(limit for limit in GROUPED_CONFIGS if num_pairs <= limit)]


def triton_route(
    router_logits: torch.Tensor,  # [num_tokens, num_experts (+ 1 with shared_expert)]
    top_k: int,
    renormalize: bool,
    shared_expert: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # (weights [num_tokens, top_k (+ 1)] fp32, ids int64)
    """`route_torch` in one launch: softmax over all experts in fp32, the top-k (the lowest
    index among equal probabilities), optionally renormalised to sum to one; with
    `shared_expert`, the last column's sigmoid as one more slot, for expert id num_experts."""
    if router_logits.dim() != 2:
        raise ValueError(f"router logits must be [tokens, experts], got {router_logits.shape}")
    num_tokens, num_experts = router_logits.shape
    num_experts -= int(shared_expert)
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}] (the experts), got {top_k}")
    device = router_logits.device
    slots = top_k + int(shared_expert)
    weights = torch.empty((num_tokens, slots), dtype=torch.float32, device=device)
    ids = torch.empty((num_tokens, slots), dtype=torch.int64, device=device)
    if num_tokens == 0:
        return weights, ids
    if router_logits.stride(1) != 1:
        router_logits = router_logits.contiguous()
    pdl = pdl_enabled(device)
    _moe_route_kernel[(num_tokens,)](
        router_logits,
        weights,
        ids,
        num_experts,
        router_logits.stride(0),
        TOP_K=top_k,
        BLOCK_E=triton.next_power_of_2(num_experts),
        BLOCK_K=triton.next_power_of_2(top_k),
        RENORMALIZE=renormalize,
        SHARED=shared_expert,
        PDL=pdl,
        num_warps=4 if num_experts > 256 else 1,
        **launch_options(pdl),
    )
    return weights, ids


def _check_experts_args(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> None:
    if x.dim() != 2 or w_gate_up.dim() != 3 or w_down.dim() != 3:
        raise ValueError("x must be [tokens, hidden], the expert weights [experts, ., .]")
    num_experts, two_inter, hidden = w_gate_up.shape
    if hidden != x.shape[1] or two_inter % 2:
        raise ValueError(
            f"w_gate_up {tuple(w_gate_up.shape)} must be [experts, 2 * intermediate, {x.shape[1]}]"
        )
    if w_down.shape != (num_experts, hidden, two_inter // 2):
        raise ValueError(
            f"w_down {tuple(w_down.shape)} must be {(num_experts, hidden, two_inter // 2)}"
        )
    if w_gate_up.dtype != x.dtype or w_down.dtype != x.dtype:
        raise ValueError("x and the expert weights must share one dtype")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} must be [{x.shape[0]}, top_k]")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError("topk_weights and topk_ids must have one shape")
    if topk_ids.dtype.is_floating_point:
        raise ValueError(f"topk_ids must be integers, got {topk_ids.dtype}")


def _unit_columns(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def triton_experts(
    x: torch.Tensor,  # [num_tokens, hidden]
    w_gate_up: torch.Tensor,  # [num_experts, 2 * intermediate, hidden]
    w_down: torch.Tensor,  # [num_experts, hidden, intermediate]
    topk_weights: torch.Tensor,  # [num_tokens, top_k] fp32
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int
    config: GroupedConfig | DecodeConfig | None = None,
) -> torch.Tensor:  # [num_tokens, hidden], x's dtype
    """`experts_torch`: sum_k weight_k * down_e(silu(gate_e(x)) * up_e(x)) over each token's
    chosen experts. The path follows the config's type; without one, the decode path serves
    up to DECODE_MAX_PAIRS (token, slot) pairs and the grouped path the rest."""
    _check_experts_args(x, w_gate_up, w_down, topk_weights, topk_ids)
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    out = torch.empty_like(x)
    if num_tokens == 0:
        return out
    num_pairs = num_tokens * top_k
    if config is None:
        config = DECODE_CONFIG if num_pairs <= DECODE_MAX_PAIRS else pick_grouped_config(num_pairs)
    x, w_gate_up, w_down = _unit_columns(x), _unit_columns(w_gate_up), _unit_columns(w_down)
    ids = topk_ids.reshape(-1).contiguous()
    weights = topk_weights.reshape(-1).float().contiguous()
    # A token's k pair rows together: the sum kernel reads them in slot order, skipping the
    # pairs without an expert (rows nothing writes).
    pairs = torch.empty((num_pairs, hidden), dtype=x.dtype, device=x.device)
    pdl = pdl_enabled(x.device)
    if isinstance(config, DecodeConfig):
        _decode_experts(x, w_gate_up, w_down, weights, ids, top_k, pairs, config, pdl)
    else:
        _grouped_experts(x, w_gate_up, w_down, weights, ids, top_k, pairs, config)
    block = min(1024, triton.next_power_of_2(hidden))
    _moe_sum_kernel[(num_tokens, triton.cdiv(hidden, block))](
        pairs, ids, out, w_down.shape[0], hidden, top_k, pairs.stride(0), out.stride(0),
        BLOCK=block, PDL=pdl, num_warps=4, **launch_options(pdl),
    )  # fmt: skip
    return out


def _decode_experts(
    x: torch.Tensor,  # [T, H]
    w_gate_up: torch.Tensor,  # [E, 2I, H]
    w_down: torch.Tensor,  # [E, H, I]
    weights: torch.Tensor,  # [S] fp32
    ids: torch.Tensor,  # [S]
    top_k: int,
    pairs: torch.Tensor,  # [S, H] out
    cfg: DecodeConfig,
    pdl: bool,
) -> None:
    num_pairs, hidden = pairs.shape
    num_experts, _, inter = w_down.shape
    h = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)
    gate_up_k = min(cfg.gate_up_block_k, max(16, triton.next_power_of_2(hidden)))
    _moe_decode_gate_up_kernel[(num_pairs, triton.cdiv(inter, cfg.block_n))](
        x,
        w_gate_up,
        ids,
        h,
        num_experts,
        hidden,
        inter,
        top_k,
        x.stride(0),
        w_gate_up.stride(0),
        w_gate_up.stride(1),
        h.stride(0),
        BLOCK_N=cfg.block_n,
        BLOCK_K=gate_up_k,
        EVEN_K=hidden % gate_up_k == 0,
        NUM_STAGES=cfg.num_stages,
        PDL=pdl,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **launch_options(pdl),
    )
    down_k = min(cfg.down_block_k, max(16, triton.next_power_of_2(inter)))
    _moe_decode_down_kernel[(num_pairs, triton.cdiv(hidden, cfg.block_n))](
        h,
        w_down,
        ids,
        weights,
        pairs,
        num_experts,
        hidden,
        inter,
        h.stride(0),
        w_down.stride(0),
        w_down.stride(1),
        pairs.stride(0),
        BLOCK_N=cfg.block_n,
        BLOCK_K=down_k,
        EVEN_K=inter % down_k == 0,
        NUM_STAGES=cfg.num_stages,
        PDL=pdl,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **launch_options(pdl),
    )


class Grouping(NamedTuple):
    """The pairs in expert order: block b of BLOCK_M rows belongs to expert block_expert[b]
    (-1: unused) and its first block_rows[b] rows hold the pairs sorted[b * BLOCK_M + r]."""

    sorted_pairs: torch.Tensor  # [max_blocks * BLOCK_M] int32
    block_expert: torch.Tensor  # [max_blocks] int32
    block_rows: torch.Tensor  # [max_blocks] int32


def group_by_expert(
    ids: torch.Tensor,  # [S] expert ids
    num_experts: int,
    block_m: int,
    pairs_per_program: int = 1024,
) -> Grouping:
    """The stable sort of the pairs by expert, each expert's run padded to whole blocks, on the
    device in three launches sized by S and E alone (no host sync)."""
    if pairs_per_program % SORT_SUB:
        raise ValueError(f"pairs_per_program must be a multiple of {SORT_SUB}")
    num_pairs = ids.numel()
    max_rows = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    max_blocks = triton.cdiv(max_rows, block_m)
    num_chunks = triton.cdiv(num_pairs, pairs_per_program)
    block_e = triton.next_power_of_2(num_experts)
    device = ids.device
    counts = torch.empty((num_chunks, block_e), dtype=torch.int32, device=device)
    chunk_base = torch.empty_like(counts)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=device)
    block_rows = torch.empty(max_blocks, dtype=torch.int32, device=device)
    # Rows without a pair are never read unmasked: no fill needed.
    sorted_pairs = torch.empty(max_blocks * block_m, dtype=torch.int32, device=device)
    warps = 4 if block_e <= 128 else 8
    _moe_count_kernel[(num_chunks,)](
        ids, counts, num_pairs, num_experts, CHUNK=pairs_per_program, SUB=SORT_SUB,
        BLOCK_E=block_e, num_warps=warps,
    )  # fmt: skip
    _moe_offsets_kernel[(1,)](
        counts, chunk_base, block_expert, block_rows, num_chunks, max_blocks, BLOCK_M=block_m,
        BLOCK_E=block_e, ROWS=16, BLOCK_B=32, num_warps=warps,
    )  # fmt: skip
    _moe_scatter_kernel[(num_chunks,)](
        ids, chunk_base, sorted_pairs, num_pairs, num_experts, CHUNK=pairs_per_program,
        SUB=SORT_SUB, BLOCK_E=block_e, num_warps=warps,
    )  # fmt: skip
    return Grouping(sorted_pairs, block_expert, block_rows)


def _grouped_experts(
    x: torch.Tensor,  # [T, H]
    w_gate_up: torch.Tensor,  # [E, 2I, H]
    w_down: torch.Tensor,  # [E, H, I]
    weights: torch.Tensor,  # [S] fp32
    ids: torch.Tensor,  # [S]
    top_k: int,
    pairs: torch.Tensor,  # [S, H] out
    cfg: GroupedConfig,
) -> None:
    num_experts, hidden, inter = w_down.shape
    bm = cfg.block_m
    grouping = group_by_expert(ids, num_experts, bm, cfg.pairs_per_program)
    max_blocks = grouping.block_expert.numel()
    h = torch.empty((max_blocks * bm, inter), dtype=x.dtype, device=x.device)
    gate_up_k = min(cfg.block_k, max(16, triton.next_power_of_2(hidden)))
    _moe_grouped_gate_up_kernel[(max_blocks, triton.cdiv(inter, cfg.block_n))](
        x,
        w_gate_up,
        h,
        *grouping,
        hidden,
        inter,
        top_k,
        x.stride(0),
        w_gate_up.stride(0),
        w_gate_up.stride(1),
        h.stride(0),
        BLOCK_M=bm,
        BLOCK_N=cfg.block_n,
        BLOCK_K=gate_up_k,
        EVEN_K=hidden % gate_up_k == 0,
        NUM_STAGES=cfg.num_stages,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    down_k = min(cfg.block_k, max(16, triton.next_power_of_2(inter)))
    _moe_grouped_down_kernel[(max_blocks, triton.cdiv(hidden, cfg.block_n))](
        h,
        w_down,
        weights,
        pairs,
        *grouping,
        hidden,
        inter,
        h.stride(0),
        w_down.stride(0),
        w_down.stride(1),
        pairs.stride(0),
        BLOCK_M=bm,
        BLOCK_N=cfg.block_n,
        BLOCK_K=down_k,
        EVEN_K=inter % down_k == 0,
        NUM_STAGES=cfg.num_stages,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
