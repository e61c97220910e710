"""`blockdraft.layers.linear`: fusing the linears that read one input into one matrix."""

import pytest
import torch
from torch import nn

from blockdraft.layers.linear import fuse_linears


@pytest.mark.parametrize("bias", [False, True])
def test_fuse_linears_keeps_outputs_names_and_memory(bias: bool, rng) -> None:
    """The fused matrix gives the outputs of the separate linears, and each linear's parameters
    become views into it (state dict unchanged, nothing copied)."""
    hidden = int(torch.randint(3, 40, (1,), generator=rng))
    outs = torch.randint(1, 30, (3,), generator=rng).tolist()
    linears = nn.ModuleList(nn.Linear(hidden, n, bias=bias) for n in outs).requires_grad_(False)
    x = torch.randn(int(torch.randint(1, 9, (1,), generator=rng)), hidden, generator=rng)
    expected = [lin(x) for lin in linears]
    keys = list(linears.state_dict())
    weight, fused_bias = fuse_linears(*linears)
    assert weight.shape == (sum(outs), hidden) and (fused_bias is not None) == bias
    for got, want in zip(
        torch.nn.functional.linear(x, weight, fused_bias).split(outs, -1), expected, strict=True
    ):
        torch.testing.assert_close(got, want)
    assert list(linears.state_dict()) == keys
    for lin, want in zip(linears, expected, strict=True):
        assert lin.weight.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()
        torch.testing.assert_close(lin(x), want)  # the views still work as the old linears
