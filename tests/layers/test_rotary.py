"""`blockdraft.layers.rotary`: partial rotary (Hugging Face's `partial_rotary_factor`) against
transformers' Qwen3-Next rotary embedding and `apply_rotary_pos_emb`, in float32."""

import pytest
import torch

from blockdraft.layers.rotary import RotaryEmbedding

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
