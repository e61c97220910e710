"""The context K/V write inside a drafter CUDA graph.

In the steady state every request verifies N drafts and proposes N more: the context rows are
then R * (N+1), as uniform as the block, and their K/V write (fc, norm, k/v projections, RoPE,
store: a dozen launches that bound a small target's step on the host) runs inside the
drafter's CUDA graph, from persistent inputs. Other steps write it eagerly.
"""

from __future__ import annotations

import torch

from blockdraft.kernels.forward_context import PAD_SLOT_ID
from blockdraft.models.dflash_drafter import DFlashDrafter


class GraphedContext:
    """Persistent inputs of the context K/V write that a drafter graph captures before the
    block forward: one context row per block row (a uniform verify step's committed rows sit in
    its 1+N rows per request, PAD where rejected). Slots stay PAD unless loaded for the replay
    at hand: a replay must never rewrite stale rows into slots that may belong to other
    requests by now."""

    def __init__(self, drafter: DFlashDrafter, max_rows: int, device: torch.device) -> None:
        self.drafter = drafter
        fc = drafter.fc.weight  # [hidden, K * hidden]
        self.features = torch.zeros(max_rows, fc.shape[1], dtype=fc.dtype, device=device)
        self.positions = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_rows,), PAD_SLOT_ID, dtype=torch.int64, device=device)

    def forward(
        self,
        input_ids: torch.Tensor,  # [rows] int64, the blocks
        positions: torch.Tensor,  # [rows] int64
    ) -> torch.Tensor:  # [rows, hidden]
        """What the graph captures: the context rows' K/V write, then the block forward."""
        rows = input_ids.shape[0]
        self.drafter.write_context(
            self.features[:rows], self.positions[:rows], self.slot_mapping[:rows]
        )
        return self.drafter(input_ids, positions)

    def load(
        self,
        features: torch.Tensor,  # [rows, K * hidden]
        positions: torch.Tensor,  # [rows] int64
        slot_mapping: torch.Tensor,  # [rows] int64, PAD where not committed
    ) -> None:
        rows = features.shape[0]
        self.features[:rows].copy_(features)
        self.positions[:rows].copy_(positions)
        self.slot_mapping[:rows].copy_(slot_mapping)
        self.slot_mapping[rows:].fill_(PAD_SLOT_ID)

    def clear(self) -> None:
        self.slot_mapping.fill_(PAD_SLOT_ID)
