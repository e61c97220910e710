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
def test_rms_norm(rng, num_rows: int, hidden: int, with_residual: bool) -> None:
    x = randn(rng, num_rows, hidden)
    weight = randn(rng, hidden)
    residual = randn(rng, num_rows, hidden) if with_residual else None
    expected = rms_norm_torch(x, weight, 1e-6, residual)
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
    )
    if with_residual:
        torch.testing.assert_close(got[0], expected[0], atol=ATOL, rtol=1e-5)
        torch.testing.assert_close(got[1], expected[1], atol=0, rtol=0)
        assert got[0].data_ptr() == out.data_ptr()
    else:
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=1e-5)
