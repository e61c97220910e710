"""`blockdraft.kernels.triton_top_k` against its spec (`kernels.top_k`, torch.topk) and, on
ties, against a stable descending sort (the kernel's rule: the lowest column first).

Runs on the CPU through Triton's interpreter (TRITON_INTERPRET=1)."""

import pytest
import torch

from blockdraft.kernels.top_k import top_k_torch
from blockdraft.kernels.triton_top_k import GROUP, triton_top_k

from kernel_inputs import DEVICE, needs_triton, randn

pytestmark = needs_triton


WIDE = 256 * GROUP  # one first-pass program's groups


@pytest.mark.parametrize(
    ("rows", "vocab", "k"),
    [(3, 2 * WIDE + 77, 16), (5, 300, 5), (1, 7, 7), (4, WIDE, 1), (2, WIDE + 3, 13)],
)
def test_top_k_equals_torch(rng, rows: int, vocab: int, k: int) -> None:
    x = randn(rng, rows, vocab) * 3
    values, columns = triton_top_k(x, k)
    want_values, want_columns = top_k_torch(x, k)
    assert torch.equal(columns, want_columns) and torch.equal(values, want_values)


def test_ties_take_the_lowest_columns(rng) -> None:
    """Few distinct values over two first-pass programs, -inf among them (a whole row of it)
    and -0.0 for 0.0 in another:
    the values equal torch's, the columns are a stable descending sort's; the group maxima tie
    across the second pass's chunks."""
    vocab, k = WIDE + 500, 12
    x = torch.randint(-3, 3, (2, 3, vocab), generator=rng).float().to(DEVICE)
    x[0, 0, ::3] = float("-inf")
    x[0, 1] = float("-inf")  # every group's maximum -inf: the lowest columns
    x[1, 2, WIDE - 2 : WIDE + 30] = 9.0  # ties across the programs' boundary
    x[1, 0] = x[1, 0].clamp(max=0.0)  # zeros on top, every other one -0.0: all tie
    x[1, 0, ::2][x[1, 0, ::2] == 0] = -0.0
    values, columns = triton_top_k(x, k)
    assert values.shape == columns.shape == (2, 3, k)
    assert torch.equal(values, top_k_torch(x, k)[0])
    assert torch.equal(columns, torch.sort(x, dim=-1, descending=True, stable=True)[1][..., :k])


def test_bfloat16_rows_and_bad_k(rng) -> None:
    x = randn(rng, 4, 1000, dtype=torch.bfloat16)
    values, columns = triton_top_k(x, 8)
    assert values.dtype == torch.float32
    stable = torch.sort(x.float(), dim=-1, descending=True, stable=True)[1]
    assert torch.equal(columns, stable[:, :8])
    with pytest.raises(ValueError, match="1 <= k <= 1000"):
        triton_top_k(x, 1001)


def test_second_pass_warps_by_rows(rng, monkeypatch) -> None:
    """8 warps up to WIDE_MAX_ROWS rows (a drafter step's few rows), 4 past it; an explicit
    count is kept; the values are torch's whichever."""
    from blockdraft.kernels import triton_top_k as module

    launched = []
    real = module._top_k_groups_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launched.append(kwargs["num_warps"])
                return real[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(module, "_top_k_groups_kernel", Spy())
    for rows, warps, want in [
        (module.WIDE_MAX_ROWS, None, 8),
        (module.WIDE_MAX_ROWS + 1, None, 4),
        (5, 4, 4),
    ]:
        x = randn(rng, rows, 300)
        values, columns = triton_top_k(x, 6, num_warps=warps)
        assert launched.pop() == want
        assert torch.equal(values, top_k_torch(x, 6)[0])
