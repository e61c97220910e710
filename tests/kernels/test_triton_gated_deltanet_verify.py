"""`blockdraft.kernels.triton_gated_deltanet_verify` against its torch twins: the verify
kernel's gated-normed outputs, the stash it keeps and the slots it leaves untouched, for value
heads sharing key heads, partial tiles, one and several value blocks a head, fresh and
continuing sequences, a padded sequence on the spare slot, blocks shorter than the batch's
widest and strided projections; the commit kernel's states at each kept length (none, some,
past the stash). Verify then commit at k accepted rows against decoding those k + 1 rows one
by one: bit for bit through the twins in float32, within tolerance through the kernels. The
verify twin against the layer's step path, bit for bit.

Runs under Triton's interpreter on the CPU (TRITON_INTERPRET=1, set by tests/conftest.py); with
TRITON_INTERPRET=0 on a CUDA machine, compiled on the GPU."""

import pytest
import torch
from test_triton_gated_deltanet_step import layer_params, step_inputs

from blockdraft.kernels.forward_context import StepBatch, build_linear_metadata
from blockdraft.kernels.gated_delta_rule import gated_deltanet_decode_torch
from blockdraft.kernels.triton_gated_deltanet_step import triton_gated_deltanet_decode
from blockdraft.kernels.triton_gated_deltanet_verify import (
    gated_deltanet_commit_torch,
    gated_deltanet_verify_torch,
    triton_gated_deltanet_commit,
    triton_gated_deltanet_verify,
)
from blockdraft.kernels.triton_gated_deltanet_verify_chunk import (
    triton_gated_deltanet_verify_chunked,
)
from blockdraft.layers.gated_deltanet import GatedDeltaNet

from kernel_inputs import DEVICE, assert_near, needs_triton, randn, tolerance

SLOTS = [3, 0, -1]  # the third a padded sequence on the spare slot
FRESH = [False, True, False]
LENGTHS = [4, 2, 4]  # the second shorter than the batch's widest
NUM_SLOTS, WIDTH = 6, 5  # stash rows: one more than the widest block
# The verify kernel's two forms: a serial pass over the rows, the chunked form's products.
VERIFY_KERNELS = [
    pytest.param(triton_gated_deltanet_verify, id="rows"),
    pytest.param(triton_gated_deltanet_verify_chunked, id="chunked"),
]


def step_batch(lengths: list[int]) -> StepBatch:
    """A forward of verify blocks only, as the runner builds it."""
    s = len(lengths)
    meta = build_linear_metadata(
        torch.zeros(s, dtype=torch.int64, device=DEVICE),
        torch.zeros(s, dtype=torch.bool, device=DEVICE),
        lengths,
        [True] * s,
    )
    return meta.step


def pools(
    rng, hv: int, dk: int, dv: int, conv_dim: int, taps: int, dtype: torch.dtype, width: int = WIDTH
) -> list:
    """Random conv and recurrent state pools and stashes (conv inputs, conv outputs, g|beta)."""
    return [
        randn(rng, NUM_SLOTS, taps - 1, conv_dim, dtype=dtype),
        randn(rng, NUM_SLOTS, hv, dk, dv),
        randn(rng, NUM_SLOTS, width, conv_dim, dtype=dtype),
        randn(rng, NUM_SLOTS, width, conv_dim, dtype=dtype),
        torch.cat(
            (-randn(rng, NUM_SLOTS, width, hv).abs(), randn(rng, NUM_SLOTS, width, hv).sigmoid()),
            -1,
        ),
    ]


def clones(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.clone() for t in tensors]


def tensor(values: list) -> torch.Tensor:
    return torch.tensor(values, device=DEVICE)


@needs_triton
@pytest.mark.parametrize("verify", VERIFY_KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "heads, dims, taps, block_v",
    [((2, 4), (12, 40), 4, None), ((1, 2), (16, 24), 3, 8), ((2, 2), (8, 8), 4, None)],
)
def test_verify_matches_twin(
    rng, verify, dtype: torch.dtype, heads: tuple, dims: tuple, taps: int, block_v: int | None
) -> None:
    (hk, hv), (dk, dv) = heads, dims
    conv_dim = 2 * hk * dk + hv * dv
    params = layer_params(rng, hk, hv, dk, dv, taps, dtype)
    start = pools(rng, hv, dk, dv, conv_dim, taps, dtype)
    want_pools, got_pools = clones(start), clones(start)
    step = step_batch(LENGTHS)
    qkv, b_a, z = step_inputs(rng, sum(LENGTHS), hv, dv, conv_dim, dtype)
    slots, fresh = tensor(SLOTS), tensor(FRESH)
    counters = torch.zeros(len(SLOTS) * hv + 3, dtype=torch.int32, device=DEVICE)
    args = (qkv, b_a, z, *params[:3], params[3], 1e-6, hk)
    rows = (slots, fresh, step.rows, step.lengths)
    want = gated_deltanet_verify_torch(*args, *want_pools, *rows)
    got = verify(*args, *got_pools, *rows, counters, block_v=block_v)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert_near(got, want, dtype, bf16_max=1.0, bf16_mean=0.015)
    assert not counters.any()
    assert torch.equal(got_pools[0], start[0]) and torch.equal(got_pools[1], start[1])
    for slot, length in zip(SLOTS, LENGTHS, strict=True):
        kept = [p[slot, :length] for p in got_pools[2:]]
        assert torch.equal(kept[0], want_pools[2][slot, :length])  # copies of the inputs
        # Conv outputs: in bf16 now and then an ulp or two apart (rounded twice, the sum and
        # the SiLU).
        ulps = tolerance(dtype) if dtype == torch.float32 else dict(atol=2**-6, rtol=2**-6)
        torch.testing.assert_close(kept[1], want_pools[3][slot, :length], **ulps)
        beta_ulp = 1e-5 if dtype == torch.float32 else 2**-8  # beta < 1 is rounded to bf16
        torch.testing.assert_close(kept[2], want_pools[4][slot, :length], atol=beta_ulp, rtol=1e-5)
        # Rows past the block's length are not kept: the commit never reads them.
        assert torch.equal(got_pools[2][slot, length:], start[2][slot, length:])
    untouched = [1, 2, 4]
    for got_pool, pool in zip(got_pools, start, strict=True):
        assert torch.equal(got_pool[untouched], pool[untouched])


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, dims, taps, block_v", [((2, 4), (12, 40), 4, None),
                                                         ((1, 3), (16, 8), 3, 4)])  # fmt: skip
def test_commit_matches_twin(
    rng, dtype: torch.dtype, heads: tuple, dims: tuple, taps: int, block_v: int | None
) -> None:
    """Kept lengths 2, 1, past the stash (all of it), and 0 on the spare slot (a padded
    entry: nothing changes)."""
    (hk, hv), (dk, dv) = heads, dims
    conv_dim = 2 * hk * dk + hv * dv
    start = pools(rng, hv, dk, dv, conv_dim, taps, dtype)
    want_pools, got_pools = clones(start), clones(start)
    slots, lengths = tensor([3, 0, 4, -1]), tensor([2, 1, WIDTH + 3, 0])
    gated_deltanet_commit_torch(hk, *want_pools, slots, lengths)
    triton_gated_deltanet_commit(hk, *got_pools, slots, lengths, block_v=block_v)
    assert torch.equal(got_pools[0], want_pools[0])  # conv states: copies of inputs
    assert_near(got_pools[1], want_pools[1], dtype, bf16_max=0.1, bf16_mean=0.002)
    for got_pool, pool in zip(got_pools, start, strict=True):
        assert torch.equal(got_pool[[1, 2, NUM_SLOTS - 1]], pool[[1, 2, NUM_SLOTS - 1]])
    for got_stash, stash in zip(got_pools[2:], start[2:], strict=True):
        assert torch.equal(got_stash, stash)


@needs_triton
def test_commit_of_stacked_layers_is_each_layers_commit(rng) -> None:
    """Pools of three layers stacked on a leading dim commit in one launch exactly as each
    layer's own pools commit alone (bit for bit), with two value blocks a head; pools whose
    layer counts differ are refused."""
    hk, hv, dk, dv, taps, dtype = 1, 2, 8, 16, 4, torch.float32
    conv_dim = 2 * hk * dk + hv * dv
    layers = [pools(rng, hv, dk, dv, conv_dim, taps, dtype) for _ in range(3)]
    stacked = [torch.stack(parts) for parts in zip(*layers, strict=True)]
    slots, lengths = tensor([3, 0, -1]), tensor([2, WIDTH + 1, 0])
    for layer in layers:
        triton_gated_deltanet_commit(hk, *layer, slots, lengths, block_v=8)
    triton_gated_deltanet_commit(hk, *stacked, slots, lengths, block_v=8)
    for got, parts in zip(stacked, zip(*layers, strict=True), strict=True):
        assert torch.equal(got, torch.stack(parts))
    with pytest.raises(ValueError, match="same number of layers"):
        triton_gated_deltanet_commit(hk, *stacked[:4], stacked[4][:2], slots, lengths)


@needs_triton
@pytest.mark.parametrize("lengths", [[16, 11], [20, 3]])
@pytest.mark.parametrize("aligned", [False, True])
def test_chunked_verify_of_long_blocks(rng, lengths: list[int], aligned: bool) -> None:
    """Blocks of a whole 16-row tile: the chunked form inverts I + A by repeated squaring,
    whose high powers only show past 8 rows and where keys align (`aligned`: every row's key
    inputs alike, beta ~1, no decay: A^8 grows to thousands, and the products must cancel back
    to O(1)); its outputs and stash match the twin's and the row kernel's. Wider blocks take
    the row kernel."""
    hk, hv, dk, dv, taps, dtype = 1, 2, 16, 16, 4, torch.float32
    conv_dim = 2 * hk * dk + hv * dv
    params = (*layer_params(rng, hk, hv, dk, dv, taps, dtype), 1e-6, hk)
    start = pools(rng, hv, dk, dv, conv_dim, taps, dtype, width=max(lengths) + 1)
    slots, fresh = tensor([1, 4]), tensor([False, True])
    qkv, b_a, z = step_inputs(rng, sum(lengths), hv, dv, conv_dim, dtype)
    if aligned:
        qkv[:, hk * dk : 2 * hk * dk] = randn(rng, hk * dk)  # the same key inputs every row
        b_a[:, :hv], b_a[:, hv:] = 8.0, -12.0  # beta ~1, g ~0
    step = step_batch(lengths)
    block = (slots, fresh, step.rows, step.lengths)
    outs, stashes = [], []
    for verify in (gated_deltanet_verify_torch, triton_gated_deltanet_verify,
                   triton_gated_deltanet_verify_chunked):  # fmt: skip
        verified = clones(start)
        outs.append(verify(qkv, b_a, z, *params, *verified, *block))
        stashes.append(verified[2:])
    # Aligned keys: the squarings' float32 sums cancel thousands down to ones (~4e-4 relative).
    tol = dict(atol=2e-3, rtol=2e-3) if aligned else dict(atol=1e-4, rtol=1e-4)
    for out, stash in zip(outs[1:], stashes[1:], strict=True):
        torch.testing.assert_close(out, outs[0], **tol)
        for slot, length in zip(slots.tolist(), lengths, strict=True):
            for got, want in zip(stash, stashes[0], strict=True):
                torch.testing.assert_close(got[slot, :length], want[slot, :length])


@pytest.mark.parametrize(
    "kernels",
    [
        pytest.param(
            None, marks=pytest.mark.skipif(DEVICE.type != "cpu", reason="on the CPU"), id="twins"
        ),
        pytest.param(triton_gated_deltanet_verify, marks=needs_triton, id="rows"),
        pytest.param(triton_gated_deltanet_verify_chunked, marks=needs_triton, id="chunked"),
    ],
)
def test_verify_then_commit_is_decoding(rng, kernels) -> None:
    """Two verify blocks (4 and 3 rows); the commit at k accepted drafts of each: the states
    and the outputs of their first k + 1 rows are those of decoding the rows one by one (the
    decode twin), bit for bit through the twins in float32, within tolerance through the
    kernels."""
    hk, hv, dk, dv, taps, dtype = 1, 2, 8, 40, 4, torch.float32
    conv_dim = 2 * hk * dk + hv * dv
    params = (*layer_params(rng, hk, hv, dk, dv, taps, dtype), 1e-6, hk)
    start = pools(rng, hv, dk, dv, conv_dim, taps, dtype)
    lengths, slots, fresh = [4, 3], tensor([2, 4]), tensor([False, False])
    qkv, b_a, z = step_inputs(rng, sum(lengths), hv, dv, conv_dim, dtype)
    step = step_batch(lengths)
    verify = kernels or gated_deltanet_verify_torch
    commit = triton_gated_deltanet_commit if kernels else gated_deltanet_commit_torch
    verified = clones(start)
    out = verify(qkv, b_a, z, *params, *verified, slots, fresh, step.rows, step.lengths)
    accepted = [int(torch.randint(0, n, (1,), generator=rng)) for n in lengths]
    commit(hk, *verified, slots, tensor(accepted) + 1)

    decoded = clones(start[:2])
    for j, slot in enumerate(slots.tolist()):
        for t in range(accepted[j] + 1):
            row = [4 * j + t]
            want = gated_deltanet_decode_torch(
                qkv[row], b_a[row], z[row], *params, *decoded, slots[[j]], fresh[[j]]
            )
            if kernels:
                torch.testing.assert_close(out[row], want, atol=1e-4, rtol=1e-4)
            else:
                assert torch.equal(out[row], want), (j, t)
        if kernels:
            torch.testing.assert_close(verified[1][slot], decoded[1][slot], atol=1e-4, rtol=1e-4)
        else:
            assert torch.equal(verified[1][slot], decoded[1][slot]), j
        assert torch.equal(verified[0][slot], decoded[0][slot]), j


@needs_triton
@pytest.mark.parametrize("verify", VERIFY_KERNELS)
def test_kernels_match_the_decode_kernel(rng, verify) -> None:
    """One-row verify blocks and their commit leave the states and outputs that the fused
    decode kernel gives (the same rows through the other one-launch path)."""
    hk, hv, dk, dv, taps, dtype = 2, 4, 8, 40, 4, torch.float32
    conv_dim = 2 * hk * dk + hv * dv
    params = (*layer_params(rng, hk, hv, dk, dv, taps, dtype), 1e-6, hk)
    start = pools(rng, hv, dk, dv, conv_dim, taps, dtype)
    slots, fresh = tensor([1, 3]), tensor([False, False])
    qkv, b_a, z = step_inputs(rng, 2, hv, dv, conv_dim, dtype)
    step = step_batch([1, 1])
    verified, decoded = clones(start), clones(start[:2])
    out = verify(qkv, b_a, z, *params, *verified, slots, fresh, step.rows, step.lengths)
    triton_gated_deltanet_commit(hk, *verified, slots, tensor([1, 1]))
    want = triton_gated_deltanet_decode(qkv, b_a, z, *params, *decoded, slots, fresh)
    torch.testing.assert_close(out, want, **tolerance(dtype))
    assert torch.equal(verified[0], decoded[0])
    torch.testing.assert_close(verified[1], decoded[1], **tolerance(dtype))


@needs_triton
def test_blocks_wider_than_the_stash_are_refused(rng) -> None:
    hk, hv, dk, dv, taps = 1, 1, 8, 8, 4
    conv_dim = 2 * hk * dk + hv * dv
    params = (*layer_params(rng, hk, hv, dk, dv, taps, torch.float32), 1e-6, hk)
    start = pools(rng, hv, dk, dv, conv_dim, taps, torch.float32)
    step = step_batch([WIDTH + 1])
    qkv, b_a, z = step_inputs(rng, WIDTH + 1, hv, dv, conv_dim, torch.float32)
    for verify in (triton_gated_deltanet_verify, triton_gated_deltanet_verify_chunked,
                   gated_deltanet_verify_torch):  # fmt: skip
        with pytest.raises(ValueError, match=f"verify blocks of {WIDTH + 1} rows exceed"):
            verify(qkv, b_a, z, *params, *start, tensor([0]), tensor([False]), step.rows,
                   step.lengths)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verify_twin_is_the_layer_step(rng, dtype: torch.dtype) -> None:
    """The verify twin computes what the layer's step path computes for a forward of verify
    blocks (outputs and stash), bit for bit, and the commit twin is the layer's commit (with
    the torch backend the layer never takes the kernels)."""
    layer = GatedDeltaNet(32, 2, 4, 8, 8, 4, 1e-6).requires_grad_(False)
    for p in layer.parameters():
        p.copy_(0.3 * torch.randn(p.shape, generator=rng))
    layer.to(dtype).allocate_states(NUM_SLOTS, WIDTH, dtype, torch.device("cpu"))
    layer.conv_state.copy_(torch.randn(layer.conv_state.shape, generator=rng))
    layer.recurrent_state.copy_(torch.randn(layer.recurrent_state.shape, generator=rng))
    layer_pools = (layer.conv_state, layer.recurrent_state, layer.stash_qkv, layer.stash_mixed,
                   layer.stash_gb)  # fmt: skip
    twin_pools = clones(layer_pools)
    n, hv = sum(LENGTHS), layer.num_v_heads
    qkv = torch.randn(n, layer.conv_dim, generator=rng).to(dtype)
    b_a = torch.randn(n, 2 * hv, generator=rng).to(dtype)
    z = torch.randn(n, layer.value_dim, generator=rng).to(dtype)
    slots, fresh = torch.tensor(SLOTS), torch.tensor(FRESH)
    meta = build_linear_metadata(slots, fresh, LENGTHS, [True] * len(SLOTS))
    with torch.inference_mode():
        core = layer._mix(qkv, b_a, meta)
        want = layer.norm(core, z.reshape(core.shape)).flatten(1)
        got = gated_deltanet_verify_torch(
            qkv, b_a, z, layer.conv1d.weight.view(layer.conv_dim, -1), layer.A_log,
            layer.dt_bias, layer.norm.weight, layer.norm.eps, layer.num_k_heads, *twin_pools,
            slots, fresh, meta.step.rows, meta.step.lengths,
        )  # fmt: skip
        assert torch.equal(got, want)
        for twin_pool, layer_pool in zip(twin_pools, layer_pools, strict=True):
            assert torch.equal(twin_pool, layer_pool)
        lengths = torch.tensor([3, 1, 0])
        layer.commit_verified(slots, lengths)
        gated_deltanet_commit_torch(layer.num_k_heads, *twin_pools, slots, lengths)
    for twin_pool, layer_pool in zip(twin_pools, layer_pools, strict=True):
        assert torch.equal(twin_pool, layer_pool)
