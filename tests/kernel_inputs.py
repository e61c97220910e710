"""Inputs and eager references shared by the kernel tests (tests/kernels/) and the layer and
model tests that switch those kernels on (tests/layers/, tests/models/, tests/engine/).

Triton runs through its interpreter on the CPU (TRITON_INTERPRET=1, which tests/conftest.py sets
on a machine without a GPU); with TRITON_INTERPRET=0 on a CUDA machine the same tests run the
compiled kernels on the GPU.
"""

import math

import pytest
import torch

from blockdraft.kernels.forward_context import AttentionMetadata
from blockdraft.kernels.triton_env import triton_interpreting
from blockdraft.layers.rotary import RotaryEmbedding
from blockdraft.models.model_config import TransformerConfig
from blockdraft.runtime.host_batch import build_attention_metadata

INTERPRETED = triton_interpreting()
needs_triton = pytest.mark.skipif(
    not INTERPRETED and not torch.cuda.is_available(),
    reason="compiled Triton needs a CUDA device",
)
DEVICE = torch.device("cpu" if INTERPRETED else "cuda")
ATOL = 2e-5 if INTERPRETED else 1e-4  # fp32 tensor-core dots on the GPU round differently


def randn(rng: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=rng).to(DEVICE, dtype)


def paged_batch(
    rng: torch.Generator,
    starts: list[int],
    query_lens: list[int],
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    spare_blocks: int = 3,
) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor]:
    """Metadata over scattered pages (a random permutation of the pool) and random caches;
    every slot holds data, so a wrong page or a key past seq_len shows up in the output."""
    needed = [-(-(s + n) // block_size) for s, n in zip(starts, query_lens, strict=True)]
    num_blocks = sum(needed) + spare_blocks
    perm = torch.randperm(num_blocks, generator=rng).tolist()
    tables, used = [], 0
    for n in needed:
        tables.append(perm[used : used + n])
        used += n
    meta = build_attention_metadata(tables, starts, query_lens, block_size, DEVICE)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return meta, randn(rng, *shape), randn(rng, *shape)


def assert_same_slots(cache: torch.Tensor, expected: torch.Tensor) -> None:
    # cache: [num_blocks, block_size, num_kv_heads, head_dim]; all slots but the last.
    assert torch.equal(cache.flatten(0, 1)[:-1], expected.flatten(0, 1)[:-1])


def eager_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`RMSNorm.forward` as written before the kernel existed: the numerics to keep."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


OptTensor = torch.Tensor | None
BF16_TOL = dict(atol=3e-2, rtol=3e-2)  # a bf16 ulp or two


def tolerance(dtype: torch.dtype) -> dict:
    return dict(atol=ATOL, rtol=1e-5) if dtype == torch.float32 else BF16_TOL


def assert_near(
    got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, bf16_max: float, bf16_mean: float
) -> None:
    """Tight in float32. With bf16 inputs, a kernel that rounds intermediates (Gated DeltaNet's
    conv outputs, beta, core) flips one of their ulps now and then, which a norm can blow up:
    bounds on the largest and on the mean error, which wrong operands or misplaced roundings
    exceed."""
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, **tolerance(dtype))
        return
    err = (got.float() - want.float()).abs()
    assert err.max() <= bf16_max and err.mean() <= bf16_mean, (err.max(), err.mean())


def eager_rotate(rotary: RotaryEmbedding, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`RotaryEmbedding.rotate` as written before the fused kernel: the numerics to keep."""
    cos = rotary.cos_cache[positions][:, None, :]
    sin = rotary.sin_cache[positions][:, None, :]
    x32 = x.float()
    x1, x2 = x32.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def qk_case(
    rng: torch.Generator,
    num_tokens: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    with_norm: bool,
) -> tuple[RotaryEmbedding, torch.Tensor, torch.Tensor, torch.Tensor, OptTensor, OptTensor]:
    """(rotary, query, key, positions, q_norm_weight, k_norm_weight): strided q and k sliced
    from one fused qkv projection, positions over the whole table, norm weights around 1 (or
    None: Llama)."""
    rotary = RotaryEmbedding(head_dim, 50, 10000.0).to(DEVICE)
    qkv = randn(rng, num_tokens, num_heads + 2 * num_kv_heads, head_dim).to(dtype)
    query, key = qkv[:, :num_heads], qkv[:, num_heads : num_heads + num_kv_heads]
    positions = torch.randint(0, 50, (num_tokens,), generator=rng).to(DEVICE)
    weights = [(1 + 0.1 * randn(rng, head_dim)).to(dtype) if with_norm else None for _ in "qk"]
    return rotary, query, key, positions, *weights


def tiny_qwen3_config(num_layers: int) -> TransformerConfig:
    """A Qwen3-shaped model (q/k norms, GQA 2) small enough for the interpreter."""
    return TransformerConfig(
        architecture="qwen3",
        vocab_size=50,
        hidden_size=24,
        intermediate_size=40,
        num_layers=num_layers,
        num_heads=2,
        num_kv_heads=1,
        head_dim=12,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=16,
        tie_word_embeddings=False,
        attention_bias=False,
        qk_norm=True,
    )


def inputs(
    rng: torch.Generator, m: int, n: int, k: int, dtype: torch.dtype, bias: bool, strided: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x [m, k] (a column slice of a wider matrix when strided: row stride k + 24), W [n, k]
    scaled to keep outputs O(1), bias [n] or None."""
    x = randn(rng, m, k + 24, dtype=dtype)[:, 5 : 5 + k] if strided else randn(rng, m, k)
    x = x.to(dtype)
    w = (randn(rng, n, k) / math.sqrt(k)).to(dtype)
    return x, w, randn(rng, n, dtype=dtype) if bias else None
