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
    offset: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # normed [..., hidden] (, new residual)
    """Normalise in float32 whatever the activation dtype (as the reference models do), round
    back to it, then scale by the weight in the dtype torch promotion gives. With a residual,
    `x + residual` (rounded like an eager add) is normalised and returned as the new stream.
    With `offset` the weight is stored as an offset from one (Qwen3.5, Qwen3-Next): the scale
    is `1 + weight`, applied in float32 before rounding to x's dtype, as transformers'
    `Qwen3_5RMSNorm` does."""
    if residual is not None:
        x = x + residual
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        normed = (x32 * (1.0 + weight.float())).to(x.dtype)
    else:
        normed = weight * x32.to(x.dtype)
    return normed if residual is None else (normed, x)
