"""`blockdraft.kernels.triton_gated_deltanet_step` against its torch twin: the gated-normed
outputs, the conv and recurrent states it leaves in the slots, for value heads sharing key
heads, fresh and continuing sequences, a padded row on the spare slot, strided projections and
two steps in a row (the arrival counters left zeroed). The twin against the layer's own step
path, bit for bit.

Runs under Triton's interpreter on the CPU (TRITON_INTERPRET=1, set by tests/conftest.py); with
TRITON_INTERPRET=0 on a CUDA machine, compiled on the GPU."""

import pytest
import torch

from blockdraft.kernels.forward_context import build_linear_metadata
from blockdraft.kernels.triton_gated_deltanet_step import (
    gated_deltanet_decode_torch,
    triton_gated_deltanet_decode,
)
from blockdraft.layers.gated_deltanet import GatedDeltaNet

from kernel_inputs import DEVICE, assert_near, needs_triton, randn, tolerance

SLOTS = [3, 0, -1, 5]  # the third a padded row on the spare slot
FRESH = [False, True, False, False]
NUM_SLOTS = 7


def layer_params(rng, hk: int, hv: int, dk: int, dv: int, taps: int, dtype: torch.dtype):
    conv_dim = 2 * hk * dk + hv * dv
    conv_weight = (0.5 * randn(rng, conv_dim, taps)).to(dtype)
    a_log = (0.5 * randn(rng, hv)).to(dtype)
    dt_bias = randn(rng, hv).to(dtype)
    norm_weight = (1 + 0.2 * randn(rng, dv)).to(dtype)
    return conv_weight, a_log, dt_bias, norm_weight


def step_inputs(rng, s: int, hv: int, dv: int, conv_dim: int, dtype: torch.dtype):
    """qkv, b|a and z as column slices of one fused projection's output (strided rows)."""
    fused = randn(rng, s, conv_dim + hv * dv + 2 * hv + 3, dtype=dtype)
    qkv, z, b_a, _ = fused.split((conv_dim, hv * dv, 2 * hv, 3), dim=-1)
    return qkv, b_a, z


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "heads, dims, taps, block_v, v_splits",
    [
        ((2, 6), (12, 40), 4, None, 1),
        ((1, 2), (16, 24), 3, 8, 1),
        ((3, 3), (8, 8), 4, None, 1),
        ((2, 6), (12, 40), 4, 8, 5),  # one block a part, the last cut at 40
        ((1, 2), (16, 24), 3, 8, 2),  # two blocks, then one
        ((2, 4), (8, 32), 4, 8, 3),  # two blocks each, the third part empty
    ],
)
def test_decode_step_matches_twin(
    rng, dtype: torch.dtype, heads: tuple, dims: tuple, taps: int, block_v: int | None,
    v_splits: int,
) -> None:  # fmt: skip
    (hk, hv), (dk, dv) = heads, dims
    conv_dim, s = 2 * hk * dk + hv * dv, len(SLOTS)
    params = layer_params(rng, hk, hv, dk, dv, taps, dtype)
    conv_pool = randn(rng, NUM_SLOTS, taps - 1, conv_dim, dtype=dtype)
    state_pool = randn(rng, NUM_SLOTS, hv, dk, dv)
    slots = torch.tensor(SLOTS, device=DEVICE)
    fresh = torch.tensor(FRESH, device=DEVICE)
    counters = torch.zeros(s * (hk + hv) + 5, dtype=torch.int32, device=DEVICE)
    want_pools = (conv_pool.clone(), state_pool.clone())
    got_pools = (conv_pool.clone(), state_pool.clone())
    for step in range(2):  # the second continues from the first's states
        qkv, b_a, z = step_inputs(rng, s, hv, dv, conv_dim, dtype)
        args = (qkv, b_a, z, *params[:3], params[3], 1e-6, hk)
        want = gated_deltanet_decode_torch(*args, *want_pools, slots, fresh & (step == 0))
        got = triton_gated_deltanet_decode(
            *args, *got_pools, slots, fresh & (step == 0), counters, block_v=block_v,
            v_splits=v_splits,
        )  # fmt: skip
        assert got.dtype == want.dtype and got.shape == want.shape
        assert_near(got, want, dtype, bf16_max=1.0, bf16_mean=0.015)
        assert torch.equal(got_pools[0], want_pools[0]), step  # conv states: copies of inputs
        assert_near(got_pools[1], want_pools[1], dtype, bf16_max=0.1, bf16_mean=0.002)
        assert not counters.any()
    untouched = [1, 2, 4]
    assert torch.equal(got_pools[0][untouched], conv_pool[untouched])
    assert torch.equal(got_pools[1][untouched], state_pool[untouched])


@needs_triton
def test_split_heads_equal_whole_heads_bit_for_bit(rng) -> None:
    """In float32, splitting each head's value dims over programs (one state block each) gives
    the unsplit kernel's outputs and states exactly: the parts' sums of squares add in the
    order the unsplit loop adds its blocks. A split count past the blocks is a named error."""
    hk, hv, dk, dv, taps = 2, 4, 8, 32, 4
    conv_dim, s = 2 * hk * dk + hv * dv, len(SLOTS)
    params = layer_params(rng, hk, hv, dk, dv, taps, torch.float32)
    pools = (randn(rng, NUM_SLOTS, taps - 1, conv_dim), randn(rng, NUM_SLOTS, hv, dk, dv))
    qkv, b_a, z = step_inputs(rng, s, hv, dv, conv_dim, torch.float32)
    args = (qkv, b_a, z, *params[:3], params[3], 1e-6, hk)
    slots, fresh = torch.tensor(SLOTS, device=DEVICE), torch.tensor(FRESH, device=DEVICE)
    results = []
    for v_splits in (1, 4):
        run_pools = [p.clone() for p in pools]
        out = triton_gated_deltanet_decode(
            *args, *run_pools, slots, fresh, block_v=8, v_splits=v_splits
        )
        results.append((out, *run_pools))
    for whole, split in zip(*results, strict=True):
        assert torch.equal(whole, split)
    with pytest.raises(ValueError, match=r"v_splits 5 must be in \[1, 4\]"):
        triton_gated_deltanet_decode(*args, *pools, slots, fresh, block_v=8, v_splits=5)


@needs_triton
def test_without_counters_allocates_them(rng) -> None:
    hk, hv, dk, dv, taps = 1, 3, 8, 8, 4
    conv_dim = 2 * hk * dk + hv * dv
    params = layer_params(rng, hk, hv, dk, dv, taps, torch.float32)
    pools = [randn(rng, NUM_SLOTS, taps - 1, conv_dim), randn(rng, NUM_SLOTS, hv, dk, dv)]
    want_pools = [p.clone() for p in pools]
    qkv, b_a, z = step_inputs(rng, 2, hv, dv, conv_dim, torch.float32)
    slots, fresh = torch.tensor([4, 1], device=DEVICE), torch.tensor([False, False], device=DEVICE)
    args = (qkv, b_a, z, *params, 1e-6, hk)
    got = triton_gated_deltanet_decode(*args, *pools, slots, fresh)
    want = gated_deltanet_decode_torch(*args, *want_pools, slots, fresh)
    torch.testing.assert_close(got, want, **tolerance(torch.float32))
    assert torch.equal(pools[0], want_pools[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_twin_is_the_layer_step(rng, dtype: torch.dtype) -> None:
    """The twin computes what the layer's step path computes for one-row sequences, bit for
    bit (with the torch backend the layer never takes the kernel)."""
    layer = GatedDeltaNet(32, 2, 4, 8, 8, 4, 1e-6).requires_grad_(False)
    for p in layer.parameters():
        p.copy_(0.3 * torch.randn(p.shape, generator=rng))
    layer.to(dtype).allocate_states(NUM_SLOTS, 0, dtype, torch.device("cpu"))
    layer.conv_state.copy_(torch.randn(layer.conv_state.shape, generator=rng))
    layer.recurrent_state.copy_(torch.randn(layer.recurrent_state.shape, generator=rng))
    pools = (layer.conv_state.clone(), layer.recurrent_state.clone())
    s, hv = len(SLOTS), layer.num_v_heads
    qkv = torch.randn(s, layer.conv_dim, generator=rng).to(dtype)
    b_a = torch.randn(s, 2 * hv, generator=rng).to(dtype)
    z = torch.randn(s, layer.value_dim, generator=rng).to(dtype)
    slots, fresh = torch.tensor(SLOTS), torch.tensor(FRESH)
    meta = build_linear_metadata(slots, fresh, [1] * s, [False] * s)
    with torch.inference_mode():
        core = layer._mix(qkv, b_a, meta)
        want = layer.norm(core, z.reshape(core.shape)).flatten(1)
        got = gated_deltanet_decode_torch(
            qkv, b_a, z, layer.conv1d.weight.view(layer.conv_dim, -1), layer.A_log,
            layer.dt_bias, layer.norm.weight, layer.norm.eps, layer.num_k_heads, *pools,
            slots, fresh,
        )  # fmt: skip
    assert torch.equal(got, want)
    real = [0, 1, 3]  # the spare slot's contents are whatever the padded row left
    assert torch.equal(pools[0][SLOTS][real], layer.conv_state[SLOTS][real])
    assert torch.equal(pools[1][SLOTS][real], layer.recurrent_state[SLOTS][real])
