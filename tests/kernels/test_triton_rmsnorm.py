"""`blockdraft.kernels.triton_rmsnorm` against its torch twin, with and without the fused
residual add.

Runs on the CPU through Triton's interpreter (TRITON_INTERPRET=1, which tests/conftest.py sets
on a machine without a GPU). With TRITON_INTERPRET=0 on a CUDA machine the same tests run the
compiled kernels on the GPU. Shapes stay small: the interpreter costs about half a millisecond
per program.
"""

import pytest
import torch

from blockdraft.kernels.triton_rmsnorm import rms_norm_torch, triton_rms_norm

from kernel_inputs import (
    ATOL,
    needs_triton,
    randn,
)

pytestmark = needs_triton


@pytest.mark.parametrize("num_rows", [0, 1, 5])
@pytest.mark.parametrize("hidden", [48, 100])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("offset", [False, True])
def test_rms_norm(rng, num_rows: int, hidden: int, with_residual: bool, offset: bool) -> None:
    x = randn(rng, num_rows, hidden)
    weight = randn(rng, hidden)
    residual = randn(rng, num_rows, hidden) if with_residual else None
    expected = rms_norm_torch(x, weight, 1e-6, residual, offset=offset)
    out = torch.full_like(x, float("nan"))
    # The new residual may overwrite the old one in place.
    residual_out = residual.clone() if residual is not None else None
    got = triton_rms_norm(
        x,
        weight,
        1e-6,
        residual_out,
        out=out,
        residual_out=residual_out,
        offset=offset,
    )
    if with_residual:
        torch.testing.assert_close(got[0], expected[0], atol=ATOL, rtol=1e-5)
        torch.testing.assert_close(got[1], expected[1], atol=0, rtol=0)
        assert got[0].data_ptr() == out.data_ptr()
    else:
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=1e-5)


def test_offset_rms_norm_rounds_once_in_bfloat16(rng) -> None:
    """Qwen3.5's offset norm scales by 1 + weight in float32 and rounds once: the kernel's
    bfloat16 output is that product rounded (not the Llama order, normalise-round-scale)."""
    x = randn(rng, 4, 64).to(torch.bfloat16)
    weight = (randn(rng, 64) * 0.3).to(torch.bfloat16)
    x32 = x.float()
    exact = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + weight.float())
    got = triton_rms_norm(x, weight, 1e-6, offset=True)
    assert got.dtype == torch.bfloat16
    # within a bfloat16 ulp: the product is rounded once
    torch.testing.assert_close(got.float(), exact, atol=0, rtol=2**-7)
    llama_order = rms_norm_torch(x, 1 + weight, 1e-6)
    assert not torch.equal(llama_order, rms_norm_torch(x, weight, 1e-6, offset=True))
