"""`blockdraft.layers.mlp.MLP` on the Triton backend: the eager expression, and training keeps
the torch path; SiLU-and-multiply fused into the down projection's skinny GEMM."""

import pytest
import torch

from blockdraft.kernels.triton_linear import skinny_linear
from blockdraft.layers import linear as linear_layer
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


@needs_triton
@pytest.mark.parametrize("fuse", [False, True], ids=["unfused", "fused"])
def test_mlp_fuses_silu_mul_into_down(rng, monkeypatch, set_policy, fuse: bool) -> None:
    """With fuse_silu_mul_into_down, an MLP with fused projections runs its down projection
    on gate_up with the activation in the GEMM's prologue (no activation kernel) for up to
    silu_mul_prologue_max_rows rows (set here to 16, past the norm prologue's 2: the 16-row
    tensor-core path too), the unfused output (bit for bit on the row-by-row path); past that
    (the skinny GEMM, then F.linear past skinny_max_rows), or with the flag off, nothing
    changes."""
    policy = dict(
        backend="triton", skinny_device_type=DEVICE.type, skinny_max_rows=20,
        norm_prologue_max_rows=2, silu_mul_prologue_max_rows=16,
    )  # fmt: skip
    calls = []

    def counting(device: torch.device):
        def run(x, weight, bias, **kwargs):
            calls.append("fused down" if kwargs.get("silu_mul_input") else "linear")
            return skinny_linear(x, weight, bias, **kwargs)

        return run

    monkeypatch.setattr(linear_layer, "get_linear_backend", counting)
    with torch.device(DEVICE):
        mlp = MLP(24, 40)
    mlp.fuse_projections()
    silu_mul = mlp._silu_mul

    def counting_silu_mul(device: torch.device):
        calls.append("activation")
        return silu_mul(device)

    mlp._silu_mul = counting_silu_mul
    for rows in [1, 2, 5, 16, 18, 21]:
        x = randn(rng, rows, 24)
        with torch.no_grad():
            set_policy(**policy, fuse_silu_mul_into_down=False)
            expected = mlp(x)  # gate_up, the activation kernel, down
            set_policy(**policy, fuse_silu_mul_into_down=fuse)
            calls.clear()
            got = mlp(x)
        unfused = ["linear", "activation", "linear"]
        if rows > 20:  # F.linear for both projections, the activation between
            assert calls == ["activation"]
        elif rows > 16:  # the skinny GEMM, past the prologue's limit
            assert calls == unfused
        else:
            assert calls == (["linear", "fused down"] if fuse else unfused)
        if fuse and 2 < rows <= 16:  # the fused 16-row tensor-core path: another sum order
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        else:  # the same path both times, or the row-by-row prologue: bit for bit
            assert torch.equal(got, expected)
