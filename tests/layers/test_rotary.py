"""`blockdraft.layers.rotary`: partial rotary (Hugging Face's `partial_rotary_factor`) against
transformers' Qwen3-Next rotary embedding and `apply_rotary_pos_emb`, in float32; the fused q/k
norm + RoPE path against the norm modules and the eager rotation."""

import pytest
import torch

from blockdraft.kernels.rope import qk_norm_rope_torch
from blockdraft.layers.norm import RMSNorm
from blockdraft.layers.rotary import RotaryEmbedding

from kernel_inputs import DEVICE, eager_rotate, needs_triton, qk_case, tolerance

qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")


@pytest.mark.parametrize(("head_dim", "factor"), [(32, 0.25), (24, 0.5), (16, 1.0)])
def test_partial_rotary_matches_transformers(rng, head_dim: int, factor: float) -> None:
    """The first head_dim * factor dimensions of each head are rotated (rotate-half within
    them, frequencies over them alone), the rest pass through unchanged."""
    from transformers import Qwen3NextConfig

    theta, max_position, heads, tokens = 10000.0, 64, 3, 7
    cfg = Qwen3NextConfig(
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=head_dim,
        max_position_embeddings=max_position,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": theta,
            "partial_rotary_factor": factor,
        },
    )
    positions = torch.randint(0, max_position, (tokens,), generator=rng)
    x = torch.randn(tokens, heads, head_dim, generator=rng)
    cos, sin = qwen3_next.Qwen3NextRotaryEmbedding(cfg)(x, positions[None])
    # transformers' layout: [batch, heads, tokens, head_dim]; q and k rotate alike.
    q = x.transpose(0, 1)[None]
    ref, _ = qwen3_next.apply_rotary_pos_emb(q, q, cos, sin)
    ref = ref[0].transpose(0, 1)

    rotary = RotaryEmbedding(head_dim, max_position, theta, partial_rotary_factor=factor)
    assert rotary.rotary_dim == int(head_dim * factor)
    got = rotary.rotate(positions, x)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    if factor < 1:
        assert torch.equal(got[..., rotary.rotary_dim :], x[..., rotary.rotary_dim :])
        assert not torch.allclose(got[..., : rotary.rotary_dim], x[..., : rotary.rotary_dim])


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_qk_norm_rope_matches_layers(rng, set_policy, dtype: torch.dtype) -> None:
    """The twin is bit-identical to the norm modules + the old rotate; the Triton path of the
    layer is close, and training (grad) falls back to the twin."""
    set_policy(backend="torch")
    rotary, query, key, positions, q_w, k_w = qk_case(rng, 6, 4, 2, 48, dtype, True)
    q_norm, k_norm = RMSNorm(48, eps=1e-5).to(DEVICE, dtype), RMSNorm(48, eps=1e-5)
    k_norm = k_norm.to(DEVICE, dtype)
    q_norm.weight.data, k_norm.weight.data = q_w, k_w
    expected = (
        eager_rotate(rotary, positions, q_norm(query)),
        eager_rotate(rotary, positions, k_norm(key)),
    )
    got = rotary(positions, query, key, q_w, k_w, 1e-5)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, atol=0, rtol=0)
    assert torch.equal(rotary(positions, query, key)[0], eager_rotate(rotary, positions, query))
    assert torch.equal(rotary.rotate(positions, key), eager_rotate(rotary, positions, key))
    # float32 norm weights over bf16 heads (autocast training) give float32 heads, as before.
    _, mixed = qk_norm_rope_torch(
        None, key, positions, rotary.cos_cache, rotary.sin_cache, None, k_w.float(), 1e-5
    )
    assert mixed.dtype == torch.float32
    set_policy(backend="triton")
    triton_rotary = RotaryEmbedding(48, 50, 10000.0).to(DEVICE)
    got = triton_rotary(positions, query, key, q_w, k_w, 1e-5)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, **tolerance(dtype))
    with torch.enable_grad():
        q_w.requires_grad_(True)
        triton_rotary(positions, query, key, q_w, k_w, 1e-5)[0].float().sum().backward()
    assert q_w.grad is not None
