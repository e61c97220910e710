"""Drafts between the step that proposes them and the verify that checks them: they stay on
the device, and each request holds its row of the propose step's batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftBatch:
    """One propose step's drafts, left on the device; each proposed request holds its row."""

    tokens: torch.Tensor  # [R, N] int64
    probs: torch.Tensor | None  # [R, N, V] float32; None when every request was greedy


@dataclass(frozen=True)
class PendingDrafts:
    batch: DraftBatch
    row: int
