"""Dense SwiGLU MLP: `down(silu(gate(x)) * up(x))`, gate and up fused into one GEMM.

Under tensor parallelism each rank holds a slice of the intermediate features: gate/up
column-parallel, down row-parallel, one all-reduce after it (or none, `reduce_output=False`: a
caller that adds the partial sums to other partial sums reduces them all at once)."""

from __future__ import annotations

import torch
from torch import nn

from blockdraft.distributed.tensor_parallel import Shard, current_tensor_parallel, tag_shard
from blockdraft.kernels.forward_context import current_kernel_policy
from blockdraft.kernels.rope import silu_mul_torch
from blockdraft.kernels.select import PerDevice, get_silu_mul_backend, needs_autograd
from blockdraft.layers.linear import fuse_linears, linear, prologue_fits, skinny_linear


class MLP(nn.Module):
    def __init__(
        self, hidden_size: int, intermediate_size: int, reduce_output: bool = True
    ) -> None:
        super().__init__()
        self.tp = tp = current_tensor_parallel()
        self.reduce_output = reduce_output
        full = intermediate_size
        if tp is not None:
            start, stop = tp.split(full)
            intermediate_size = stop - start
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        if tp is not None:
            tag_shard(self.gate_proj.weight, Shard(0, start, stop, full))
            tag_shard(self.up_proj.weight, Shard(0, start, stop, full))
            tag_shard(self.down_proj.weight, Shard(1, start, stop, full))
        self._silu_mul = PerDevice(get_silu_mul_backend)  # Triton on CUDA, else torch
        self._gate_up: tuple[torch.Tensor, torch.Tensor | None] | None = None  # fuse_projections

    def fuse_projections(self) -> None:
        """One GEMM for gate and up instead of two (already so after `adopt_weights`)."""
        if self._gate_up is None:
            self._gate_up = fuse_linears(self.gate_proj, self.up_proj)

    def adopt_weights(
        self,
        gate_up: torch.Tensor,  # [2 * intermediate, hidden], gate rows then up rows
        down: torch.Tensor,  # [hidden, intermediate]
    ) -> None:
        """Makes the parameters views of an owner's tensors holding their values (a mixture's
        stacked experts holding its shared expert), fused as `fuse_projections` fuses them."""
        inter = self.gate_proj.out_features
        self.gate_proj.weight = nn.Parameter(gate_up[:inter], requires_grad=False)
        self.up_proj.weight = nn.Parameter(gate_up[inter:], requires_grad=False)
        self.down_proj.weight = nn.Parameter(down, requires_grad=False)
        self._gate_up = (gate_up, None)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
    ) -> torch.Tensor:  # [num_tokens, hidden]
        if self._gate_up is None:
            return self._reduce(self.down(self.gate_proj(x), self.up_proj(x)))
        return self.down_gate_up(linear(x, *self._gate_up))

    def down_gate_up(
        self,
        gate_up: torch.Tensor,  # [num_tokens, 2 * intermediate], the fused projection's output
    ) -> torch.Tensor:  # [num_tokens, hidden]
        """The rest of `forward` after the fused gate/up projection."""
        down, policy = self.down_proj, current_kernel_policy()
        rows = policy.silu_mul_prologue_max_rows
        fits = prologue_fits(gate_up, down.weight, down.bias, max_rows=rows)
        if policy.fuse_silu_mul_into_down and fits:
            out = skinny_linear(gate_up, down.weight, down.bias, silu_mul_input=True)
        else:
            # row-strided halves of one output; the activation kernel reads them in place
            out = self.down(*gate_up.chunk(2, dim=-1))
        return self._reduce(out)

    def _reduce(
        self,
        out: torch.Tensor,  # [num_tokens, hidden] this rank's partial sum under tensor parallelism
    ) -> torch.Tensor:  # [num_tokens, hidden]
        """Row-parallel down_proj (no bias): the partial sums of every rank added up, unless
        the caller reduces them (`reduce_output=False`)."""
        if self.tp is None or not self.reduce_output:
            return out
        return self.tp.all_reduce(out)

    def down(
        self,
        gate: torch.Tensor,  # [num_tokens, intermediate]
        up: torch.Tensor,  # [num_tokens, intermediate]
    ) -> torch.Tensor:  # [num_tokens, hidden]
        down = self.down_proj
        if needs_autograd(gate, up):
            act = silu_mul_torch(gate, up)
        else:
            act = self._silu_mul(gate.device)(gate, up)
        return linear(act, down.weight, down.bias)
