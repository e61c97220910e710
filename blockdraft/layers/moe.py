"""Sparse mixture-of-experts MLP: a router picks each token's top-k experts (SwiGLU MLPs stacked
along a leading expert dimension) and sums their outputs weighted by the routing probabilities;
optionally a shared expert every token goes through, scaled by a sigmoid gate (Qwen3-Next,
Qwen3.5-MoE). Parameter names follow transformers 5 (`gate.weight`,
`experts.gate_up_proj`, `experts.down_proj`, `shared_expert.*`, `shared_expert_gate.weight`)
so that state dicts match; checkpoints with one tensor per expert are stacked at load
(`expert_tensor_slice`). For inference a shared expert as wide as the routed ones joins their
stack (`SparseMoE.fuse_projections`): the kernels run it as one more expert every token picks.

Under tensor parallelism each rank holds a contiguous range of the experts (`num_experts`
divisible by the ranks) and the router whole: every rank routes every token alike, runs its own
experts on the slots routed to them (the others keep their place with id -1, which the kernels
skip, so shapes stay fixed: no host sync, CUDA-graph safe) and the ranks' partial sums meet in
one all-reduce, which also sums the shared expert's (split like the dense MLP, its intermediate
features over the ranks)."""

from __future__ import annotations

import re

import torch
from torch import nn

from blockdraft.distributed.tensor_parallel import Shard, current_tensor_parallel, tag_shard
from blockdraft.kernels.forward_context import current_kernel_policy
from blockdraft.kernels.moe import moe_backend
from blockdraft.kernels.select import PerDevice
from blockdraft.layers.linear import fuse_linears, linear
from blockdraft.layers.mlp import MLP

# A per-expert checkpoint tensor: `<prefix>.experts.<e>.{gate,up,down}_proj.weight`.
_PER_EXPERT = re.compile(
    r"(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>gate|up|down)_proj\.weight"
)


class Experts(nn.Module):
    """The experts' weights, stacked: `gate_up_proj[e]` holds expert e's gate rows then its up
    rows. Under tensor parallelism, only experts `start:stop` of `num_experts`."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        tp = current_tensor_parallel()
        self.start, self.stop = (0, num_experts) if tp is None else tp.split(num_experts)
        local = self.stop - self.start
        self.gate_up_proj = nn.Parameter(torch.empty(local, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(local, hidden_size, intermediate_size))
        if tp is not None:
            shard = Shard(0, self.start, self.stop, num_experts)
            tag_shard(self.gate_up_proj, shard)
            tag_shard(self.down_proj, shard)

    def local_routes(
        self,
        weights: torch.Tensor,  # [num_tokens, top_k] fp32
        ids: torch.Tensor,  # [num_tokens, top_k] int, of all the experts
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (weights, ids), same shapes
        """The routes with ids into this rank's experts: the slots routed elsewhere get id -1,
        which no expert computes (the kernels skip them: no weight is read for them)."""
        local = ids - self.start
        mine = (local >= 0) & (local < self.stop - self.start)
        return weights, torch.where(mine, local, -1)


class SparseMoE(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,  # of each routed expert
        renormalize: bool,  # norm_topk_prob: the top-k weights sum to one
        shared_expert_intermediate_size: int = 0,  # 0: no shared expert
    ) -> None:
        super().__init__()
        self.tp = current_tensor_parallel()
        self.top_k, self.renormalize = top_k, renormalize
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)  # replicated
        self.experts = Experts(num_experts, hidden_size, intermediate_size)
        self.shared_expert: MLP | None = None
        self.shared_expert_gate: nn.Linear | None = None  # replicated
        if shared_expert_intermediate_size:
            self.shared_expert = MLP(
                hidden_size, shared_expert_intermediate_size, reduce_output=False
            )
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)
        self._backend = PerDevice(moe_backend)
        # fuse_projections: the router with the shared expert's gate row, and the experts with
        # the shared one stacked after them ([E + 1, ...]); None: separate.
        self._router: torch.Tensor | None = None  # [E + 1, hidden]
        self._stacked: tuple[torch.Tensor, torch.Tensor] | None = None

    def fuse_projections(self) -> None:
        """The shared expert as one more expert: its gate row joins the router's GEMM, its
        weights the stacked experts', and the route gives every token a last slot for it
        weighted sigmoid(gate). A batch-1 layer then runs the router, the route and the
        experts' three launches, without six more for the shared expert (its gate GEMM, the
        sigmoid, gate_up, down, the product and the sum); larger forwards run it apart
        (`KernelPolicy.moe_shared_slot_max_tokens`), its gate still in the router's GEMM. Only
        where its width is the routed experts' and the experts are whole (not split over
        tensor-parallel ranks)."""
        shared, experts = self.shared_expert, self.experts
        if shared is None or self.tp is not None:
            return
        inter = experts.down_proj.shape[-1]
        if shared.down_proj.in_features != inter:
            return
        self._router = fuse_linears(self.gate, self.shared_expert_gate)[0]
        gate_up = torch.cat(
            (
                experts.gate_up_proj.detach(),
                torch.cat((shared.gate_proj.weight, shared.up_proj.weight)).detach()[None],
            )
        )
        down = torch.cat((experts.down_proj.detach(), shared.down_proj.weight.detach()[None]))
        num = gate_up.shape[0] - 1
        experts.gate_up_proj = nn.Parameter(gate_up[:num], requires_grad=False)
        experts.down_proj = nn.Parameter(down[:num], requires_grad=False)
        shared.adopt_weights(gate_up[num], down[num])
        self._stacked = (gate_up, down)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
    ) -> torch.Tensor:  # [num_tokens, hidden]
        route, experts = self._backend(x.device)
        if self._stacked is None:
            logits, shared_logit = linear(x, self.gate.weight), None
        else:  # one GEMM: the router's logits, then the shared expert's gate
            logits = linear(x, self._router)  # [num_tokens, E + 1]
            if x.shape[0] <= current_kernel_policy().moe_shared_slot_max_tokens:
                weights, ids = route(logits, self.top_k, self.renormalize, shared_expert=True)
                return experts(x, *self._stacked, weights, ids)
            logits, shared_logit = logits[:, :-1], logits[:, -1:]
        weights, ids = route(logits, self.top_k, self.renormalize)
        if self.tp is not None:
            weights, ids = self.experts.local_routes(weights, ids)
        out = experts(x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids)
        if self.shared_expert is not None:
            if shared_logit is None:
                shared_logit = linear(x, self.shared_expert_gate.weight)
            out = out + torch.sigmoid(shared_logit) * self.shared_expert(x)
        # One all-reduce for the routed and the shared experts' partial sums.
        return out if self.tp is None else self.tp.all_reduce(out)


def expert_tensor_slice(name: str, intermediate_size: int) -> tuple[str, tuple[int, slice]] | None:
    """Where a per-expert checkpoint tensor goes in the stacked parameters: (parameter name,
    index into it), e.g. `...experts.3.up_proj.weight` -> (`...experts.gate_up_proj`,
    (3, rows I..2I)); None for any other name."""
    match = _PER_EXPERT.fullmatch(name)
    if match is None:
        return None
    expert, proj = int(match["expert"]), match["proj"]
    if proj == "down":
        return f"{match['prefix']}.down_proj", (expert, slice(None))
    start = 0 if proj == "gate" else intermediate_size
    return f"{match['prefix']}.gate_up_proj", (expert, slice(start, start + intermediate_size))
