from __future__ import annotations

import torch
from torch import nn

from blockdraft.kernels.rmsnorm import rms_norm_torch
from blockdraft.kernels.select import PerDevice, RMSNormFn, get_rms_norm_backend, needs_autograd


class RMSNorm(nn.Module):
    """RMSNorm that can take the residual add before it (`norm(x + residual)`), so that a
    pre-norm block's `add + norm` is one fused kernel on the Triton path."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self._backend = PerDevice(get_rms_norm_backend)  # Triton on CUDA, else torch

    def forward(
        self,
        x: torch.Tensor,  # [..., hidden_size]
        residual: torch.Tensor | None = None,  # [..., hidden_size], the residual stream
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`norm(x)`; with a residual, `(norm(x + residual), x + residual)`."""
        return self._kernel(x, residual)(x, self.weight, self.eps, residual)

    def _kernel(self, x: torch.Tensor, residual: torch.Tensor | None) -> RMSNormFn:
        if needs_autograd(x, self.weight):
            return rms_norm_torch
        if residual is not None and residual.dtype != x.dtype:
            return rms_norm_torch  # mixed dtypes (autocast): the kernel wants one dtype
        return self._backend(x.device)


def layer_output(x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """The hidden state after a pre-norm layer from its unsummed (output, residual stream)."""
    return x if residual is None else x + residual


def final_norm(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """`norm(x + residual)`, the last layer's residual add fused into the final norm."""
    return norm(x) if residual is None else norm(x, residual)[0]


class OffsetRMSNorm(nn.Module):
    """RMSNorm whose weight is stored as an offset from one (Qwen3.5, Qwen3-Next: weights start
    at zero): `norm(x) * (1 + weight)`, scaled in float32 before rounding to x's dtype, as
    transformers' `Qwen3_5RMSNorm`. Takes the residual add before it like `RMSNorm`."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(
        self,
        x: torch.Tensor,  # [..., hidden_size]
        residual: torch.Tensor | None = None,  # [..., hidden_size], the residual stream
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`norm(x)`; with a residual, `(norm(x + residual), x + residual)`."""
        if residual is not None:
            x = x + residual
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        normed = (x32 * (1.0 + self.weight.float())).to(x.dtype)
        return normed if residual is None else (normed, x)
