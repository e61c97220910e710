"""`blockdraft.kernels.triton_kv_store` against the torch `store_kv`: PAD rows write nothing.

Runs on the CPU through Triton's interpreter (TRITON_INTERPRET=1, which tests/conftest.py sets
on a machine without a GPU). With TRITON_INTERPRET=0 on a CUDA machine the same tests run the
compiled kernels on the GPU. Shapes stay small: the interpreter costs about half a millisecond
per program.
"""

import pytest
import torch

from blockdraft.kernels.forward_context import PAD_SLOT_ID
from blockdraft.kernels.paged_attention import store_kv
from blockdraft.kernels.triton_kv_store import triton_store_kv

from kernel_inputs import (
    DEVICE,
    assert_same_slots,
    needs_triton,
    randn,
)

pytestmark = needs_triton


@pytest.mark.parametrize("block_size,num_kv_heads,head_dim", [(4, 3, 24), (16, 2, 64), (4, 1, 16)])
def test_store_kv(rng, block_size: int, num_kv_heads: int, head_dim: int) -> None:
    num_blocks, num_tokens = 5, 11
    # The pool's last block is reserved (the torch twin sends PAD rows there).
    slots = torch.randperm((num_blocks - 1) * block_size, generator=rng)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=rng)[:3]] = PAD_SLOT_ID
    slots = slots.to(DEVICE)
    # Strided key/value, as slices of a fused qkv output.
    kv = randn(rng, num_tokens, 2 * num_kv_heads + 1, head_dim)
    key, value = kv[:, :num_kv_heads], kv[:, num_kv_heads : 2 * num_kv_heads]
    key_cache = randn(rng, num_blocks, block_size, num_kv_heads, head_dim)
    value_cache = randn(rng, num_blocks, block_size, num_kv_heads, head_dim)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    before_k, before_v = key_cache.clone(), value_cache.clone()
    store_kv(key, value, expected_k, expected_v, slots)
    triton_store_kv(key, value, key_cache, value_cache, slots)
    # Every readable slot matches; the pool's last slot is reserved for PAD rows, which the
    # torch twin writes there and the kernel skips.
    assert_same_slots(key_cache, expected_k)
    assert_same_slots(value_cache, expected_v)
    # PAD rows wrote nothing.
    assert torch.equal(key_cache.flatten(0, 1)[-1], before_k.flatten(0, 1)[-1])
    assert torch.equal(value_cache.flatten(0, 1)[-1], before_v.flatten(0, 1)[-1])


@pytest.mark.parametrize("num_tokens", [0, 1])
def test_store_kv_empty_and_single(rng, num_tokens: int) -> None:
    key, value = randn(rng, num_tokens, 2, 16), randn(rng, num_tokens, 2, 16)
    key_cache, value_cache = randn(rng, 3, 4, 2, 16), randn(rng, 3, 4, 2, 16)
    slots = torch.tensor([6], device=DEVICE)[:num_tokens]
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    store_kv(key, value, expected_k, expected_v, slots)
    triton_store_kv(key, value, key_cache, value_cache, slots)
    assert_same_slots(key_cache, expected_k)
    assert_same_slots(value_cache, expected_v)
