"""`blockdraft.layers.mlp.MLP` on the Triton backend: the eager expression, and training keeps
the torch path."""


import torch

from blockdraft.layers.mlp import MLP

from kernel_inputs import (
    ATOL,
    DEVICE,
    needs_triton,
    randn,
)


@needs_triton
def test_mlp_backends(rng, set_policy) -> None:
    set_policy(backend="triton")
    with torch.device(DEVICE):
        mlp = MLP(24, 40)
    x = randn(rng, 3, 24)
    expected = mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    with torch.no_grad():
        torch.testing.assert_close(mlp(x), expected, atol=ATOL, rtol=1e-5)
    # Training keeps the torch path: the kernel has no backward.
    mlp(x).sum().backward()
    assert mlp.gate_proj.weight.grad is not None
