"""DFlash speculator: writes context K/V for committed tokens and drafts the next block.

Per step, after the target has run and its tokens are committed:
1. `write_context`: the target features of every committed row (prompt chunks, and the anchor
   plus accepted drafts of each verify) go through fc/hidden_norm and each draft layer's k/v
   projection into the drafter's paged cache, at the rows' own positions. Rejected rows write
   nothing.
2. `propose`: for each request that has a new anchor, the block [anchor, MASK x N] at positions
   p .. p+N runs through the drafter in one forward; its rows 1..N give N draft tokens. N may
   be below the drafter's block_size - 1 (the engine picks it by batch size): the drafter
   attends within the block it is given, so a shorter block is the same model on fewer masks.

The drafter cache shares the target's block tables: a position's drafter K/V sits in the same
slot as its target K/V, so prefix caching, preemption and freeing need no extra bookkeeping.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from blockdraft.kernels.forward_context import (
    build_attention_metadata,
    forward_context,
    int64_tensors,
)
from blockdraft.layers.sampler import SamplingTensors
from blockdraft.models.dflash import DFlashDrafter
from blockdraft.spec_decode.rejection_sampler import sample_drafts


class DFlashProposer:
    def __init__(
        self,
        drafter: DFlashDrafter,
        block_size: int,
        run_forward: Callable[..., torch.Tensor] | None = None,
    ) -> None:
        self.drafter = drafter
        self.block_size = block_size
        self.device = next(drafter.parameters()).device
        # The engine hands in its forward runner (eager, or a CUDA-graph replay) so that this
        # module stays below the engine in the import graph.
        self.run_forward = run_forward or self._eager_forward

    def _eager_forward(
        self, token_ids: list[list[int]], starts: list[int], block_tables: list[list[int]]
    ) -> torch.Tensor:
        meta = build_attention_metadata(
            block_tables, starts, [len(t) for t in token_ids], self.block_size, self.device
        )
        flat = torch.tensor([t for ids in token_ids for t in ids], device=self.device)
        positions = torch.tensor(
            [s + i for s, ids in zip(starts, token_ids, strict=True) for i in range(len(ids))],
            device=self.device,
        )
        with forward_context(meta):
            return self.drafter(flat, positions)

    def write_context(
        self,
        features: torch.Tensor,  # [num_tokens, K * hidden], this step's target features
        rows: list[int],  # committed rows of this step's flat batch
        positions: list[int],  # their positions
        slots: list[int],  # their KV slots
    ) -> None:
        if not rows:
            return
        index, position, slot_mapping = int64_tensors(self.device, rows, positions, slots)
        self.drafter.write_context(features.index_select(0, index), position, slot_mapping)

    def propose(
        self,
        anchors: list[int],  # last committed (bonus) token of each request
        anchor_positions: list[int],
        block_tables: list[list[int]],
        st: SamplingTensors,  # one row per request, position = anchor position + 1
        num_drafts: int,  # N
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # tokens [R, N] int64, probs [R, N, V]
        """Returns N draft tokens per request, and their probabilities [R, N, V] when any
        request samples (None when all are greedy). Both stay on the device: the next verify
        reads them there, so proposing costs no host readback."""
        n, q = num_drafts, num_drafts + 1
        mask_id = self.drafter.cfg.mask_token_id
        blocks = [[a] + [mask_id] * n for a in anchors]
        hidden = self.run_forward(blocks, anchor_positions, block_tables)  # [R * q, hidden]
        draft_hidden = hidden.view(len(anchors), q, -1)[:, 1:]  # [R, N, hidden]
        logits = self.drafter.compute_logits(draft_hidden.flatten(0, 1)).view(len(anchors), n, -1)
        return sample_drafts(logits, st)
