"""`blockdraft.kernels.triton_rope`: the fused q/k norm + RoPE (and + KV store) against their
torch twins.

Runs on the CPU through Triton's interpreter (TRITON_INTERPRET=1, which tests/conftest.py sets
on a machine without a GPU). With TRITON_INTERPRET=0 on a CUDA machine the same tests run the
compiled kernels on the GPU. Shapes stay small: the interpreter costs about half a millisecond
per program.
"""

import pytest
import torch

from blockdraft.kernels.forward_context import PAD_SLOT_ID
from blockdraft.kernels.rope import (
    qk_norm_rope_store_torch,
    qk_norm_rope_torch,
)
from blockdraft.kernels.triton_rope import triton_qk_norm_rope, triton_qk_norm_rope_store

from kernel_inputs import (
    DEVICE,
    needs_triton,
    qk_case,
    tolerance,
)

pytestmark = needs_triton


# (head_dim, num_heads, num_kv_heads, block_h): GQA 2 and 3, MHA; head_dims 80 and 96 are no
# power of two (their halves padded to 64); block_h 2 over 3 heads leaves a partial block.
ROPE_SHAPES = [(64, 4, 2, None), (80, 3, 1, 2), (96, 2, 2, None), (128, 2, 1, None)]


@pytest.mark.parametrize("shape", ROPE_SHAPES, ids=lambda s: "d{}-h{}-kv{}-bh{}".format(*s))
@pytest.mark.parametrize("num_tokens", [0, 1, 5])
@pytest.mark.parametrize("with_norm", [False, True], ids=["rope", "norm-rope"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_qk_norm_rope(
    rng, shape: tuple, num_tokens: int, with_norm: bool, dtype: torch.dtype
) -> None:
    head_dim, num_heads, num_kv_heads, block_h = shape
    rotary, query, key, positions, q_w, k_w = qk_case(
        rng, num_tokens, num_heads, num_kv_heads, head_dim, dtype, with_norm
    )
    caches = (rotary.cos_cache, rotary.sin_cache)
    expected = qk_norm_rope_torch(query, key, positions, *caches, q_w, k_w, 1e-6)
    got = triton_qk_norm_rope(query, key, positions, *caches, q_w, k_w, 1e-6, block_h=block_h)
    for g, e in zip(got, expected, strict=True):
        assert g.shape == e.shape and g.dtype == e.dtype
        torch.testing.assert_close(g, e, **tolerance(dtype))
    # Keys alone (the drafter's context K): the same keys, no query.
    q_none, k_only = triton_qk_norm_rope(None, key, positions, *caches, None, k_w, 1e-6)
    assert q_none is None
    torch.testing.assert_close(k_only, expected[1], **tolerance(dtype))


# (head_dim, num_heads, num_kv_heads, block_h): GQA 3 over a partial head block, GQA 2 with
# several key-head programs per token, MHA; head_dims 80 and 96 are no power of two.
ROPE_STORE_SHAPES = [(80, 3, 1, 2), (96, 4, 2, 1), (16, 2, 2, None)]


@pytest.mark.parametrize("shape", ROPE_STORE_SHAPES, ids=lambda s: "d{}-h{}-kv{}-bh{}".format(*s))
@pytest.mark.parametrize("num_tokens", [0, 1, 6])
@pytest.mark.parametrize("with_norm", [False, True], ids=["rope", "norm-rope"])
@pytest.mark.parametrize(
    "dtype,cache_dtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float32),  # a cache dtype other than the activations'
    ],
    ids=["fp32", "bf16", "fp16-fp32cache"],
)
def test_qk_norm_rope_store(
    rng,
    shape: tuple,
    num_tokens: int,
    with_norm: bool,
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
) -> None:
    """The fused norm + RoPE + KV store against its twin (rotation, then `store_kv`): the same
    returned heads, and every slot a sequence can read the same in both caches."""
    head_dim, num_heads, num_kv_heads, block_h = shape
    block_size, num_blocks = 4, 4
    rotary, query, key, positions, q_w, k_w = qk_case(
        rng, num_tokens, num_heads, num_kv_heads, head_dim, dtype, with_norm
    )
    # The values: the third slice of the fused projection q and k come from (strided rows).
    value = key.as_strided(key.shape, key.stride(), num_kv_heads * head_dim + key.storage_offset())
    caches = (rotary.cos_cache, rotary.sin_cache)
    # Distinct slots, the pool's last block reserved (the twin sends PAD rows there), and a
    # third of the rows PAD.
    slots = torch.randperm((num_blocks - 1) * block_size, generator=rng)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=rng)[: num_tokens // 3]] = PAD_SLOT_ID
    slots = slots.to(DEVICE)
    shape_c = (num_blocks, block_size, num_kv_heads, head_dim)
    # NaN everywhere: a slot the kernel misses, or a PAD row it writes, shows up.
    key_cache = torch.full(shape_c, float("nan"), dtype=cache_dtype, device=DEVICE)
    value_cache = torch.full_like(key_cache, float("nan"))
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    expected = qk_norm_rope_store_torch(
        query, key, value, positions, *caches, q_w, k_w, 1e-6, expected_k, expected_v, slots
    )
    store = (key_cache, value_cache, slots)
    got = triton_qk_norm_rope_store(
        query, key, value, positions, *caches, q_w, k_w, 1e-6, *store, block_h=block_h
    )
    for g, e in zip(got, expected, strict=True):
        assert g.shape == e.shape and g.dtype == e.dtype
        torch.testing.assert_close(g, e, **tolerance(dtype))
    written = slots[slots >= 0]
    for cache, twin in [(key_cache, expected_k), (value_cache, expected_v)]:
        flat, flat_twin = cache.flatten(0, 1), twin.flatten(0, 1)
        # The values are copied as they are (a cast at most); the keys within a rounding.
        tol = tolerance(dtype) if cache is key_cache else dict(atol=0, rtol=0)
        torch.testing.assert_close(flat[written], flat_twin[written], **tol)
        unwritten = torch.ones(flat.shape[0], dtype=torch.bool, device=DEVICE)
        unwritten[written] = False
        assert flat[unwritten].isnan().all()  # PAD rows (and the reserved last slot) untouched
    # The cache holds exactly the returned keys.
    rows = slots >= 0
    assert torch.equal(key_cache.flatten(0, 1)[written], got[1][rows].to(cache_dtype))
    # Keys alone (the drafter's context K/V): the same keys and slots, no query.
    key_cache.fill_(float("nan"))
    value_cache.fill_(float("nan"))
    q_none, k_only = triton_qk_norm_rope_store(
        None, key, value, positions, *caches, None, k_w, 1e-6, *store
    )
    assert q_none is None
    torch.testing.assert_close(k_only, expected[1], **tolerance(dtype))
    torch.testing.assert_close(
        key_cache.flatten(0, 1)[written], expected_k.flatten(0, 1)[written], **tolerance(dtype)
    )
    assert torch.equal(value_cache.flatten(0, 1)[written], expected_v.flatten(0, 1)[written])
