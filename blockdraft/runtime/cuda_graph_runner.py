"""CUDA graphs for uniform steps: every request computes the same number of rows (1 for a
decode, 1+N for a verify or a drafter block). One graph per padded batch size; inputs are
copied into persistent buffers at fixed addresses, padded requests point at the PAD slot and
read only their own first keys, so a replay never depends on stale rows.

Attention runs over a fixed key span (max_model_len + lookahead) with keys past each sequence
masked, so one graph serves every context length."""

from __future__ import annotations

from collections.abc import Callable

import torch

from blockdraft.kernels.forward_context import (
    PAD_SLOT_ID,
    AttentionMetadata,
    build_linear_metadata,
    forward_context,
)
from blockdraft.runtime.feature_ring import FeatureRing

ForwardFn = Callable[[torch.Tensor, torch.Tensor], object]

# The layers after which a target forward's capture starts a new graph: segments of 1, 3, 12
# layers, then the rest. The GPU waits while the host launches a graph (a Qwen3.5-27B step's
# ~740 nodes: ~0.67 ms idle on an H200); in segments it runs each one while the host launches
# the next (on large models a layer's launch is far shorter than its run).
SEGMENT_AFTER_LAYERS = (0, 3, 15)


class SegmentedGraph:
    """One forward captured as a chain of CUDA graphs that share a memory pool, cut after the
    decoder layers in `after_layers` (`AttentionMetadata.after_layer` calls `cut`); `replay`
    launches them in capture order, the order a shared pool needs."""

    def __init__(self, pool: object | None, after_layers: tuple[int, ...]) -> None:
        self.pool = torch.cuda.graph_pool_handle() if pool is None else pool
        self.after_layers = frozenset(after_layers)
        self.graphs: list[torch.cuda.CUDAGraph] = []

    def __enter__(self) -> SegmentedGraph:
        torch.cuda.synchronize()
        self._stream = torch.cuda.stream(torch.cuda.Stream())  # captures need a side stream
        self._stream.__enter__()
        self._begin()
        return self

    def _begin(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.pool)
        self.graphs.append(graph)

    def cut(self, layer: int) -> None:
        if layer in self.after_layers:
            self.graphs[-1].capture_end()
            self._begin()

    def __exit__(self, *exc: object) -> None:
        try:
            self.graphs[-1].capture_end()
        finally:
            self._stream.__exit__(*exc)

    def replay(self) -> None:
        for graph in self.graphs:
            graph.replay()


class EagerGraph:
    """The CPU twin of a captured CUDA graph: `replay` re-runs the forward on the persistent
    buffers and writes into the outputs returned at capture, exactly where a graph replay would
    leave them. Tests use it to check the buffer handling without a GPU."""

    def __init__(self, forward: Callable[[], object]) -> None:
        self.forward = forward
        self.out = forward()

    @torch.inference_mode()
    def replay(self) -> None:
        new = self.forward()
        pairs = zip(self.out, new, strict=True) if isinstance(new, tuple) else [(self.out, new)]
        for dst, src in pairs:
            if dst is not None:
                dst.copy_(src)


class CUDAGraphRunner:
    """The graphs of one forward (the target's or the drafter's) at one query length, one per
    batch bucket, and their persistent input buffers."""

    def __init__(
        self,
        forward: ForwardFn,
        query_len: int,
        batch_sizes: list[int],
        max_blocks_per_seq: int,
        block_size: int,
        device: torch.device,
        pool: object | None = None,
        linear_state: bool = False,  # a hybrid target: its requests' state slots are inputs
        feature_ring: FeatureRing | None = None,  # keeps each replay's features (decode graphs)
    ) -> None:
        self.feature_ring = feature_ring
        if feature_ring is not None:
            forward = feature_ring.tapped(forward)
        self.forward, self.query_len, self.block_size = forward, query_len, block_size
        self.batch_sizes = sorted(batch_sizes)
        self.max_blocks = max_blocks_per_seq
        max_rows = self.batch_sizes[-1] * query_len
        i64 = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(max_rows, **i64)  # [max_rows]
        self.positions = torch.zeros(max_rows, **i64)
        self.slot_mapping = torch.full((max_rows,), PAD_SLOT_ID, **i64)
        self.seq_lens = torch.full((self.batch_sizes[-1],), query_len, **i64)
        self.block_tables = torch.zeros(self.batch_sizes[-1], max_blocks_per_seq, **i64)
        self.query_start_loc = torch.arange(self.batch_sizes[-1] + 1, **i64) * query_len
        # Positions of padded requests (0 .. q-1 each), made once instead of on every replay.
        self.pad_positions = torch.arange(query_len, **i64).repeat(self.batch_sizes[-1])
        self.pool = pool
        self.graphs: dict[int, tuple[SegmentedGraph | EagerGraph, object]] = {}
        # Hybrid targets: each request's state slot and whether it starts fresh (padded
        # requests use the spare last slot). A graph of one-row steps decodes, one of more
        # rows verifies (its states are committed after it, outside the graph).
        self.linear_state = linear_state
        self.state_slots = torch.full((self.batch_sizes[-1],), -1, **i64)
        self.fresh = torch.zeros(self.batch_sizes[-1], dtype=torch.bool, device=device)
        self.captured_meta: dict[int, AttentionMetadata] = {}

    def _meta(self, batch: int) -> AttentionMetadata:
        """The forward's metadata over the persistent buffers; built before a capture (the
        linear layers' index tensors are copied from the host)."""
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[: batch * self.query_len],
            query_start_loc=self.query_start_loc[: batch + 1],
            seq_lens=self.seq_lens[:batch],
            block_tables=self.block_tables[:batch],
            max_query_len=self.query_len,
            max_seq_len=self.max_blocks * self.block_size,
            block_size=self.block_size,
            uniform_query_len=True,
        )
        if self.linear_state:
            q = self.query_len
            meta.linear = build_linear_metadata(
                self.state_slots[:batch], self.fresh[:batch], [q] * batch, [q > 1] * batch
            )
        return meta

    @torch.inference_mode()
    def capture(self) -> None:
        for batch in reversed(self.batch_sizes):  # largest first, so smaller ones reuse its pool
            rows = batch * self.query_len
            args = (self.input_ids[:rows], self.positions[:rows])
            if self.input_ids.device.type != "cuda":
                twin = EagerGraph(lambda b=batch, a=args: self._eager(b, a))
                self.graphs[batch] = (twin, twin.out)
                continue
            self._eager(batch, args)  # warm-up outside the graph (lazy init, autotuning)
            meta = self._meta(batch)
            graph = SegmentedGraph(self.pool, SEGMENT_AFTER_LAYERS)
            meta.after_layer = graph.cut
            with graph, forward_context(meta):
                out = self.forward(*args)
            meta.after_layer = None
            self.pool = graph.pool
            self.graphs[batch] = (graph, out)
            # Kept alive: the graph reads the metadata's index tensors (a hybrid target's step
            # batch, built outside the capture) at their captured addresses on every replay.
            self.captured_meta[batch] = meta
        if self.feature_ring is not None:  # the warm-up runs (and twins' first runs) tapped it
            self.feature_ring.reset()

    def _eager(self, batch: int, args: tuple[torch.Tensor, torch.Tensor]) -> object:
        with forward_context(self._meta(batch)):
            return self.forward(*args)

    def fits(self, num_seqs: int, max_blocks: int) -> bool:
        return num_seqs <= self.batch_sizes[-1] and max_blocks <= self.max_blocks

    def run(
        self,
        input_ids: torch.Tensor,  # [R * q] int64 (host or device)
        positions: torch.Tensor,  # [R * q] int64 (host or device)
        slot_mapping: torch.Tensor,  # [R * q] int64 (host or device)
        seq_lens: torch.Tensor,  # [R] int64 (host or device)
        block_tables: torch.Tensor,  # [R, <= max_blocks] int64 (host or device)
        device_ids: tuple[torch.Tensor, torch.Tensor] | None = None,  # rows [D], ids [D] int64
        states: tuple[torch.Tensor, torch.Tensor] | None = None,  # slots [R] int64, fresh [R]
    ) -> object:
        """Inputs come from the host (the target's steps: one transfer each) or were built on
        the device (the drafter's, from the target step's results: copied there, with no
        host round trip). `device_ids` are input ids only the device holds (a verify's
        drafts): written over those rows of the input buffer there, after the other ids."""
        num_seqs = seq_lens.shape[0]
        batch = next(b for b in self.batch_sizes if b >= num_seqs)
        rows, pad_rows = num_seqs * self.query_len, batch * self.query_len
        self.input_ids[:rows].copy_(input_ids, non_blocking=True)
        if device_ids is not None:
            self.input_ids.index_copy_(0, *device_ids)
        self.positions[:rows].copy_(positions, non_blocking=True)
        self.slot_mapping[:rows].copy_(slot_mapping, non_blocking=True)
        self.seq_lens[:num_seqs].copy_(seq_lens, non_blocking=True)
        self.block_tables[:num_seqs, : block_tables.shape[1]].copy_(block_tables, non_blocking=True)
        if states is not None:
            self.state_slots[:num_seqs].copy_(states[0], non_blocking=True)
            self.fresh[:num_seqs].copy_(states[1], non_blocking=True)
        if pad_rows > rows:  # padded requests: write to the PAD slot, see only their own rows
            self.slot_mapping[rows:pad_rows].fill_(PAD_SLOT_ID)
            self.seq_lens[num_seqs:batch].fill_(self.query_len)
            self.positions[rows:pad_rows].copy_(self.pad_positions[: pad_rows - rows])
            self.state_slots[num_seqs:batch].fill_(-1)
            self.fresh[num_seqs:batch].fill_(False)
        graph, out = self.graphs[batch]
        graph.replay()
        if self.feature_ring is not None:
            self.feature_ring.replayed(batch)
        return out
