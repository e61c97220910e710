"""Mixture-of-experts routing and expert compute, torch twins: the reference the Triton kernels
are tested against, and the CPU path. Experts are SwiGLU MLPs stacked along a leading expert
dimension (`w_gate_up[e]` = [gate; up] rows, as transformers' `Qwen3MoeExperts` stores them)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from blockdraft.kernels.select import use_triton


def route_torch(
    router_logits: torch.Tensor,  # [num_tokens, num_experts]
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # (weights [num_tokens, top_k] fp32, ids int64)
    """Softmax over all experts in float32, the top-k, optionally renormalised to sum to one
    (`norm_topk_prob`)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def experts_torch(
    x: torch.Tensor,  # [num_tokens, hidden]
    w_gate_up: torch.Tensor,  # [num_experts, 2 * intermediate, hidden]
    w_down: torch.Tensor,  # [num_experts, hidden, intermediate]
    topk_weights: torch.Tensor,  # [num_tokens, top_k] fp32
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int
) -> torch.Tensor:  # [num_tokens, hidden], x's dtype
    """sum_k weight_k * down_e(silu(gate_e(x)) * up_e(x)) over each token's chosen experts e,
    one GEMM per expert hit (tokens grouped by expert). The routing weight is applied in x's
    dtype after the down projection, as transformers does. Ids outside [0, num_experts) choose
    no expert (another rank's, under tensor parallelism)."""
    out = torch.zeros_like(x)
    for expert in torch.unique(topk_ids).tolist():
        if not 0 <= expert < w_gate_up.shape[0]:
            continue
        rows, slots = torch.where(topk_ids == expert)
        gate, up = F.linear(x[rows], w_gate_up[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w_down[expert])
        out.index_add_(0, rows, y * topk_weights[rows, slots, None].to(x.dtype))
    return out


RouteFn = Callable[[torch.Tensor, int, bool], tuple[torch.Tensor, torch.Tensor]]
ExpertsFn = Callable[..., torch.Tensor]


def moe_backend(device: torch.device | str | None = None) -> tuple[RouteFn, ExpertsFn]:
    """The (route, experts) pair the MoE layer calls for tensors on `device`, with the signatures
    of `route_torch` and `experts_torch`: the one place an MoE kernel choice is made. The
    switch is `blockdraft.kernels.select`'s (the active policy's backend: Triton on CUDA by
    default); the Triton module is imported on first use, as select does."""
    if use_triton(device):
        from blockdraft.kernels import triton_moe

        return triton_moe.triton_route, triton_moe.triton_experts
    return route_torch, experts_torch
