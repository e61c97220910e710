"""`blockdraft.kernels.triton_dynamic_conv` against its torch twin (`kernels.dynamic_conv`),
which tests/models/test_dflash2_drafter.py checks against z-lab's convolution.

Runs on the CPU through Triton's interpreter (TRITON_INTERPRET=1); small shapes."""

import pytest
import torch

from blockdraft.kernels.dynamic_conv import grouped_dynamic_causal_conv_torch
from blockdraft.kernels.triton_dynamic_conv import triton_grouped_dynamic_causal_conv

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
