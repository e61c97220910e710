"""Per-step attention metadata, set once per forward and read by every attention layer, and
the kernel policy the kernels launched meanwhile follow.

It lives at the bottom of the import graph (next to the kernels) so that layers never import
the engine: the runner builds an `AttentionMetadata`, enters `forward_context(meta)`, and runs
the model; the engine enters its `KernelPolicy` (`use_kernel_policy`) around its forwards and
the sampling between them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from blockdraft.kernels.policy import KernelPolicy

PAD_SLOT_ID = -1


@dataclass
class AttentionMetadata:
    """Flat batch of sequences; each contributes `query_lens[i]` query rows that sit at the end
    of its `seq_lens[i]` keys (positions `seq_lens[i] - query_lens[i] .. seq_lens[i] - 1`)."""

    slot_mapping: torch.Tensor  # [num_tokens] int64, PAD_SLOT_ID rows write nothing
    query_start_loc: torch.Tensor  # [num_seqs + 1] int64
    seq_lens: torch.Tensor  # [num_seqs] int64, keys visible to each sequence after this step
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int64
    max_query_len: int
    max_seq_len: int  # an upper bound is fine: keys past seq_lens are masked
    block_size: int
    # Every sequence has exactly max_query_len query rows (decode, verify, drafter blocks):
    # the query layout is then static, which CUDA graphs need.
    uniform_query_len: bool = False
    # Masks and gather indices derived from the fields above, built once per step on first use
    # and shared by all layers with the same (causal, window).
    cache: dict = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


_current: AttentionMetadata | None = None
_policy = KernelPolicy()  # outside any use_kernel_policy: the defaults


@contextmanager
def forward_context(
    meta: AttentionMetadata | None, policy: KernelPolicy | None = None
) -> Iterator[None]:
    """A forward over `meta`, under `policy` (None: the active one)."""
    global _current
    previous, _current = _current, meta
    try:
        if policy is None:
            yield
        else:
            with use_kernel_policy(policy):
                yield
    finally:
        _current = previous


@contextmanager
def use_kernel_policy(policy: KernelPolicy) -> Iterator[None]:
    """Kernels launched inside follow `policy`: the engine's forwards and sampling, training,
    tests."""
    global _policy
    if not isinstance(policy, KernelPolicy):
        raise TypeError(f"expected a KernelPolicy, got {type(policy).__name__}")
    previous, _policy = _policy, policy
    try:
        yield
    finally:
        _policy = previous


def current_kernel_policy() -> KernelPolicy:
    """The active policy: the innermost `use_kernel_policy`'s, else `KernelPolicy()`."""
    return _policy


def current_attention_metadata() -> AttentionMetadata | None:
    """The forward's metadata, or None outside any forward (kernels that only tune on it)."""
    return _current


def get_attention_metadata() -> AttentionMetadata:
    if _current is None:
        raise RuntimeError("attention layer called outside forward_context()")
    return _current


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
