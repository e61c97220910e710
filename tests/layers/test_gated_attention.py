"""`blockdraft.layers.gated_attention`: Qwen3.5's full-attention layer (offset q/k norms, partial
rotary, output gate) through the fused q/k norm + RoPE (+ KV store) kernel, against the eager
composition it ran before (`OffsetRMSNorm`, `RotaryEmbedding.rotate`, a separate store, the gate
copied contiguous): bit for bit on the torch backend and under autograd, within a rounding on
the Triton path, which takes one rotary launch (with or without the store) and no store kernel
when it fuses the store. The output gate's shortcut against transformers' expression.

The model tests (tests/models/test_qwen3_5.py, test_qwen3_next.py) check the layer inside whole
models against transformers."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from blockdraft.kernels import triton_rope
from blockdraft.kernels.forward_context import forward_context
from blockdraft.layers.gated_attention import GatedSelfAttention, output_gate
from blockdraft.layers.linear import linear
from blockdraft.layers.rotary import RotaryEmbedding

from kernel_inputs import DEVICE, needs_triton, paged_batch, randn

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 32, 4, 2, 16
# A prefill chunk, a decode row and a verify block over scattered pages.
STARTS, QUERY_LENS, BLOCK_SIZE = [5, 9, 3], [3, 1, 4], 4


def gated_layer(rng: torch.Generator, fused_projections: bool) -> GatedSelfAttention:
    """Qwen3.5's shape in small: partial_rotary_factor 0.25 (4 of 16 dimensions rotate), GQA 2;
    random weights (the offset norms' around zero, as they start)."""
    rotary = RotaryEmbedding(HEAD_DIM, 64, 10000.0, partial_rotary_factor=0.25)
    layer = GatedSelfAttention(HIDDEN, HEADS, KV_HEADS, HEAD_DIM, rotary, 1e-6)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=rng))
    layer = layer.to(DEVICE).requires_grad_(False)
    if fused_projections:
        layer.fuse_projections()
    return layer


def eager_forward(
    layer: GatedSelfAttention,
    x: torch.Tensor,  # [num_tokens, hidden]
    positions: torch.Tensor,  # [num_tokens] int64
) -> torch.Tensor:  # [num_tokens, hidden]
    """`GatedSelfAttention.forward` as written before the fused kernel took its norms and
    rotation: the numerics to keep."""
    projs = (layer.q_proj, layer.k_proj, layer.v_proj)
    q_gate, k, v = (linear(x, p.weight, p.bias) for p in projs)
    q, gate = q_gate.reshape(-1, HEADS, 2 * HEAD_DIM).chunk(2, dim=-1)
    k, v = k.reshape(-1, KV_HEADS, HEAD_DIM), v.reshape(-1, KV_HEADS, HEAD_DIM)
    q = layer.rotary.rotate(positions, layer.q_norm(q))
    k = layer.rotary.rotate(positions, layer.k_norm(k))
    out = layer.attn(q.contiguous(), k.contiguous(), v).flatten(1)
    out = out * torch.sigmoid(gate.reshape(out.shape))
    return linear(out, layer.o_proj.weight, layer.o_proj.bias)


def run_layer(
    layer: GatedSelfAttention,
    forward: Callable[[GatedSelfAttention, torch.Tensor, torch.Tensor], torch.Tensor],
    caches: tuple[torch.Tensor, torch.Tensor],  # the caches to start from (copied)
    meta: object,
    x: torch.Tensor,  # [num_tokens, hidden]
    positions: torch.Tensor,  # [num_tokens] int64
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # output, key cache, value cache
    layer.attn.key_cache, layer.attn.value_cache = (c.clone() for c in caches)
    with forward_context(meta):
        out = forward(layer, x, positions)
    return out, layer.attn.key_cache, layer.attn.value_cache


def batch(rng: torch.Generator) -> tuple[object, tuple, torch.Tensor, torch.Tensor]:
    meta, key_cache, value_cache = paged_batch(
        rng, STARTS, QUERY_LENS, BLOCK_SIZE, KV_HEADS, HEAD_DIM
    )
    positions = torch.cat(
        [torch.arange(s, s + n) for s, n in zip(STARTS, QUERY_LENS, strict=True)]
    ).to(DEVICE)
    return meta, (key_cache, value_cache), randn(rng, sum(QUERY_LENS), HIDDEN), positions


@pytest.mark.parametrize("fuse_store", [False, True], ids=["separate-store", "fused-store"])
@pytest.mark.parametrize("fused", [False, True], ids=["separate-projections", "fused-projections"])
def test_torch_backend_is_the_eager_forward(rng, set_policy, fuse_store: bool, fused: bool) -> None:
    """On the torch backend, inference and training, the layer is the eager forward bit for
    bit (outputs, caches and, under autograd, gradients)."""
    set_policy(backend="torch", fuse_kv_store_into_rope=fuse_store)
    layer = gated_layer(rng, fused)
    meta, caches, x, positions = batch(rng)
    with torch.no_grad():  # not inference mode: meta's cached layout serves autograd below
        expected = run_layer(layer, eager_forward, caches, meta, x, positions)
        got = run_layer(layer, GatedSelfAttention.forward, caches, meta, x, positions)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, atol=0, rtol=0)
    if fused:
        return  # fuse_projections freezes the weights into one matrix: no training there
    layer.requires_grad_(True)
    grads = []
    for forward in (eager_forward, GatedSelfAttention.forward):
        layer.zero_grad()
        with torch.enable_grad():
            out, *_ = run_layer(layer, forward, caches, meta, x, positions)
            out.square().sum().backward()
        grads.append([p.grad.clone() for p in layer.parameters()])
        assert layer.q_norm.weight.grad.abs().sum() > 0
    for g, e in zip(*grads, strict=True):
        torch.testing.assert_close(g, e, atol=0, rtol=0)


@needs_triton
@pytest.mark.parametrize("fuse_store", [False, True], ids=["separate-store", "fused-store"])
def test_triton_path_fuses_norms_rope_and_store(
    rng, monkeypatch, set_policy, fuse_store: bool
) -> None:
    """On the Triton path the q/k norms and the partial rotation are one rotary launch over the
    strided queries; with fuse_kv_store_into_rope it also stores the keys and values (no store
    kernel). Outputs and caches match the eager forward within a rounding."""
    calls = {"rope": 0, "rope+store": 0, "store": 0}

    def counting(name: str, fn: Callable) -> Callable:
        def run(*args: object, **kwargs: object) -> object:
            calls[name] += 1
            return fn(*args, **kwargs)

        return run

    from blockdraft.kernels import triton_kv_store

    monkeypatch.setattr(
        triton_rope, "triton_qk_norm_rope", counting("rope", triton_rope.triton_qk_norm_rope)
    )
    store_fn = counting("rope+store", triton_rope.triton_qk_norm_rope_store)
    monkeypatch.setattr(triton_rope, "triton_qk_norm_rope_store", store_fn)
    monkeypatch.setattr(
        triton_kv_store, "triton_store_kv", counting("store", triton_kv_store.triton_store_kv)
    )
    layer = gated_layer(rng, fused_projections=True)
    meta, caches, x, positions = batch(rng)
    set_policy(backend="torch")
    with torch.inference_mode():
        expected = run_layer(layer, eager_forward, caches, meta, x, positions)
    set_policy(backend="triton", fuse_kv_store_into_rope=fuse_store)
    with torch.inference_mode():
        got = run_layer(layer, GatedSelfAttention.forward, caches, meta, x, positions)
    if fuse_store:
        assert calls == {"rope": 0, "rope+store": 1, "store": 0}
    else:
        assert calls == {"rope": 1, "rope+store": 0, "store": 1}
    for g, e in zip(got, expected, strict=True):
        # All but the pool's reserved last slot (the torch store's PAD rows land there).
        torch.testing.assert_close(g.flatten(0, 1)[:-1], e.flatten(0, 1)[:-1], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_output_gate_is_transformers_expression(rng, dtype: torch.dtype) -> None:
    """`output_gate` on the strided gate beside the queries gives the numbers of the contiguous
    copy transformers gates with, bit for bit (on the GPU when the tests run there)."""
    for num_tokens, head_dim in [(5, 16), (33, 16), (3, 256)]:
        q_gate = randn(rng, num_tokens, HEADS, 2 * head_dim, dtype=dtype) * 4
        gate = q_gate.chunk(2, dim=-1)[1]
        out = randn(rng, num_tokens, HEADS, head_dim, dtype=dtype)
        flat = out.flatten(1)
        expected = flat * torch.sigmoid(gate.reshape(flat.shape))
        torch.testing.assert_close(output_gate(out, gate).flatten(1), expected, atol=0, rtol=0)
