"""Mixture-of-experts routing and expert compute, torch twins: the reference the Triton kernels
are tested against, and the CPU path. Experts are SwiGLU MLPs stacked along a leading expert
dimension (`w_gate_up[e]` = [gate; up] rows, as transformers' `Qwen3MoeExperts` stores them)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from blockdraft.kernels.select import use_triton


def route_torch(
    router_logits: torch.Tensor,  # [num_tokens, num_experts (+ 1 with shared_expert)]
    top_k: int,
    renormalize: bool,
    shared_expert: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # (weights [num_tokens, top_k (+ 1)] fp32, ids int64)
    """Softmax over all experts in float32, the top-k, optionally renormalised to sum to one
    (`norm_topk_prob`). With `shared_expert`, the last logit column is the shared expert's
    gate: one more slot routes every token to expert id num_experts (the shared expert stacked
    after the routed ones) with weight sigmoid(logit), outside the softmax and the
    renormalisation."""
    routed = router_logits[:, :-1] if shared_expert else router_logits
    probs = torch.softmax(routed.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if shared_expert:
        gate = torch.sigmoid(router_logits[:, -1:].float())
        weights = torch.cat((weights, gate), dim=-1)
        ids = torch.cat((ids, torch.full_like(ids[:, :1], routed.shape[-1])), dim=-1)
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


RouteFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
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
