"""`blockdraft.layers.norm.RMSNorm`: bit-identical to the eager norm on the torch path, close on
the Triton one, and training keeps the torch path."""

import pytest
import torch

from blockdraft.kernels.triton_rmsnorm import rms_norm_torch, triton_rms_norm
from blockdraft.layers.norm import RMSNorm

from kernel_inputs import (
    DEVICE,
    eager_rms_norm,
    needs_triton,
    randn,
)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rms_norm_matches_layer(rng, set_policy, dtype: torch.dtype) -> None:
    set_policy(backend="torch")
    layer = RMSNorm(40, eps=1e-5).to(DEVICE, dtype)
    layer.weight.data = randn(rng, 40).to(dtype)
    x, residual = randn(rng, 2, 3, 40).to(dtype), randn(rng, 2, 3, 40).to(dtype)
    expected = eager_rms_norm(x, layer.weight, 1e-5)
    # The torch path (CPU, or backend "torch") is bit-identical to the eager code.
    torch.testing.assert_close(rms_norm_torch(x, layer.weight, 1e-5), expected, atol=0, rtol=0)
    torch.testing.assert_close(layer(x), expected, atol=0, rtol=0)
    normed, stream = layer(x, residual)
    torch.testing.assert_close(stream, x + residual, atol=0, rtol=0)
    torch.testing.assert_close(
        normed, eager_rms_norm(x + residual, layer.weight, 1e-5), atol=0, rtol=0
    )
    tol = {} if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(triton_rms_norm(x, layer.weight, 1e-5), expected, **tol)
    set_policy(backend="triton")
    triton_layer = RMSNorm(40, eps=1e-5).to(DEVICE, dtype)
    triton_layer.weight.data = layer.weight.data
    torch.testing.assert_close(triton_layer(x), expected, **tol)
    # Training keeps the torch path: the kernel has no backward.
    with torch.enable_grad():
        x.requires_grad_(True)
        triton_layer(x).sum().backward()
    assert x.grad is not None
