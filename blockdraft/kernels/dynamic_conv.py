"""Grouped dynamic causal convolution over query blocks (DFlash2), the specification (torch).

Output row t of a block is `sum_o (base[o] + dynamic[t, o, g]) * x[t - o]` over offsets
o = 0 .. kernel_size - 1, where g is the group of the channel (`hidden / groups` channels each)
and rows before the block's first are zero. Rows are flat `[num_blocks * block_len, hidden]`,
each block its own sequence: nothing crosses a block boundary. `triton_dynamic_conv` computes
the same in one launch, and `conv_rms_norm_torch` (the convolution closing a sub-block, then the
next residual add + RMSNorm) in one launch too; `projected_dynamic_conv_torch` (the projection
that predicts a sub-block's two dynamic kernels, then the opening convolution) in one more.
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


def projected_dynamic_conv_torch(
    x: torch.Tensor,  # [num_blocks * block_len, hidden]
    weight: torch.Tensor,  # [2 * kernel_size * groups, hidden], the kernel projection
    base: torch.Tensor,  # [kernel_size, hidden], the opening convolution's static kernel
    block_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # out [rows, hidden], dynamic [rows, 2, kernel_size, G]
    """A sub-block's opening: both dynamic kernels predicted from x (rounded to x's dtype), and
    x convolved with the first."""
    kernel_size = base.shape[0]
    dynamic = F.linear(x, weight).view(x.shape[0], 2, kernel_size, -1)
    return grouped_dynamic_causal_conv_torch(x, dynamic[:, 0], base, block_len), dynamic
