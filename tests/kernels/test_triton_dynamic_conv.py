"""`blockdraft.kernels.triton_dynamic_conv` against its torch twin (`kernels.dynamic_conv`),
which tests/models/test_dflash2_drafter.py checks against z-lab's convolution.

Runs on the CPU through Triton's interpreter (TRITON_INTERPRET=1); small shapes."""

import pytest
import torch

from blockdraft.kernels.dynamic_conv import (
    conv_rms_norm_torch,
    grouped_dynamic_causal_conv_torch,
    projected_dynamic_conv_torch,
)
from blockdraft.kernels.triton_dynamic_conv import (
    triton_conv_rms_norm,
    triton_grouped_dynamic_causal_conv,
    triton_projected_dynamic_conv,
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


@pytest.mark.parametrize(
    ("kernel_size", "block_len", "blocks", "hidden", "groups", "groups_per_program", "block_m"),
    [
        (2, 16, 1, 64, 4, None, 16),  # one request's block; every group in one program
        (2, 16, 3, 64, 16, 3, 16),  # a last program with fewer groups; 3 row tiles
        (1, 3, 5, 48, 3, None, 32),  # rows past the last tile's
        (3, 4, 5, 40, 40, None, 16),  # groups of one channel, 6 columns a program
        (4, 3, 7, 96, 6, 1, 16),
    ],
)
def test_projected_conv(
    rng, kernel_size, block_len, blocks, hidden, groups, groups_per_program, block_m
) -> None:
    """The kernel projection and the opening convolution in one launch: both dynamic kernels
    and the convolution as the twin's, the blocks independent."""
    rows = blocks * block_len
    x = randn(rng, rows, hidden)
    weight = randn(rng, 2 * kernel_size * groups, hidden) / hidden**0.5
    base = randn(rng, kernel_size, hidden)
    kw = dict(groups_per_program=groups_per_program, block_m=block_m)
    out, dynamic = triton_projected_dynamic_conv(x, weight, base, block_len, **kw)
    want_out, want_dynamic = projected_dynamic_conv_torch(x, weight, base, block_len)
    assert dynamic.shape == (rows, 2, kernel_size, groups)
    torch.testing.assert_close(dynamic, want_dynamic, rtol=1e-5, atol=ATOL)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=ATOL)
    last = slice((blocks - 1) * block_len, rows)
    alone = triton_projected_dynamic_conv(x[last], weight, base, block_len, **kw)
    torch.testing.assert_close(out[last], alone[0], rtol=1e-5, atol=ATOL)


def test_projected_conv_half_precision_and_bad_shapes(rng) -> None:
    """16-bit inputs: the dynamic kernels rounded to the inputs' dtype before the convolution
    reads them, as the separate GEMM's output is. (float16: the interpreter's tl.dot of
    bfloat16 tiles returns garbage, Triton 3.7; compiled, both run alike.)"""
    dtype = torch.float16
    x = randn(rng, 32, 64, dtype=dtype)
    weight = (randn(rng, 16, 64) / 8).to(dtype)
    base = randn(rng, 2, 64, dtype=dtype)
    out, dynamic = triton_projected_dynamic_conv(x, weight, base, 16)
    assert out.dtype == dynamic.dtype == dtype
    want_dynamic = torch.nn.functional.linear(x.float(), weight.float()).view(32, 2, 2, 4)
    torch.testing.assert_close(dynamic.float(), want_dynamic, rtol=2e-3, atol=2e-3)
    want = grouped_dynamic_causal_conv_torch(x.float(), dynamic[:, 0].float(), base.float(), 16)
    torch.testing.assert_close(out.float(), want, rtol=2e-3, atol=2e-3)
    with pytest.raises(ValueError, match="whole blocks"):
        triton_projected_dynamic_conv(x[:30], weight, base, 16)
    with pytest.raises(ValueError, match="does not map hidden 64"):
        triton_projected_dynamic_conv(x, weight[:15], base, 16)
