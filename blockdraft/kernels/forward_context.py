"""Per-step attention metadata, set once per forward and read by every attention layer, and
the kernel policy the kernels launched meanwhile follow.

It lives at the bottom of the import graph (next to the kernels) so that layers never import
the engine: the runner builds an `AttentionMetadata`, enters `forward_context(meta)`, and runs
the model; the engine enters its `KernelPolicy` (`use_kernel_policy`) around its forwards and
the sampling between them.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from blockdraft.kernels.host_tensors import int64_tensors
from blockdraft.kernels.policy import KernelPolicy

PAD_SLOT_ID = -1
T = TypeVar("T")


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
    # Per-request recurrent state of linear-attention layers (hybrid models); None otherwise.
    linear: LinearStateMetadata | None = None
    # Called by the decoder after each of its layers (with the layer's index): a CUDA-graph
    # capture in segments starts its next graph there (`runtime.cuda_graph_runner`).
    after_layer: Callable[[int], None] | None = None

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


@dataclass
class StepBatch:
    """The decode rows and verify blocks of a forward as one padded [S, W] batch for the
    linear-attention recurrence (gather and scatter indices built once per forward)."""

    seqs: torch.Tensor  # [S] int64 their sequences in the forward's batch
    rows: torch.Tensor  # [S, W] int64 flat row of each step; past a sequence's end, its last row
    lengths: torch.Tensor  # [S] int64 rows of each sequence
    write: torch.Tensor  # [S] bool: not a verify block (its state is stored now)
    verify: torch.Tensor | None  # [V] int64 indices (into S) of the verify blocks; None: none
    out_src: torch.Tensor  # [R] int64 flat [S * W] index of each real row's output
    out_dst: torch.Tensor  # [R] int64 its flat row in the forward


@dataclass
class PrefillBatch:
    """The prefill chunks of a forward packed along one token axis, for one call of the conv
    and of the chunked rule over all of them (gather indices built once per forward)."""

    chunks: list[tuple[int, int, int]]  # (sequence, first row, rows) of each of the P chunks
    seqs: torch.Tensor  # [P] int64 their sequences in the forward's batch
    rows: torch.Tensor  # [Np] int64 flat row of each packed token, chunk after chunk
    cu_seqlens: torch.Tensor  # [P + 1] int32: chunk i is packed tokens cu_seqlens[i] .. [i + 1]
    host_cu_seqlens: list[int]  # cu_seqlens on the host
    _windows: dict = field(default_factory=dict, repr=False)  # conv_windows, by `kept`

    def conv_windows(
        self, kept: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # [W], [Np], [P, kept] int64
        """Indices of one causal conv over every chunk's window (its conv state's `kept` rows,
        then its inputs) laid end to end: the W window rows in `cat(conv states [P * kept],
        the forward's rows)`; the conv output row of each packed token (the conv of W rows has
        W - kept outputs; those whose taps straddle two windows are skipped); the window rows
        that are each chunk's new conv state (its window's last `kept`)."""
        if kept not in self._windows:
            num = len(self.chunks)
            window, out, state, offset = [], [], [], 0
            for i, (_, first, n) in enumerate(self.chunks):
                window += [i * kept + j for j in range(kept)]
                window += range(num * kept + first, num * kept + first + n)
                out += range(offset, offset + n)
                state += range(offset + n, offset + n + kept)
                offset += kept + n
            window_t, out_t, state_t = int64_tensors(self.rows.device, window, out, state)
            self._windows[kept] = (window_t, out_t, state_t.view(num, kept))
        return self._windows[kept]


@dataclass
class LinearStateMetadata:
    """Where each sequence of the batch keeps its linear-attention state (conv and recurrent
    state slots beside the paged KV cache) and what the forward does with it. Prefill chunks
    run in one packed call (the chunked rule over variable lengths: `PrefillBatch`); decode
    rows and verify blocks as one `StepBatch`. Verify blocks read their state and leave it as
    it was; their inputs are kept so that the step commits the state at the accepted length."""

    state_slots: torch.Tensor  # [num_seqs] int64 slot of each sequence
    fresh: torch.Tensor  # [num_seqs] bool: starts at position 0 (zero state, slot not read)
    prefill: list[tuple[int, int, int]]  # (sequence, first row, rows) of each prefill chunk
    step: StepBatch | None
    packed: PrefillBatch | None = None  # the prefill chunks packed; None: none


def build_linear_metadata(
    state_slots: torch.Tensor,  # [num_seqs] int64 on the device
    fresh: torch.Tensor,  # [num_seqs] bool on the device
    query_lens: list[int],  # [num_seqs]
    verify: list[bool],  # [num_seqs]: the sequence's rows are a verify block
) -> LinearStateMetadata:
    """A forward's linear-attention metadata: chunks of more than one row that are not verify
    blocks are prefill chunks, the rest one step batch."""
    starts = [sum(query_lens[:i]) for i in range(len(query_lens))]
    prefill = [
        (i, first, n)
        for i, (first, n) in enumerate(zip(starts, query_lens, strict=True))
        if n > 1 and not verify[i]
    ]
    stepped = [i for i, n in enumerate(query_lens) if n == 1 or verify[i]]
    step = None
    if stepped:
        lens = [query_lens[i] for i in stepped]
        width = max(lens)
        rows = [starts[i] + min(t, n - 1) for i, n in zip(stepped, lens, strict=True)
                for t in range(width)]  # fmt: skip
        src = [j * width + t for j, n in enumerate(lens) for t in range(n)]
        dst = [starts[i] + t for i, n in zip(stepped, lens, strict=True) for t in range(n)]
        v_rows = [j for j, i in enumerate(stepped) if verify[i]]
        write = [int(not verify[i]) for i in stepped]
        seqs_t, rows_t, lens_t, write_t, v_rows_t, src_t, dst_t = int64_tensors(
            state_slots.device, stepped, rows, lens, write, v_rows, src, dst
        )
        step = StepBatch(
            seqs_t, rows_t.view(len(stepped), width), lens_t, write_t.bool(),
            v_rows_t if v_rows else None, src_t, dst_t,
        )  # fmt: skip
    packed = None
    if prefill:
        cu = [0, *itertools.accumulate(n for _, _, n in prefill)]
        seqs_t, rows_t, cu_t = int64_tensors(
            state_slots.device,
            [i for i, _, _ in prefill],
            [r for _, first, n in prefill for r in range(first, first + n)],
            cu,
        )
        packed = PrefillBatch(prefill, seqs_t, rows_t, cu_t.to(torch.int32), cu)
    return LinearStateMetadata(state_slots, fresh, prefill, step, packed)


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


def under_kernel_policy(method: Callable[..., T]) -> Callable[..., T]:
    """A method whose kernels follow its object's `kernel_policy` (the engine's config's): its
    forwards, sampling, drafts and graph captures."""

    @functools.wraps(method)
    def wrapper(self: object, *args: object, **kwargs: object) -> T:
        with use_kernel_policy(self.kernel_policy):
            return method(self, *args, **kwargs)

    return wrapper


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
