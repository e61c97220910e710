"""The paged KV pool: how many blocks it gets, and its allocation in every attention layer
(the target's and the drafter's, which share the block tables). Hybrid models' per-request
state slots come out of the same memory budget first (`state_bytes`). A drafter's
sliding-window layers get a pool of their own, of at most a window's pages per running
request (window_pages.py), unless prefix caching shares blocks."""

from __future__ import annotations

import logging
import math

import numpy as np
import torch

from blockdraft.config import EngineConfig
from blockdraft.distributed.tensor_parallel import TensorParallel
from blockdraft.engine.block_manager import BlockManager
from blockdraft.engine.model_loader import LoadedModels
from blockdraft.engine.window_pages import DrafterWindowPages, window_pages_per_seq
from blockdraft.layers.attention import PagedAttention

logger = logging.getLogger(__name__)

# Split-K counters per attention layer (PagedAttention.split_counters): split-K only runs where
# num_seqs * num_kv_heads programs leave SMs idle, so this covers any GPU's SM count.
SPLIT_COUNTERS = 1024


def allocate_kv_pool(
    config: EngineConfig, loaded: LoadedModels, device: torch.device, tp: TensorParallel | None
) -> BlockManager:
    """Sizes the pool, allocates it in the target's and the drafter's attention layers (and a
    hybrid target's state slots) and returns the block manager over it."""
    model, max_model_len, lookahead = loaded.model, loaded.max_model_len, loaded.lookahead
    bs = config.block_size
    # Hybrid models: a state slot per running request, plus a spare that rows of requests
    # without one (warm-up) use.
    hybrid = hasattr(model, "allocate_states")
    prefix_caching = config.enable_prefix_caching and not hybrid
    if hybrid and config.enable_prefix_caching:
        logger.info(
            "prefix caching is off: the model's linear-attention layers keep one recurrent "
            "state per request, not one per cached block"
        )
    drafter_layers = loaded.drafter.attention_layers if loaded.drafter is not None else []
    window_layers = [a for a in drafter_layers if a.window is not None]
    window = max((a.window for a in window_layers), default=0)
    pages_per_seq = window_pages_per_seq(window, lookahead, bs)
    if pages_per_seq >= max_blocks_per_seq(max_model_len, lookahead, bs):
        window_layers = []  # the window spans whole requests: nothing to free
    elif window_layers and prefix_caching:
        logger.info(
            "the drafter's sliding-window layers keep every block of a request: prefix "
            "caching shares blocks between requests (enable_prefix_caching=False bounds them "
            "to their window of %d tokens)",
            window,
        )
        window_layers = []
    shared = list(model.attention_layers) + [a for a in drafter_layers if a not in window_layers]
    window_pool = (window_layers, config.max_num_seqs * pages_per_seq if window_layers else 0)
    num_slots = config.max_num_seqs + 1 if hybrid else 0
    state_bytes = num_slots and num_slots * model.state_bytes(config.torch_dtype, lookahead)
    num_blocks = num_kv_blocks(
        config, shared, device, max_model_len, lookahead, state_bytes, window_pool
    )
    if tp is not None:  # one block table for every rank's pool
        num_blocks = tp.min_over_ranks(num_blocks, device)
    allocate_kv_cache(shared, num_blocks, bs, config.torch_dtype, device)
    window_pages = None
    if window_layers:
        num_pages = min(num_blocks, window_pool[1])
        allocate_kv_cache(window_layers, num_pages, bs, config.torch_dtype, device)
        window_pages = DrafterWindowPages(num_blocks, num_pages, window, bs, device)
        logger.info(
            "the drafter's %d sliding-window layers keep %d pages of %d tokens (at most %d a "
            "request: its window of %d tokens), not the pool's %d blocks",
            len(window_layers), num_pages, bs, pages_per_seq, window, num_blocks,
        )  # fmt: skip
        for attn in window_layers:
            attn.page_map = window_pages.page_map
    if hybrid:
        model.allocate_states(num_slots, lookahead, config.torch_dtype, device)
    return BlockManager(
        num_blocks,
        bs,
        prefix_caching,
        num_state_slots=config.max_num_seqs if hybrid else 0,
        window_pages=window_pages,
    )


def allocate_kv_cache(
    layers: list[PagedAttention],
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    for attn in layers:
        # One extra block at the end takes the writes of padded rows (see store_kv).
        shape = (num_blocks + 1, block_size, attn.num_kv_heads, attn.head_dim)
        attn.key_cache = zeroed(shape, dtype, device)
        attn.value_cache = zeroed(shape, dtype, device)
        attn.split_counters = torch.zeros(SPLIT_COUNTERS, dtype=torch.int32, device=device)


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros (unwritten slots are read under masks, where NaN garbage would survive a zero
    weight). On the CPU from calloc'd pages, which the OS zeroes on first touch: a pool that a
    few requests use costs neither the time to zero it all (1.4 s for the 2 GiB default on one
    thread) nor its resident memory."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


def kv_bytes_per_block(layers: list[PagedAttention], block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return sum(2 * block_size * a.num_kv_heads * a.head_dim * elem for a in layers)


def max_blocks_per_seq(max_model_len: int, lookahead: int, block_size: int) -> int:
    # A verify at the length limit holds N draft rows past the last token, and the drafter
    # writes its block (lookahead rows) past the new anchor: 2 * lookahead covers both.
    return -(-(max_model_len + 2 * lookahead) // block_size)


def num_kv_blocks(
    config: EngineConfig,
    layers: list[PagedAttention],
    device: torch.device,
    max_model_len: int,
    lookahead: int,
    state_bytes: int = 0,  # the linear-attention state slots' bytes, taken from the budget
    window_pool: tuple[list[PagedAttention], int] = ([], 0),  # layers with a pool of their
    # own, and its most pages: one per block up to that (window_pages.py)
) -> int:
    """The pool's blocks: config.num_kv_blocks, else what the memory budget holds after
    `state_bytes`, at most what max_num_seqs requests of max_model_len need; at least one such
    request's worth."""
    cfg = config
    per_seq = max_blocks_per_seq(max_model_len, lookahead, cfg.block_size)
    per_block = kv_bytes_per_block(layers, cfg.block_size, cfg.torch_dtype)
    per_page = kv_bytes_per_block(window_pool[0], cfg.block_size, cfg.torch_dtype)
    max_pages = window_pool[1]

    def pool_bytes(num_blocks: int) -> int:
        return num_blocks * per_block + min(num_blocks, max_pages) * per_page

    if cfg.num_kv_blocks is not None:
        num_blocks = cfg.num_kv_blocks
        room = f"num_kv_blocks {num_blocks} holds {_gib(pool_bytes(num_blocks))}"
        fix = f"raise num_kv_blocks to at least {per_seq} or lower max_model_len"
    else:
        if device.type == "cuda":
            # Blocks the allocator caches count as free: loading leaves many (fusing a 27B's
            # projections frees ~22 GB of unfused weights), which the driver's figure misses.
            torch.cuda.empty_cache()
            free, _ = torch.cuda.mem_get_info(device)
            total = torch.cuda.get_device_properties(device).total_memory
            kept = (1 - cfg.gpu_memory_utilization) * total
            budget = free - kept - state_bytes
            room = (
                f"{_gib(free)} is free after the weights, of which gpu_memory_utilization "
                f"{cfg.gpu_memory_utilization} keeps {_gib(kept)} back"
            )
            fix = (
                "raise gpu_memory_utilization or lower max_model_len (or free the GPU: "
                "LLM.shutdown() an engine no longer used)"
            )
        else:
            budget = cfg.kv_cache_memory_gib * 2**30 - state_bytes
            room = f"kv_cache_memory_gib gives it {_gib(budget + state_bytes)}"
            fix = "raise kv_cache_memory_gib or lower max_model_len"
        if state_bytes:
            room += f" and the linear-attention states take {_gib(state_bytes)} of it"
        num_blocks = int(budget // (per_block + per_page))
        if num_blocks > max_pages:  # past the window pool's size, a block costs less
            num_blocks = max_pages + int((budget - pool_bytes(max_pages)) // per_block)
        num_blocks = min(num_blocks, per_seq * cfg.max_num_seqs)
    if num_blocks < per_seq:
        raise ValueError(
            f"the KV cache needs {_gib(pool_bytes(per_seq))} for one request of "
            f"max_model_len {max_model_len}, but {room}: {fix}"
        )
    return num_blocks


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"
