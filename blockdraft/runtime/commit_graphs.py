"""CUDA graphs of a hybrid target's state commit after a verify (`commit_verified(slots,
lengths)`: the recurrence over each verify block's kept rows, in every linear-attention layer),
one per batch bucket. Eagerly it is a few dozen small launches per layer, every speculative
step; replayed it is one. Padded entries commit nothing: the spare slot, length 0. Off CUDA the
graphs are eager twins (tests)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from blockdraft.runtime.cuda_graph_runner import EagerGraph

CommitFn = Callable[[torch.Tensor, torch.Tensor], None]


class CommitGraphs:
    def __init__(
        self,
        commit: CommitFn,
        batch_sizes: list[int],
        device: torch.device,
        pool: object | None = None,
    ) -> None:
        self.commit, self.batch_sizes = commit, sorted(batch_sizes)
        largest = self.batch_sizes[-1]
        self.slots = torch.full((largest,), -1, dtype=torch.int64, device=device)
        self.lengths = torch.zeros(largest, dtype=torch.int64, device=device)
        self.pool = pool
        self.graphs: dict[int, torch.cuda.CUDAGraph | EagerGraph] = {}

    @torch.inference_mode()
    def capture(self) -> None:
        for batch in reversed(self.batch_sizes):  # largest first, so smaller ones reuse its pool
            args = (self.slots[:batch], self.lengths[:batch])
            if self.slots.device.type != "cuda":
                self.graphs[batch] = EagerGraph(lambda a=args: self.commit(*a))
                continue
            self.commit(*args)  # warm-up outside the graph (lazy init, Triton compiles)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.commit(*args)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[batch] = graph

    def run(
        self,
        slots: torch.Tensor,  # [V] int64 slots of the verified requests
        lengths: torch.Tensor,  # [V] int64 rows of each verify block to keep
    ) -> None:
        num = slots.shape[0]
        if num > self.batch_sizes[-1]:
            self.commit(slots, lengths)
            return
        batch = next(b for b in self.batch_sizes if b >= num)
        self.slots[:num].copy_(slots, non_blocking=True)
        self.lengths[:num].copy_(lengths, non_blocking=True)
        self.slots[num:batch].fill_(-1)
        self.lengths[num:batch].fill_(0)
        self.graphs[batch].replay()
