"""Pure-torch linear layer: the specification of the skinny GEMM in `triton_linear`.

`skinny_linear_torch` is `F.linear` and what the decoder runs off the Triton path (CPU,
training, more than a handful of rows). It lives apart from the kernel because importing triton
early would fix TRITON_INTERPRET before `select` reads it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def skinny_linear_torch(
    x: torch.Tensor,  # [..., K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [..., N]
    """`x @ weight.T + bias`, exactly `F.linear`."""
    return F.linear(x, weight, bias)
