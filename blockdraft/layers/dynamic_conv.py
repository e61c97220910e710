"""Grouped dynamic causal convolution over a drafter's query blocks (DFlash2).

Output row t of a block is `sum_o (base[o] + dynamic[t, o, g]) * x[t - o]` over offsets
o = 0 .. kernel_size - 1, rows before the block's first being zero: the kernel has a static
per-channel part (`base_kernel`) and a dynamic per-group part that row t predicts from its own
input (`kernel_projection`; channels come in groups of `group_size`). A layer applies one
kernel pair around a sub-block: `prepare` convolves its input with the first kernel and
predicts the second, `finish` convolves the sub-block's output with that second kernel.

Rows are flat `[num_blocks * block_len, hidden]`, each block its own sequence: the
convolution never reaches across a block boundary, so batched requests stay independent.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from blockdraft.layers.linear import linear


def grouped_dynamic_causal_conv(
    x: torch.Tensor,  # [num_blocks * block_len, hidden]
    dynamic: torch.Tensor,  # [num_blocks * block_len, kernel_size, groups]
    base: torch.Tensor,  # [kernel_size, hidden]
    block_len: int,
) -> torch.Tensor:  # [num_blocks * block_len, hidden]
    rows, hidden = x.shape
    kernel_size, groups = dynamic.shape[1:]
    blocks = x.view(rows // block_len, block_len, hidden)
    # windows[b, t, :, j] = x[b, t - (kernel_size - 1 - j)], zero before the block's first row
    windows = F.pad(blocks, (0, 0, kernel_size - 1, 0)).unfold(1, kernel_size, 1)
    windows = windows.reshape(rows, groups, hidden // groups, kernel_size)
    # Offsets reversed to the windows' order: column j holds offset kernel_size - 1 - j.
    weight = base.to(x.dtype).flip(0).t().reshape(1, groups, hidden // groups, kernel_size)
    weight = weight + dynamic.flip(1).transpose(1, 2)[:, :, None, :]
    return (windows * weight).sum(-1).view(rows, hidden)


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

    def prepare(
        self,
        x: torch.Tensor,  # [rows, hidden], blocks of block_len rows
        block_len: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # x convolved [rows, hidden], finish's [rows, k, g]
        dynamic = linear(x, self.kernel_projection.weight, None)
        dynamic = dynamic.view(-1, 2, self.kernel_size, self.groups)
        out = grouped_dynamic_causal_conv(x, dynamic[:, 0], self.base_kernel[0], block_len)
        return out, dynamic[:, 1]

    def finish(
        self,
        x: torch.Tensor,  # [rows, hidden]
        dynamic: torch.Tensor,  # [rows, kernel_size, groups] from prepare
        block_len: int,
    ) -> torch.Tensor:  # [rows, hidden]
        return grouped_dynamic_causal_conv(x, dynamic, self.base_kernel[1], block_len)
