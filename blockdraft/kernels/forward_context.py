"""Per-step attention metadata, set once per forward and read by every attention layer.

It lives at the bottom of the import graph (next to the kernels) so that layers never import
the engine: the runner builds an `AttentionMetadata`, enters `forward_context(meta)`, and runs
the model.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

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


@contextmanager
def forward_context(meta: AttentionMetadata | None) -> Iterator[None]:
    global _current
    previous, _current = _current, meta
    try:
        yield
    finally:
        _current = previous


def current_attention_metadata() -> AttentionMetadata | None:
    """The forward's metadata, or None outside any forward (kernels that only tune on it)."""
    return _current


def get_attention_metadata() -> AttentionMetadata:
    if _current is None:
        raise RuntimeError("attention layer called outside forward_context()")
    return _current
