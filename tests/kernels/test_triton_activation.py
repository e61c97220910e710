"""`blockdraft.kernels.triton_activation`: SiLU-and-multiply against the eager MLP expression.

Runs on the CPU through Triton's interpreter (TRITON_INTERPRET=1, which tests/conftest.py sets
on a machine without a GPU). With TRITON_INTERPRET=0 on a CUDA machine the same tests run the
compiled kernels on the GPU. Shapes stay small: the interpreter costs about half a millisecond
per program.
"""

import pytest
import torch

from blockdraft.kernels.rope import (
    silu_mul_torch,
)
from blockdraft.kernels.triton_activation import triton_silu_mul

from kernel_inputs import (
    needs_triton,
    randn,
    tolerance,
)

pytestmark = needs_triton


@pytest.mark.parametrize("num_rows", [0, 1, 5])
@pytest.mark.parametrize("cols", [80, 1300])  # 1300: two column blocks, the last partial
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_silu_mul(rng, num_rows: int, cols: int, dtype: torch.dtype) -> None:
    # Strided halves, as of a fused gate_up projection.
    gate_up = (2 * randn(rng, num_rows, 2 * cols)).to(dtype)
    gate, up = gate_up[:, :cols], gate_up[:, cols:]
    expected = silu_mul_torch(gate, up)
    # The twin is the eager MLP's expression, bit for bit.
    assert torch.equal(expected, torch.nn.functional.silu(gate) * up)
    got = triton_silu_mul(gate, up)
    assert got.shape == expected.shape and got.dtype == expected.dtype
    torch.testing.assert_close(got, expected, **tolerance(dtype))
