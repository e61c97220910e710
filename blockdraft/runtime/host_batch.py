"""Host batch helpers: the flat int64 tensors of a step (ids, positions, KV slots, block tables)
built from the scheduler's lists, and the attention metadata of an eager forward."""

from __future__ import annotations

import numpy as np
import torch

from blockdraft.kernels.forward_context import AttentionMetadata


def host_int64(values: list, pinned: bool = False) -> torch.Tensor:  # [n] or [rows, cols] int64
    """A host int64 tensor from a (nested) list of ints. Through numpy: `torch.tensor` on a
    list converts element by element, several times slower on the per-step inputs. `pinned`
    (for a CUDA destination): a copy from page-locked memory never waits for the GPU, while
    one from pageable memory may wait for the work queued before it (the step's forwards)."""
    host = torch.from_numpy(np.array(values, dtype=np.int64))
    return host.pin_memory() if pinned else host


def int64_tensors(device: torch.device, *parts: list[int]) -> list[torch.Tensor]:
    """Several int64 vectors built as one host tensor and moved in one copy, returned as views:
    each separate `torch.tensor(..., device=cuda)` would pay its own build and transfer. Each
    view starts 16-byte aligned (parts padded to even lengths): Triton specialises a kernel on
    its pointers' 16-byte alignment, so a view after an odd-length part would compile another
    variant of every kernel reading it, in the middle of serving."""
    sizes = [len(p) for p in parts]
    padded = [n + n % 2 for n in sizes]
    values = [v for part in parts for v in [*part, *[0] * (len(part) % 2)]]
    flat = host_int64(values, pinned=device.type == "cuda").to(device, non_blocking=True)
    return [view[:n] for view, n in zip(flat.split(padded), sizes, strict=True)]


def slots_for_positions(block_table: list[int], positions: range, block_size: int) -> list[int]:
    return [block_table[p // block_size] * block_size + p % block_size for p in positions]


def flat_slots(
    block_tables: list[list[int]], starts: list[int], query_lens: list[int], block_size: int
) -> list[int]:
    slots: list[int] = []
    for table, start, n in zip(block_tables, starts, query_lens, strict=True):
        slots += slots_for_positions(table, range(start, start + n), block_size)
    return slots


def padded_block_tables(block_tables: list[list[int]]) -> list[list[int]]:
    width = max(len(t) for t in block_tables)
    return [t + [0] * (width - len(t)) for t in block_tables]


def build_attention_metadata(
    block_tables: list[list[int]],
    starts: list[int],
    query_lens: list[int],
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """Sequence i computes positions starts[i] .. starts[i] + query_lens[i] - 1 and sees every
    key before them."""
    seq_lens = [s + n for s, n in zip(starts, query_lens, strict=True)]
    slots = flat_slots(block_tables, starts, query_lens, block_size)
    padded = padded_block_tables(block_tables)
    loc = [0]
    for n in query_lens:
        loc.append(loc[-1] + n)

    def as_tensor(values: list) -> torch.Tensor:
        return host_int64(values, pinned=device.type == "cuda").to(device, non_blocking=True)

    return AttentionMetadata(
        slot_mapping=as_tensor(slots),
        query_start_loc=as_tensor(loc),
        seq_lens=as_tensor(seq_lens),
        block_tables=as_tensor(padded),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
        uniform_query_len=len(set(query_lens)) == 1,
    )
