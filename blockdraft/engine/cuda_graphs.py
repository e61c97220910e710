"""Capture of the uniform steps' CUDA graphs (blockdraft/runtime/cuda_graph_runner.py): decode
at every batch bucket; verify (the target's, held by the model runner) and propose (the
drafter's, held by the proposer) of 1+N rows for each N of the draft schedule, at the buckets of
the batch sizes that use that N; a hybrid target's state commit after a verify at every
bucket. All share one memory pool but the commit's (see capture_graphs). Off CUDA the graphs
are eager twins (tests). A speculative engine's decode graphs also keep their features in the
drafter's feature ring (blockdraft/runtime/feature_ring.py)."""

from __future__ import annotations

import torch

from blockdraft.engine.model_runner import ModelRunner
from blockdraft.runtime.commit_graphs import CommitGraphs
from blockdraft.runtime.cuda_graph_runner import CUDAGraphRunner
from blockdraft.runtime.feature_ring import FeatureRing
from blockdraft.spec_decode.draft_schedule import DraftSchedule
from blockdraft.spec_decode.proposer import DFlashProposer


def default_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4] + list(range(8, 33, 8)) + list(range(48, 513, 16))
    return [b for b in sizes if b < max_num_seqs] + [max_num_seqs]


def capture_graphs(
    runner: ModelRunner,
    proposer: DFlashProposer | None,
    draft_schedule: DraftSchedule | None,
    batch_sizes: list[int],
    max_blocks_per_seq: int,
    feature_ring: FeatureRing | None = None,  # the decode graphs keep their features there
) -> None:
    pool = None

    def capture_target(q: int, sizes: list[int]) -> None:
        nonlocal pool
        graphs = CUDAGraphRunner(
            runner.model, q, sizes, max_blocks_per_seq, runner.block_size, runner.device, pool,
            linear_state=runner.has_linear_state, feature_ring=feature_ring if q == 1 else None,
        )  # fmt: skip
        graphs.capture()
        runner.graphs[q], pool = graphs, graphs.pool

    capture_target(1, batch_sizes)
    if runner.has_linear_state and draft_schedule:
        # A pool of its own: graphs sharing a pool may reuse the scratch memory of those
        # captured before them for their outputs, which is sound only when they replay in
        # capture order. A commit replays between a verify (captured later) and the drafter
        # that reads the verify's features: in the shared pool its scratch overwrote them.
        runner.commit_graphs = CommitGraphs(
            runner.model.commit_verified, batch_sizes, runner.device
        )
        runner.commit_graphs.capture()
    for n in draft_schedule.all_num_drafts if draft_schedule else []:
        if n == 0:  # no drafts: the steps after are plain decodes (graphs[1])
            continue
        sizes = draft_schedule.graph_batch_sizes(n, batch_sizes)
        if not sizes:  # only batches above max_num_seqs would use this N
            continue
        capture_target(n + 1, sizes)
        pool = proposer.capture_graphs(n, sizes, max_blocks_per_seq, pool)
    if runner.device.type == "cuda":
        torch.cuda.synchronize()
