"""Pure-torch RMSNorm, optionally preceded by the residual add of a pre-norm block.

The specification of the fused Triton kernel in `triton_rmsnorm` and what `RMSNorm` runs off
the Triton path. It lives apart from the kernel because importing triton early would fix
TRITON_INTERPRET before `select` reads it (and triton may not be installed at all).
"""

from __future__ import annotations

import torch


def rms_norm_torch(
    x: torch.Tensor,  # [..., hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., hidden]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # normed [..., hidden] (, new residual)
    """Normalise in float32 whatever the activation dtype (as the reference models do), round
    back to it, then scale by the weight in the dtype torch promotion gives. With a residual,
    `x + residual` (rounded like an eager add) is normalised and returned as the new stream."""
    if residual is not None:
        x = x + residual
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    normed = weight * x32.to(x.dtype)
    return normed if residual is None else (normed, x)
