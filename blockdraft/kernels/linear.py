"""Pure-torch linear layer: the specification of the skinny GEMM in `triton_linear`.

`skinny_linear_torch` is `F.linear` and what the decoder runs off the Triton path (CPU,
training, more than a handful of rows). It lives apart from the kernel because importing triton
early would fix TRITON_INTERPRET before `select` reads it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from blockdraft.kernels.rmsnorm import rms_norm_torch
from blockdraft.kernels.rope import silu_mul_torch


def skinny_linear_torch(
    x: torch.Tensor,  # [..., K]; with silu_mul_input [..., 2K], gate then up
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    *,
    silu_mul_input: bool = False,
    rms_norm: tuple[torch.Tensor, float] | None = None,  # (norm weight [K], eps)
    residual: torch.Tensor | None = None,  # [..., K]; with rms_norm
    residual_out: torch.Tensor | None = None,  # [..., K]; receives x + residual
    norm_offset: bool = False,  # with rms_norm: its offset form (OffsetRMSNorm)
) -> torch.Tensor:  # [..., N]
    """`x @ weight.T + bias`, exactly `F.linear`; with silu_mul_input, of the gated MLP's
    activation `silu(gate) * up` of x's halves (the skinny GEMM fuses it into its loads); with
    rms_norm = (norm_weight, eps), of `rms_norm_torch(x, norm_weight, eps, residual,
    offset=norm_offset)`, the new residual stream x + residual copied into residual_out."""
    if silu_mul_input:
        x = silu_mul_torch(*x.chunk(2, dim=-1))
    if rms_norm is not None:
        if residual is None:
            x = rms_norm_torch(x, *rms_norm, offset=norm_offset)
        else:
            x, stream = rms_norm_torch(x, *rms_norm, residual, offset=norm_offset)
            if residual_out is not None:
                residual_out.copy_(stream)
    return F.linear(x, weight, bias)
