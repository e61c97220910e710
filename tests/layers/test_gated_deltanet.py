"""`GatedDeltaNet` takes its one-launch decode kernel exactly for decode-only forwards on the
Triton path (with `fuse_gated_deltanet_decode`), and its outputs and slot states then match its
step path's; other forwards (prefill chunks, verify blocks, mixed batches) keep the step path.
Likewise its one-launch verify kernel for forwards of verify blocks only, and its commit
kernel, with `fuse_gated_deltanet_verify`.

Runs under Triton's interpreter on the CPU (TRITON_INTERPRET=1, set by tests/conftest.py)."""

import pytest
import torch

from blockdraft.kernels import (
    triton_gated_deltanet_step,
    triton_gated_deltanet_verify,
    triton_gated_deltanet_verify_chunk,
)
from blockdraft.kernels.forward_context import build_linear_metadata, forward_context
from blockdraft.layers.gated_deltanet import GatedDeltaNet
from blockdraft.runtime.host_batch import build_attention_metadata

from kernel_inputs import DEVICE, assert_near, needs_triton
from spies import count_calls

pytestmark = needs_triton


def tiny_layer(rng: torch.Generator, dtype: torch.dtype, conv: int = 4) -> GatedDeltaNet:
    """Hk 2, Hv 6 (three value heads a key head), head dims 8 and 12, conv 4, 5 slots."""
    layer = GatedDeltaNet(32, 2, 6, 8, 12, conv, 1e-6).requires_grad_(False)
    for p in layer.parameters():
        p.copy_(0.3 * torch.randn(p.shape, generator=rng))
    layer.to(DEVICE, dtype).allocate_states(5, 4, dtype, DEVICE)
    layer.conv_state.copy_(torch.randn(layer.conv_state.shape, generator=rng))
    layer.recurrent_state.copy_(torch.randn(layer.recurrent_state.shape, generator=rng))
    return layer


def copy_of(layer: GatedDeltaNet, rng: torch.Generator, dtype: torch.dtype) -> GatedDeltaNet:
    """A layer with `layer`'s weights and slot states, in `dtype`."""
    twin = tiny_layer(rng, dtype, conv=layer.conv_kernel)
    twin.load_state_dict(layer.state_dict())
    for name in ("conv_state", "recurrent_state"):
        getattr(twin, name).copy_(getattr(layer, name))
    return twin


def run(layer: GatedDeltaNet, x: torch.Tensor, slots: list[int], starts: list[int], lens: list[int],
        verify: list[bool]) -> torch.Tensor:  # fmt: skip
    tables = [[i] * 4 for i in range(len(slots))]
    meta = build_attention_metadata(tables, starts, lens, 4, DEVICE)
    meta.linear = build_linear_metadata(
        torch.tensor(slots, device=DEVICE),
        torch.tensor([s == 0 for s in starts], device=DEVICE),
        lens,
        verify,
    )
    with torch.inference_mode(), forward_context(meta):
        return layer(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_forward_takes_the_kernel(rng, set_policy, monkeypatch, dtype) -> None:
    """Two decode steps of three sequences (one fresh, one padded on the spare slot): the fused
    forward equals the step path's, states included; prefill and verify forwards never call
    the kernel."""
    calls = count_calls(monkeypatch, triton_gated_deltanet_step, "triton_gated_deltanet_decode")
    fused = tiny_layer(rng, dtype)
    plain = copy_of(fused, rng, dtype)
    # In bf16 both paths round, and a gated RMSNorm before out_proj can blow one step's rounding
    # up (a near-cancelling head): each is held to a float32 run of the same layer, the fused one
    # within a few times the step path's error; a wrong operand is an order of magnitude off.
    reference = copy_of(fused, rng, torch.float32)
    slots = [3, 0, -1]
    for step in range(2):
        x = torch.randn(3, 32, generator=rng).to(DEVICE, dtype)
        starts = [7 + step, step, 5]
        set_policy(backend="triton")
        got = run(fused, x, slots, starts, [1, 1, 1], [False] * 3)
        set_policy(backend="triton", fuse_gated_deltanet_decode=False)
        want = run(plain, x, slots, starts, [1, 1, 1], [False] * 3)
        exact = run(reference, x.float(), slots, starts, [1, 1, 1], [False] * 3)[[0, 1]]
        if dtype == torch.float32:
            assert_near(got[[0, 1]], want[[0, 1]], dtype, bf16_max=1.0, bf16_mean=0.015)
        else:
            fused_err, step_err = ((y[[0, 1]].float() - exact).abs() for y in (got, want))
            assert fused_err.mean() <= 3 * step_err.mean() + 0.01, (fused_err, step_err)
            assert fused_err.max() <= 3 * step_err.max() + 0.05, (fused_err, step_err)
        real = [3, 0]
        assert torch.equal(fused.conv_state[real], plain.conv_state[real])
        assert_near(fused.recurrent_state[real], plain.recurrent_state[real], dtype, 0.1, 0.002)
    assert len(calls) == 2
    set_policy(backend="triton")
    x = torch.randn(6, 32, generator=rng).to(DEVICE, dtype)
    run(fused, x, [3, 0], [9, 0], [1, 5], [False, False])  # a decode row beside a prefill
    run(fused, x[:4], [3, 0], [9, 2], [1, 3], [False, True])  # beside a verify block
    run(fused, x[:3], [3], [9], [3], [True])  # a verify block alone
    assert len(calls) == 2


def test_decode_fill_policy_splits_heads_to_the_same_result(rng, set_policy, monkeypatch) -> None:
    """`gated_deltanet_decode_fill_programs` reaches the decode kernel, whose heads of 64
    value dims (two blocks) then split over two programs: in float32 the outputs and states
    equal the unsplit launch's exactly."""
    seen = []
    kernel = triton_gated_deltanet_step.triton_gated_deltanet_decode

    def spy(*args, **kwargs):
        seen.append(kwargs["fill_programs"])
        return kernel(*args, **kwargs)

    monkeypatch.setattr(triton_gated_deltanet_step, "triton_gated_deltanet_decode", spy)
    layers = []
    for _ in range(2):
        layer = GatedDeltaNet(32, 2, 4, 8, 64, 4, 1e-6).requires_grad_(False)
        layer.to(DEVICE).allocate_states(5, 0, torch.float32, DEVICE)
        layers.append(layer)
    layers[1].load_state_dict(layers[0].state_dict())
    with torch.no_grad():
        for p in layers[0].parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=rng))
        layers[1].load_state_dict(layers[0].state_dict())
        for name in ("conv_state", "recurrent_state"):
            state = torch.randn(getattr(layers[0], name).shape, generator=rng).to(DEVICE)
            for layer in layers:
                getattr(layer, name).copy_(state)
    x = torch.randn(3, 32, generator=rng).to(DEVICE)
    outs = []
    for layer, fill in zip(layers, (0, 64), strict=True):
        set_policy(backend="triton", gated_deltanet_decode_fill_programs=fill)
        outs.append(run(layer, x, [3, 0, 1], [7, 2, 5], [1, 1, 1], [False] * 3))
    assert seen == [0, 64]
    assert torch.equal(outs[0], outs[1])
    for name in ("conv_state", "recurrent_state"):
        assert torch.equal(getattr(layers[0], name), getattr(layers[1], name))


# A block of 4 rows takes the chunked form when the policy's minimum is at most 4.
@pytest.mark.parametrize("min_rows, chunked", [(None, False), (4, True), (5, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verify_forward_and_commit_take_the_kernels(
    rng, set_policy, monkeypatch, dtype, min_rows, chunked
) -> None:
    """A forward of two verify blocks (4 and 2 rows, the second a padded request on the spare
    slot) and the commit of 3 rows after it: with `fuse_gated_deltanet_verify` both kernels
    run (the verify's chunked form when the block has `chunked_gated_deltanet_verify_min_rows`
    rows), and outputs, stash and committed states match the step path's. Verify blocks beside
    a decode row or a prefill chunk keep the step path."""
    verify = (triton_gated_deltanet_verify_chunk, "triton_gated_deltanet_verify_chunked")
    if not chunked:
        verify = (triton_gated_deltanet_verify, "triton_gated_deltanet_verify")
    calls = count_calls(monkeypatch, *verify)
    count_calls(monkeypatch, triton_gated_deltanet_verify, "triton_gated_deltanet_commit", calls)
    fused = tiny_layer(rng, dtype)
    plain = copy_of(fused, rng, dtype)
    x = torch.randn(6, 32, generator=rng).to(DEVICE, dtype)
    verify_block = ([3, -1], [9, 4], [4, 2], [True, True])
    set_policy(backend="triton", chunked_gated_deltanet_verify_min_rows=min_rows)
    got = run(fused, x, *verify_block)
    fused.commit_verified(torch.tensor([3, -1], device=DEVICE), torch.tensor([3, 0], device=DEVICE))
    set_policy(backend="triton", fuse_gated_deltanet_verify=False)
    want = run(plain, x, *verify_block)
    plain.commit_verified(torch.tensor([3, -1], device=DEVICE), torch.tensor([3, 0], device=DEVICE))
    assert calls == [verify[1], "triton_gated_deltanet_commit"]
    assert_near(got, want, dtype, bf16_max=1.0, bf16_mean=0.015)
    assert torch.equal(fused.stash_qkv[3], plain.stash_qkv[3])
    ulps = 2**-22 if dtype == torch.float32 else 2**-6  # conv outputs: rounded twice
    torch.testing.assert_close(fused.stash_mixed[3], plain.stash_mixed[3], atol=ulps, rtol=ulps)
    assert torch.equal(fused.conv_state[3], plain.conv_state[3])
    assert_near(fused.recurrent_state[3], plain.recurrent_state[3], dtype, 0.1, 0.002)
    set_policy(backend="triton", chunked_gated_deltanet_verify_min_rows=min_rows)
    run(fused, x[:5], [3, 0], [12, 2], [1, 4], [False, True])  # beside a decode row
    run(fused, x, [3, 0], [12, 0], [4, 2], [True, False])  # beside a prefill chunk
    assert len(calls) == 2


def test_a_conv_longer_than_the_verify_kernel_holds_keeps_the_step_path(
    rng, set_policy, monkeypatch
) -> None:
    """The verify kernel holds conv windows of up to 4 taps in registers (and refuses longer
    ones); a 5-tap layer verifies through its torch steps, with the same result as with the
    kernel turned off."""
    verify_block = ([3, 1], [9, 4], [4, 2], [True, True])
    first = tiny_layer(rng, torch.float32, conv=5)
    layers = [first, copy_of(first, rng, torch.float32)]
    x = torch.randn(6, 32, generator=rng).to(DEVICE)
    calls = count_calls(monkeypatch, triton_gated_deltanet_verify, "triton_gated_deltanet_verify")
    outs = []
    for layer, fused in zip(layers, (True, False), strict=True):
        set_policy(backend="triton", fuse_gated_deltanet_verify=fused)
        outs.append(run(layer, x, *verify_block))
    assert not calls
    assert torch.equal(outs[0], outs[1])
    with pytest.raises(ValueError, match="up to 4 taps"):
        fused = layers[0]
        triton_gated_deltanet_verify.triton_gated_deltanet_verify(
            x.new_zeros(6, fused.conv_dim), x.new_zeros(6, 12), x.new_zeros(6, 72),
            fused.conv1d.weight.view(fused.conv_dim, -1), fused.A_log, fused.dt_bias,
            fused.norm.weight, 1e-6, 2, fused.conv_state, fused.recurrent_state, fused.stash_qkv,
            fused.stash_mixed, fused.stash_gb, torch.tensor([3], device=DEVICE),
            torch.tensor([False], device=DEVICE), torch.arange(4, device=DEVICE)[None],
            torch.tensor([4], device=DEVICE),
        )  # fmt: skip
