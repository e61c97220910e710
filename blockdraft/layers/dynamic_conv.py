"""Grouped dynamic causal convolution over a drafter's query blocks (DFlash2).

Output row t of a block is `sum_o (base[o] + dynamic[t, o, g]) * x[t - o]` over offsets
o = 0 .. kernel_size - 1, rows before the block's first being zero (the kernel and its torch
twin: `blockdraft.kernels.dynamic_conv`). The convolution kernel has a static per-channel part
(`base_kernel`) and a dynamic per-group part that row t predicts from its own input
(`kernel_projection`; channels come in groups of `group_size`). A layer applies one pair
around a sub-block: `prepare` convolves its input with the first kernel and predicts the
second (with `KernelPolicy.fuse_conv_projection`, projection and convolution in one kernel),
`finish` convolves the sub-block's output with that second kernel (`finish_norm`: and the
residual add + RMSNorm that follows, in one kernel on the GPU).

Rows are flat `[num_blocks * block_len, hidden]`, each block its own sequence: the
convolution never reaches across a block boundary, so batched requests stay independent.
"""

from __future__ import annotations

import torch
from torch import nn

from blockdraft.kernels.dynamic_conv import grouped_dynamic_causal_conv_torch
from blockdraft.kernels.forward_context import current_kernel_policy
from blockdraft.kernels.select import (
    PerDevice,
    get_conv_rms_norm_backend,
    get_dynamic_conv_backend,
    get_projected_conv_backend,
    needs_autograd,
)
from blockdraft.layers.linear import linear
from blockdraft.layers.norm import RMSNorm


class GroupedDynamicCausalConv(nn.Module):
    def __init__(self, hidden_size: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        if kernel_size < 1 or group_size < 1 or hidden_size % group_size:
            raise ValueError(
                f"conv_kernel_size {kernel_size} must be >= 1 and conv_group_size {group_size} "
                f"must divide hidden_size {hidden_size}"
            )
        self.kernel_size, self.groups = kernel_size, hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)
        self._backend = PerDevice(get_dynamic_conv_backend)  # Triton on CUDA, else torch
        self._norm_backend = PerDevice(get_conv_rms_norm_backend)
        self._prepare_backend = PerDevice(get_projected_conv_backend)

    def _conv(
        self,
        x: torch.Tensor,  # [rows, hidden]
        dynamic: torch.Tensor,  # [rows, kernel_size, groups]
        base: torch.Tensor,  # [kernel_size, hidden]
        block_len: int,
    ) -> torch.Tensor:  # [rows, hidden]
        if needs_autograd(x, dynamic, base):
            return grouped_dynamic_causal_conv_torch(x, dynamic, base, block_len)
        return self._backend(x.device)(x, dynamic, base, block_len)

    def prepare(
        self,
        x: torch.Tensor,  # [rows, hidden], blocks of block_len rows
        block_len: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # x convolved [rows, hidden], finish's [rows, k, g]
        weight, base = self.kernel_projection.weight, self.base_kernel[0]
        if current_kernel_policy().fuse_conv_projection and not needs_autograd(x, weight, base):
            out, dynamic = self._prepare_backend(x.device)(x, weight, base, block_len)
            return out, dynamic[:, 1]
        dynamic = linear(x, weight, None).view(-1, 2, self.kernel_size, self.groups)
        out = self._conv(x, dynamic[:, 0], base, block_len)
        return out, dynamic[:, 1]

    def finish(
        self,
        x: torch.Tensor,  # [rows, hidden]
        dynamic: torch.Tensor,  # [rows, kernel_size, groups] from prepare
        block_len: int,
    ) -> torch.Tensor:  # [rows, hidden]
        return self._conv(x, dynamic, self.base_kernel[1], block_len)

    def finish_norm(
        self,
        x: torch.Tensor,  # [rows, hidden]
        dynamic: torch.Tensor,  # [rows, kernel_size, groups] from prepare
        block_len: int,
        norm: nn.Module,  # the norm after the sub-block
        residual: torch.Tensor,  # [rows, hidden], the residual stream
    ) -> tuple[torch.Tensor, torch.Tensor]:  # norm(finish(x) + residual), the new stream
        base = self.base_kernel[1]
        fused = (
            isinstance(norm, RMSNorm)
            and residual.dtype == x.dtype
            and not needs_autograd(x, dynamic, base, norm.weight, residual)
        )
        if not fused:
            return norm(self.finish(x, dynamic, block_len), residual)
        kernel = self._norm_backend(x.device)
        return kernel(x, dynamic, base, block_len, norm.weight, norm.eps, residual)
