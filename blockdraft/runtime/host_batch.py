"""Host batch helpers: the flat int64 tensors of a step (ids, positions, KV slots, block tables)
built from the scheduler's lists, and the attention metadata of an eager forward."""

from __future__ import annotations

import torch

from blockdraft.kernels.forward_context import AttentionMetadata
from blockdraft.kernels.host_tensors import host_int64


def slots_for_positions(block_table: list[int], positions: range, block_size: int) -> list[int]:
    return [block_table[p // block_size] * block_size + p % block_size for p in positions]


def decode_slots(block_tables: list[list[int]], positions: list[int], block_size: int) -> list[int]:
    """`flat_slots` of one row a request, at `positions`: without a range a row (a batch that
    drafts nothing keeps its rows' slots every step, on the host of a small target's step)."""
    pairs = zip(block_tables, positions, strict=True)
    return [table[p // block_size] * block_size + p % block_size for table, p in pairs]


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
