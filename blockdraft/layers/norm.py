from __future__ import annotations

import torch
from torch import nn

from blockdraft.kernels.rmsnorm import rms_norm_torch
from blockdraft.kernels.select import PerDevice, RMSNormFn, get_rms_norm_backend, needs_autograd


class RMSNorm(nn.Module):
    """RMSNorm that can take the residual add before it (`norm(x + residual)`), so that a
    pre-norm block's `add + norm` is one fused kernel on the Triton path."""

    offset = False  # the weight scales as it is (OffsetRMSNorm: as 1 + weight)

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
        return _norm_kernel(self, x, residual)(x, self.weight, self.eps, residual)


def input_norm(
    norm: RMSNorm | OffsetRMSNorm,
    x: torch.Tensor,  # [num_tokens, hidden], the previous layer's output (or the input)
    residual: torch.Tensor | None,  # [num_tokens, hidden]; None: x is the stream
    stream_out: torch.Tensor | None = None,  # [num_tokens, hidden] view, unit column stride
) -> tuple[torch.Tensor, torch.Tensor]:  # (norm(x + residual), x + residual)
    """A pre-norm layer's input norm with the residual add before it; `stream_out` also gets
    the stream x + residual (the previous layer's output, kept as DFlash target features)."""
    if residual is None:
        h, residual = norm(x), x
    else:
        h, residual = norm(x, residual)
    if stream_out is not None:
        stream_out.copy_(residual)
    return h, residual


def final_norm(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """`norm(x + residual)`, the last layer's residual add fused into the final norm."""
    return norm(x) if residual is None else norm(x, residual)[0]


class OffsetRMSNorm(nn.Module):
    """RMSNorm whose weight is stored as an offset from one (Qwen3.5, Qwen3-Next: weights start
    at zero): `norm(x) * (1 + weight)`, scaled in float32 before rounding to x's dtype, as
    transformers' `Qwen3_5RMSNorm`. Takes the residual add before it like `RMSNorm`, and runs
    the same fused kernel (its `offset` mode) on the Triton path: the eager version is ~8
    elementwise launches, which a hybrid model's decode step pays ~200 times."""

    offset = True

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps
        self._backend = PerDevice(get_rms_norm_backend)  # Triton on CUDA, else torch

    def forward(
        self,
        x: torch.Tensor,  # [..., hidden_size]
        residual: torch.Tensor | None = None,  # [..., hidden_size], the residual stream
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`norm(x)`; with a residual, `(norm(x + residual), x + residual)`."""
        return _norm_kernel(self, x, residual)(x, self.weight, self.eps, residual, offset=True)


def _norm_kernel(
    norm: RMSNorm | OffsetRMSNorm, x: torch.Tensor, residual: torch.Tensor | None
) -> RMSNormFn:
    if needs_autograd(x, norm.weight):
        return rms_norm_torch
    if residual is not None and residual.dtype != x.dtype:
        return rms_norm_torch  # mixed dtypes (autocast): the kernel wants one dtype
    return norm._backend(x.device)
