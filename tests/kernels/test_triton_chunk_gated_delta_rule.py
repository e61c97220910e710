"""`blockdraft.kernels.triton_chunk_gated_delta_rule` against its torch twin, and the twin
against the per-sequence chunked rule: packed sequences of lengths around the 64-token chunk
(partial last chunks, a single token), zero and random initial states, value heads sharing
key heads, q/k/v as strided views of one conv output (as the layer passes them).

Runs under Triton's interpreter on the CPU (TRITON_INTERPRET=1, set by tests/conftest.py)."""

import copy

import pytest
import torch

from blockdraft.kernels import triton_chunk_gated_delta_rule as triton_chunk_module
from blockdraft.kernels.forward_context import build_linear_metadata
from blockdraft.kernels.gated_delta_rule import (
    causal_conv1d_torch,
    chunk_gated_delta_rule_torch,
    gate_inputs_torch,
    recurrent_gated_delta_rule_torch,
    split_heads,
)
from blockdraft.kernels.triton_chunk_gated_delta_rule import (
    SEQ_TILE,
    chunk_gated_delta_rule_varlen_torch,
    triton_chunk_gated_delta_rule,
)
from blockdraft.layers.gated_deltanet import GatedDeltaNet

from kernel_inputs import ATOL, DEVICE, needs_triton, randn

LENGTHS = [65, 1, 130, 63, 64, 2]


def packed_inputs(
    rng: torch.Generator, lengths: list[int], hk: int, hv: int, dk: int, dv: int, zero: bool
) -> tuple[torch.Tensor, ...]:
    """q, k, v as views of one [N, conv_dim] tensor, g, beta, initial states, cu_seqlens."""
    n = sum(lengths)
    mixed = randn(rng, n, 2 * hk * dk + hv * dv)
    q, k, v = mixed.split((hk * dk, hk * dk, hv * dv), dim=-1)
    q, k, v = q.view(n, hk, dk), k.view(n, hk, dk), v.view(n, hv, dv)
    # decays from ~1 to ~e^-3 a token: over a chunk the products span many orders
    g = -3 * torch.rand(n, hv, generator=rng).to(DEVICE) ** 2
    beta = torch.rand(n, hv, generator=rng).to(DEVICE)
    state = randn(rng, len(lengths), hv, dk, dv) * (0 if zero else 1)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=DEVICE)
    return q, k, v, g, beta, state, cu


def test_varlen_twin_is_the_chunked_rule_per_sequence(rng) -> None:
    """Bit for bit the per-sequence rule (the layer's CPU path keeps its numerics), and close
    to the token-by-token recurrence."""
    q, k, v, g, beta, state, cu = packed_inputs(rng, [70, 3, 64], 1, 2, 8, 8, zero=False)
    out, final = chunk_gated_delta_rule_varlen_torch(q, k, v, g, beta, state, cu)
    for i, (first, stop) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        rows = slice(first, stop)
        args = (q[None, rows], k[None, rows], v[None, rows], g[None, rows], beta[None, rows])
        want, want_state = chunk_gated_delta_rule_torch(*args, state[i : i + 1])
        assert torch.equal(out[rows], want[0]) and torch.equal(final[i], want_state[0])
        slow, slow_state = recurrent_gated_delta_rule_torch(*args, state[i : i + 1])
        torch.testing.assert_close(out[rows], slow[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(final[i], slow_state[0], atol=1e-4, rtol=1e-4)


@needs_triton
@pytest.mark.parametrize(
    "heads, dims, zero",
    [((1, 2), (16, 32), False), ((2, 2), (32, 16), True), ((2, 4), (8, 12), False)],
)
def test_kernel_matches_twin(rng, heads: tuple, dims: tuple, zero: bool) -> None:
    (hk, hv), (dk, dv) = heads, dims
    q, k, v, g, beta, state, cu = packed_inputs(rng, LENGTHS, hk, hv, dk, dv, zero)
    want, want_state = chunk_gated_delta_rule_varlen_torch(q, k, v, g, beta, state, cu)
    got, got_state = triton_chunk_gated_delta_rule(q, k, v, g, beta, state, cu)
    assert got.shape == want.shape and got_state.shape == want_state.shape
    torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(got_state, want_state, atol=ATOL, rtol=1e-4)


@needs_triton
def test_kernel_matches_twin_past_whole_chunks(rng) -> None:
    """A sequence of whole chunks, then one token, then one whole chunk, from random states:
    each chunk's starting state is stored by its index in the packed layout and the next
    sequence's first chunk starts on its own state; Dv over several value blocks of both the
    state and the output kernels (a partial last block), Dk under 16 and not a power of two."""
    q, k, v, g, beta, state, cu = packed_inputs(rng, [128, 1, 64], 1, 2, 12, 72, zero=False)
    want, want_state = chunk_gated_delta_rule_varlen_torch(q, k, v, g, beta, state, cu)
    got, got_state = triton_chunk_gated_delta_rule(q, k, v, g, beta, state, cu)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(got_state, want_state, atol=ATOL, rtol=1e-4)


@needs_triton
def test_kernel_matches_twin_over_many_sequences(rng) -> None:
    """More sequences than the chunk-to-sequence lookup reads at once (SEQ_TILE), of random
    lengths from 1 to 40: every chunk finds its sequence past the first tiles too."""
    count = SEQ_TILE * 2 + int(torch.randint(1, SEQ_TILE, (), generator=rng))
    lengths = torch.randint(1, 41, (count,), generator=rng).tolist()
    q, k, v, g, beta, state, cu = packed_inputs(rng, lengths, 1, 2, 8, 8, zero=False)
    want, want_state = chunk_gated_delta_rule_varlen_torch(q, k, v, g, beta, state, cu)
    got, got_state = triton_chunk_gated_delta_rule(q, k, v, g, beta, state, cu)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(got_state, want_state, atol=ATOL, rtol=1e-4)


def tiny_layer(rng: torch.Generator, dk: int, dv: int) -> GatedDeltaNet:
    """Hk 1, Hv 2, conv 4, 6 slots holding random states (a fresh chunk must not read them)."""
    layer = GatedDeltaNet(32, 1, 2, dk, dv, 4, 1e-6).requires_grad_(False)
    for p in layer.parameters():
        p.copy_(0.3 * torch.randn(p.shape, generator=rng))
    layer.to(DEVICE).allocate_states(6, 0, torch.float32, DEVICE)
    layer.conv_state.copy_(torch.randn(layer.conv_state.shape, generator=rng))
    layer.recurrent_state.copy_(torch.randn(layer.recurrent_state.shape, generator=rng))
    return layer


def mix(layer: GatedDeltaNet, x: torch.Tensor, ba: torch.Tensor, slots: list[int],
        fresh: list[bool], lens: list[int]) -> torch.Tensor:  # fmt: skip
    meta = build_linear_metadata(
        torch.tensor(slots, device=DEVICE), torch.tensor(fresh, device=DEVICE), lens,
        [False] * len(lens),
    )  # fmt: skip
    with torch.inference_mode():
        return layer._mix(x, ba, meta)


BATCH = dict(slots=[4, 0, 2, 5], fresh=[True, False, False, False], lens=[70, 1, 2, 65])


def test_layer_prefill_is_each_chunk_alone(rng, set_policy) -> None:
    """With the torch kernels the packed prefill gives each chunk, bit for bit, what the
    conv and the chunked rule give it on its own (a batch of one, as prefill chunks ran
    before they were packed), whatever its batch mates (a decode row, other chunks): outputs,
    and the slot's conv state (its window's last K - 1 rows) and recurrent state."""
    set_policy(backend="torch")
    layer = tiny_layer(rng, 8, 12)
    conv_old, state_old = layer.conv_state.clone(), layer.recurrent_state.clone()
    n = sum(BATCH["lens"])
    x, ba = randn(rng, n, layer.conv_dim), randn(rng, n, 2 * layer.num_v_heads)
    got = mix(layer, x, ba, **BATCH)
    first = 0
    for slot, fresh, length in zip(*BATCH.values(), strict=True):
        rows = slice(first, first + length)
        first += length
        if length == 1:  # the decode row: the recurrence's business
            continue
        keep = 0 if fresh else 1
        window = torch.cat((conv_old[slot] * keep, x[rows]))[None]
        mixed = causal_conv1d_torch(window, layer.conv1d.weight.view(layer.conv_dim, -1))
        g, beta = gate_inputs_torch(ba[None, rows], layer.A_log, layer.dt_bias)
        q, k, v = split_heads(mixed, layer.num_k_heads, layer.k_head_dim, layer.num_v_heads)
        state0 = state_old[slot : slot + 1] * keep
        want, want_state = chunk_gated_delta_rule_torch(q, k, v, g, beta, state0)
        assert torch.equal(got[rows], want[0]), slot
        assert torch.equal(layer.recurrent_state[slot], want_state[0]), slot
        assert torch.equal(layer.conv_state[slot], window[0, -(layer.conv_kernel - 1) :]), slot


@needs_triton
def test_layer_prefill_takes_the_kernel(rng, set_policy, monkeypatch) -> None:
    """On the Triton path the forward's prefill chunks go through one kernel call and give
    the torch path's outputs and states; the conv (torch in both) leaves equal conv states."""
    calls = []
    kernel = triton_chunk_gated_delta_rule
    monkeypatch.setattr(
        triton_chunk_module,
        "triton_chunk_gated_delta_rule",
        lambda *a, **k: calls.append(1) or kernel(*a, **k),
    )
    plain = tiny_layer(rng, 16, 16)
    fused, before = copy.deepcopy(plain), plain.recurrent_state.clone()
    n = sum(BATCH["lens"])
    x, ba = randn(rng, n, plain.conv_dim), randn(rng, n, 2 * plain.num_v_heads)
    set_policy(backend="torch")
    want = mix(plain, x, ba, **BATCH)
    set_policy(backend="triton")
    got = mix(fused, x, ba, **BATCH)
    assert calls == [1]
    torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-4)
    assert torch.equal(fused.conv_state, plain.conv_state)
    torch.testing.assert_close(fused.recurrent_state, plain.recurrent_state, atol=ATOL, rtol=1e-4)
    assert not torch.allclose(fused.recurrent_state[[4, 0, 5]], before[[4, 0, 5]])
