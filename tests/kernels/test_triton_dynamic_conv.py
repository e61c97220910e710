"""`blockdraft.kernels.triton_dynamic_conv` against its torch twin (`kernels.dynamic_conv`),
which tests/models/test_dflash2_drafter.py checks against z-lab's convolution.

Runs on the CPU through Triton's interpreter (TRITON_INTERPRET=1); small shapes."""

import pytest
import torch

from blockdraft.kernels.dynamic_conv import conv_rms_norm_torch, grouped_dynamic_causal_conv_torch
from blockdraft.kernels.triton_dynamic_conv import (
    triton_conv_rms_norm,
    triton_grouped_dynamic_causal_conv,
)
from blockdraft.kernels.triton_rmsnorm import triton_rms_norm

from kernel_inputs import ATOL, needs_triton, randn

pytestmark = needs_triton


@pytest.mark.parametrize(("kernel_size", "block_len", "blocks"), [(1, 3, 2), (2, 4, 3), (4, 3, 2)])
@pytest.mark.parametrize(("hidden", "groups"), [(48, 3), (40, 40)])
def test_dynamic_conv(rng, kernel_size: int, block_len: int, blocks: int, hidden: int, groups: int):
    rows = blocks * block_len
    x = randn(rng, rows, hidden)
    # As the layer passes it: one half of the projection's output, a strided view.
    dynamic = randn(rng, rows, 2, kernel_size, groups)[:, 1]
    base = randn(rng, kernel_size, hidden)
    want = grouped_dynamic_causal_conv_torch(x, dynamic, base, block_len)
    got = triton_grouped_dynamic_causal_conv(x, dynamic, base, block_len)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=ATOL)
    # Each block on its own: nothing crosses a block boundary.
    for b in range(blocks):
        rows_b = slice(b * block_len, (b + 1) * block_len)
        alone = triton_grouped_dynamic_causal_conv(x[rows_b], dynamic[rows_b], base, block_len)
        torch.testing.assert_close(got[rows_b], alone, rtol=1e-5, atol=ATOL)


def test_rows_must_be_whole_blocks(rng) -> None:
    x = randn(rng, 5, 8)
    with pytest.raises(ValueError, match="whole blocks"):
        triton_grouped_dynamic_causal_conv(x, randn(rng, 5, 2, 2), randn(rng, 2, 8), 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("kernel_size", "block_len", "hidden", "groups"), [(2, 4, 48, 3), (3, 3, 40, 40)]
)
def test_conv_rms_norm(rng, dtype, kernel_size: int, block_len: int, hidden: int, groups: int):
    """The closing convolution + residual add + RMSNorm in one launch: bit for bit the two
    kernels it replaces, and the torch twin's result in float32."""
    rows = 3 * block_len
    x = randn(rng, rows, hidden, dtype=dtype)
    dynamic = randn(rng, rows, 2, kernel_size, groups, dtype=dtype)[:, 1]
    base = randn(rng, kernel_size, hidden, dtype=dtype)
    residual = randn(rng, rows, hidden, dtype=dtype)
    weight = (1 + 0.1 * randn(rng, hidden)).to(dtype)
    normed, stream = triton_conv_rms_norm(x, dynamic, base, block_len, weight, 1e-6, residual)
    conv = triton_grouped_dynamic_causal_conv(x, dynamic, base, block_len)
    want_normed, want_stream = triton_rms_norm(conv, weight, 1e-6, residual)
    assert torch.equal(normed, want_normed) and torch.equal(stream, want_stream)
    if dtype == torch.float32:
        twin = conv_rms_norm_torch(x, dynamic, base, block_len, weight, 1e-6, residual)
        torch.testing.assert_close(normed, twin[0], rtol=1e-5, atol=ATOL)
        torch.testing.assert_close(stream, twin[1], rtol=1e-5, atol=ATOL)
