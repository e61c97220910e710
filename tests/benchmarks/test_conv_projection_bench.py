"""benchmarks/conv_projection_bench.py: every launch option it times is one the fused kernel
takes and computes right with (the Triton interpreter on the CPU; the timings need a GPU)."""

import pytest
import torch

from benchmarks.conv_projection_bench import candidates
from blockdraft.kernels.dynamic_conv import projected_dynamic_conv_torch
from blockdraft.kernels.triton_dynamic_conv import triton_projected_dynamic_conv

from kernel_inputs import ATOL, needs_triton, randn


@needs_triton
def test_every_candidate_launch_matches_the_twin(rng) -> None:
    rows, hidden, kernel_size, groups, block_len = 48, 64, 2, 16, 16
    x = randn(rng, rows, hidden)
    weight = randn(rng, 2 * kernel_size * groups, hidden) / hidden**0.5
    base = randn(rng, kernel_size, hidden)
    want = projected_dynamic_conv_torch(x, weight, base, block_len)
    configs = candidates(rows)
    assert {c["block_m"] for c in configs} == {16, 32} and len(configs) == 32
    for cfg in configs:
        out, dynamic = triton_projected_dynamic_conv(x, weight, base, block_len, **cfg)
        torch.testing.assert_close(dynamic, want[1], rtol=1e-5, atol=ATOL, msg=str(cfg))
        torch.testing.assert_close(out, want[0], rtol=1e-5, atol=ATOL, msg=str(cfg))


def test_needs_a_gpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    from benchmarks.conv_projection_bench import main

    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        main(["--rows", "16"])
