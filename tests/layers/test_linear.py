"""`blockdraft.layers.linear`: fusing the linears that read one input into one matrix, and
`linear`, which routes few-row projections to the skinny GEMM (F.linear on the CPU and under
autograd)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from blockdraft.kernels import select
from blockdraft.kernels.triton_linear import skinny_linear
from blockdraft.layers import linear as linear_layer
from blockdraft.layers.linear import fuse_linears, linear
from blockdraft.layers.mlp import MLP
from blockdraft.models.llama import DecoderLM

from kernel_inputs import DEVICE, inputs, needs_triton, randn, tiny_qwen3_config


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


# --- few-row projections routed to the skinny GEMM ----------------------------------------


@needs_triton
def test_decoder_linear_skips_the_skinny_gemm_on_cpu_and_under_autograd(
    rng, monkeypatch, set_policy
) -> None:
    def forbidden(device: torch.device) -> None:
        raise AssertionError("the skinny GEMM was chosen")

    monkeypatch.setattr(linear_layer, "get_linear_backend", forbidden)
    set_policy(backend="triton")
    x, w, b = inputs(rng, 3, 20, 24, torch.float32, bias=True, strided=False)
    x, w, b = x.cpu(), w.cpu(), b.cpu()
    # On the CPU: F.linear's product, even with the Triton backend forced.
    with torch.no_grad():
        torch.testing.assert_close(linear(x, w, b), F.linear(x, w, b))
    # Under autograd, on the skinny GEMM's device too: the kernel has no backward.
    set_policy(backend="triton", skinny_device_type=DEVICE.type)
    x, w, b = x.to(DEVICE), w.to(DEVICE).requires_grad_(True), b.to(DEVICE)
    linear(x, w, b).sum().backward()
    assert w.grad is not None


@needs_triton
def test_decoder_routes_few_rows(rng, monkeypatch, set_policy) -> None:
    """With the device allowed (the interpreter on CPU), an MLP's gate_up and down projections
    and the LM head go through the skinny GEMM for up to skinny_max_rows rows outside autograd,
    and through F.linear otherwise."""
    set_policy(backend="triton", skinny_device_type=DEVICE.type, skinny_max_rows=16)
    calls = []

    def counting(device: torch.device):
        def run(x, weight, bias, **prologue):  # the default prologues (SiLU·mul into down)
            calls.append(tuple(weight.shape))
            return skinny_linear(x, weight, bias, **prologue)

        assert select.get_linear_backend(device) is skinny_linear
        return run

    monkeypatch.setattr(linear_layer, "get_linear_backend", counting)
    cfg = tiny_qwen3_config(num_layers=1)
    with torch.device(DEVICE):
        mlp, lm = MLP(24, 40), DecoderLM(cfg)
    mlp.fuse_projections()
    for rows, expect_calls in [(3, 3), (16, 3), (17, 0)]:
        calls.clear()
        x = randn(rng, rows, 24)
        with torch.no_grad():
            got_mlp, got_logits = mlp(x), lm.compute_logits(x)
            expected_mlp = mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
            expected_logits = lm.lm_head(x)
        assert len(calls) == expect_calls
        torch.testing.assert_close(got_mlp, expected_mlp, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_logits, expected_logits, atol=1e-5, rtol=1e-5)
    calls.clear()
    x = randn(rng, 3, 24)
    lm.compute_logits(x).sum().backward()  # autograd: F.linear
    assert calls == [] and lm.lm_head.weight.grad is not None


@pytest.mark.parametrize("counts", [(1, 2, 3, 4, 8, 16), (2, 16), (16,), (1, 2, 3, 4, 8)])
@pytest.mark.parametrize("bias", [False, True])
def test_cpu_rows_from_the_policy_take_the_weight_as_left_operand(
    bias: bool, counts: tuple[int, ...], rng, set_policy
) -> None:
    """On the CPU, outside autograd, a linear whose row count falls on one of
    `cpu_weight_left_rows` (a count of m rows: the largest of CPU_ROW_COUNTS <= m): F.linear's
    product as `weight @ x.T` (contiguous, bias added; one row as two); the other counts and
    autograd take F.linear itself."""
    set_policy(cpu_weight_left_rows=counts)
    out, k = (int(v) for v in torch.randint(1, 300, (2,), generator=rng))
    w = torch.randn(out, k, generator=rng)
    b = torch.randn(out, generator=rng) if bias else None
    calls = []
    real = F.linear

    def counting(*args: object) -> torch.Tensor:
        calls.append(1)
        return real(*args)

    sizes = [1, 2, 3, 5, 8, 12, 16] + torch.randint(1, 300, (3,), generator=rng).tolist()
    for n in sizes:
        left = max(c for c in (1, 2, 3, 4, 8, 16) if c <= n) in counts
        x = torch.randn(n, k, generator=rng)
        calls.clear()
        with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
            mp.setattr(linear_layer.F, "linear", counting)
            got = linear(x, w, b)
        # Another summation order: fp32 rounding over up to 300 products of N(0, 1) values.
        torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-4)
        assert got.is_contiguous() and got.shape == (n, out)
        assert len(calls) == int(not left), n
    w.requires_grad_(True)
    calls.clear()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(linear_layer.F, "linear", counting)
        linear(torch.randn(3, k, generator=rng), w, b).sum().backward()
    assert w.grad is not None and calls == [1]
