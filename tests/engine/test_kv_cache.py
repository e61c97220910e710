"""KV pool sizing and allocation (blockdraft/engine/kv_cache.py), on stand-in layers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from blockdraft.config import EngineConfig
from blockdraft.engine.kv_cache import (
    allocate_kv_cache,
    kv_bytes_per_block,
    max_blocks_per_seq,
    num_kv_blocks,
    zeroed,
)

CPU = torch.device("cpu")


def layers(rng: torch.Generator, count: int) -> list[SimpleNamespace]:
    shapes = torch.randint(1, 5, (count, 2), generator=rng).tolist()
    return [SimpleNamespace(num_kv_heads=h, head_dim=8 * d) for h, d in shapes]


def config(**kwargs) -> EngineConfig:
    return EngineConfig(device="cpu", speculative_config=None, **kwargs)


def test_a_request_holds_its_tokens_and_two_lookaheads() -> None:
    """A verify at max_model_len holds N rows past the last token and the drafter's block
    lookahead rows past that: max_model_len + 2 * lookahead rows, rounded up to blocks."""
    assert max_blocks_per_seq(64, 0, 16) == 4
    assert max_blocks_per_seq(64, 8, 16) == 5
    assert max_blocks_per_seq(65, 8, 16) == 6
    assert max_blocks_per_seq(48, 8, 16) == 4


def test_the_budget_sets_the_blocks_up_to_what_max_num_seqs_requests_use(rng) -> None:
    attn = layers(rng, 3)
    per_block = kv_bytes_per_block(attn, 16, torch.float32)
    assert per_block == sum(2 * 16 * a.num_kv_heads * a.head_dim * 4 for a in attn)
    gib = 200 * per_block / 2**30  # room for 200 blocks
    small = config(block_size=16, max_num_seqs=2, kv_cache_memory_gib=gib)
    assert num_kv_blocks(small, attn, CPU, 64, 8) == 2 * max_blocks_per_seq(64, 8, 16)
    many = config(block_size=16, max_num_seqs=512, kv_cache_memory_gib=gib)
    assert num_kv_blocks(many, attn, CPU, 64, 8) == 200
    fixed = config(block_size=16, num_kv_blocks=7)
    assert num_kv_blocks(fixed, attn, CPU, 64, 8) == 7


def test_window_pages_cost_a_block_only_up_to_the_window_pools_size(rng) -> None:
    """The drafter's sliding layers (a pool of at most `max_pages` pages) cost a block their
    bytes only up to that many blocks; past it a block costs the shared layers' alone."""
    shared, window = layers(rng, 2), layers(rng, 3)
    per_block = kv_bytes_per_block(shared, 16, torch.float32)
    per_page = kv_bytes_per_block(window, 16, torch.float32)
    budget = 100 * (per_block + per_page)
    cfg = config(block_size=16, max_num_seqs=512, kv_cache_memory_gib=budget / 2**30)
    assert num_kv_blocks(cfg, shared + window, CPU, 64, 8) == 100
    assert num_kv_blocks(cfg, shared, CPU, 64, 8, window_pool=(window, 500)) == 100
    more = num_kv_blocks(cfg, shared, CPU, 64, 8, window_pool=(window, 40))
    assert more == 40 + (budget - 40 * (per_block + per_page)) // per_block > 100
    with pytest.raises(ValueError, match="needs"):
        num_kv_blocks(config(block_size=16, num_kv_blocks=3), shared, CPU, 64, 8,
                      window_pool=(window, 1))  # fmt: skip


def test_linear_attention_states_come_out_of_the_budget_first(rng) -> None:
    """A hybrid model's state slots take their bytes from the budget before the blocks do; a
    budget they leave too small for one request says so."""
    attn = layers(rng, 2)
    per_block = kv_bytes_per_block(attn, 16, torch.float32)
    cfg = config(block_size=16, max_num_seqs=512, kv_cache_memory_gib=200 * per_block / 2**30)
    assert num_kv_blocks(cfg, attn, CPU, 64, 8, state_bytes=50 * per_block) == 150
    with pytest.raises(ValueError, match="linear-attention states take"):
        num_kv_blocks(cfg, attn, CPU, 64, 8, state_bytes=198 * per_block)


def test_a_pool_smaller_than_one_request_is_refused(rng) -> None:
    with pytest.raises(ValueError, match="raise num_kv_blocks to at least 5") as error:
        num_kv_blocks(config(block_size=16, num_kv_blocks=4), layers(rng, 2), CPU, 64, 8)
    assert "GiB for one request of max_model_len 64" in str(error.value)


def test_every_layer_gets_the_pool_and_a_pad_block(rng) -> None:
    attn = layers(rng, 2)
    allocate_kv_cache(attn, 5, 4, torch.float32, CPU)
    for a in attn:
        shape = (6, 4, a.num_kv_heads, a.head_dim)
        assert a.key_cache.shape == a.value_cache.shape == shape
        assert a.key_cache.eq(0).all() and a.value_cache.eq(0).all()
        assert a.split_counters.dtype == torch.int32 and a.split_counters.eq(0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_pools_are_zeros_of_their_own(dtype: torch.dtype) -> None:
    """The CPU pool comes from calloc'd pages: zeros in any dtype, writable, not shared."""
    a, b = zeroed((3, 4, 2, 8), dtype, CPU), zeroed((3, 4, 2, 8), dtype, CPU)
    assert a.dtype == dtype and a.shape == (3, 4, 2, 8) and not a.any()
    a[1, 2] = 1.5
    assert a.sum().item() == 1.5 * 16 and not b.any()


def test_the_allocators_cached_blocks_count_as_free(rng, monkeypatch) -> None:
    """On CUDA the budget is the driver's free memory after the allocator hands back what it
    caches (loading frees the unfused projections into its cache), less what
    gpu_memory_utilization keeps back."""
    attn = layers(rng, 2)
    per_block = kv_bytes_per_block(attn, 16, torch.float32)
    total, cached = 1000 * per_block, int(torch.randint(100, 400, (), generator=rng))
    driver_free = [300 * per_block]

    def empty_cache() -> None:
        driver_free[0] += cached * per_block

    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (driver_free[0], total))
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=total)
    )
    cfg = config(block_size=16, max_num_seqs=512, gpu_memory_utilization=0.9)
    got = num_kv_blocks(cfg, attn, torch.device("cuda"), 64, 8)
    assert got == 300 + cached - 100
