"""The order of a training run's data: which samples and anchors each micro-batch uses
(`BatchSchedule`, a pure function of the seed and the micro-batch index, so that a resumed run
sees the batches of an uninterrupted one) and the cut of the samples to the trained length.
"""

from __future__ import annotations

import torch

from blockdraft.train.blocks import sample_anchors
from blockdraft.train.config import TrainConfig
from blockdraft.train.data import Sample


class BatchSchedule:
    """Which samples and anchors micro-batch m uses: a pure function of (seed, m), so a resumed
    run sees exactly the batches the uninterrupted run would have seen. Each epoch is a fresh
    permutation, and every visit of a sequence draws fresh anchors."""

    def __init__(self, samples: list[Sample], cfg: TrainConfig) -> None:
        self.samples, self.cfg = samples, cfg
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + epoch)
            self._perms = {epoch: torch.randperm(len(self.samples), generator=g)}
        return self._perms[epoch]

    def micro_batch(self, m: int) -> tuple[list[Sample], list[torch.Tensor]]:
        n, bs = len(self.samples), self.cfg.batch_size
        chosen, anchors = [], []
        for i in range(m * bs, (m + 1) * bs):
            epoch, idx = divmod(i, n)
            sample = self.samples[int(self._perm(epoch)[idx])]
            seed = ((self.cfg.seed * 1_000_003 + epoch) * 1_000_033 + idx) % 2**62
            g = torch.Generator().manual_seed(seed)
            chosen.append(sample)
            anchors.append(
                sample_anchors(len(sample.input_ids), sample.loss_start, self.cfg.anchors, g)
            )
        return chosen, anchors


def prepare_samples(samples: list[Sample], max_seq_len: int) -> list[Sample]:
    """Cuts sequences to max_seq_len and drops those left without an anchor."""
    out = []
    for s in samples:
        ids = s.input_ids[:max_seq_len]
        if len(ids) - s.loss_start >= 2:
            out.append(Sample(ids, s.loss_start, s.key))
    return out
