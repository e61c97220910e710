"""Grouped dynamic causal convolution over query blocks (DFlash2), the specification (torch).

Output row t of a block is `sum_o (base[o] + dynamic[t, o, g]) * x[t - o]` over offsets
o = 0 .. kernel_size - 1, where g is the group of the channel (`hidden / groups` channels each)
and rows before the block's first are zero. Rows are flat `[num_blocks * block_len, hidden]`,
each block its own sequence: nothing crosses a block boundary. `triton_dynamic_conv` computes
the same in one launch, and `conv_rms_norm_torch` (the convolution closing a sub-block, then the
next residual add + RMSNorm) in one launch too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from blockdraft.kernels.rmsnorm import rms_norm_torch


def grouped_dynamic_causal_conv_torch(
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


def conv_rms_norm_torch(
    x: torch.Tensor,  # [num_blocks * block_len, hidden]
    dynamic: torch.Tensor,  # [num_blocks * block_len, kernel_size, groups]
    base: torch.Tensor,  # [kernel_size, hidden]
    block_len: int,
    norm_weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor,  # [num_blocks * block_len, hidden]
) -> tuple[torch.Tensor, torch.Tensor]:  # normed, the new residual stream
    """`rms_norm_torch(conv(x) , norm_weight, eps, residual)`: the convolution's output (in x's
    dtype) added to the residual stream and normalised."""
    out = grouped_dynamic_causal_conv_torch(x, dynamic, base, block_len)
    return rms_norm_torch(out, norm_weight, eps, residual)
