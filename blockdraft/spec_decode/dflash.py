"""DFlash speculator: writes context K/V for committed tokens and drafts the next block.

Per step, after the target has run and its tokens are committed:
1. `write_context`: the target features of every committed row (prompt chunks, and the anchor
   plus accepted drafts of each verify) go through fc/hidden_norm and each draft layer's k/v
   projection into the drafter's paged cache, at the rows' own positions. Rejected rows write
   nothing.
2. `propose`: for each request that has a new anchor, the block [anchor, MASK x N] at positions
   p .. p+N runs through the drafter in one forward; its rows 1..N give N draft tokens.

The drafter cache shares the target's block tables: a position's drafter K/V sits in the same
slot as its target K/V, so prefix caching, preemption and freeing need no extra bookkeeping.
"""

from __future__ import annotations

import torch

from blockdraft.kernels.forward_context import (
    build_attention_metadata,
    forward_context,
    slots_for_positions,
)
from blockdraft.layers.sampler import SamplingTensors
from blockdraft.models.dflash import DFlashDrafter
from blockdraft.spec_decode.rejection_sampler import sample_drafts


class DFlashProposer:
    def __init__(self, drafter: DFlashDrafter, num_speculative_tokens: int, block_size: int):
        self.drafter = drafter
        self.num_spec = num_speculative_tokens
        self.block_size = block_size
        self.device = next(drafter.parameters()).device

    def write_context(
        self,
        features: torch.Tensor,  # [num_tokens, K * hidden], this step's target features
        rows: list[int],  # committed rows of this step's flat batch
        positions: list[int],  # their positions
        slots: list[int],  # their KV slots
    ) -> None:
        if not rows:
            return
        index = torch.tensor(rows, dtype=torch.int64, device=self.device)
        self.drafter.write_context(
            features.index_select(0, index),
            torch.tensor(positions, dtype=torch.int64, device=self.device),
            torch.tensor(slots, dtype=torch.int64, device=self.device),
        )

    def propose(
        self,
        anchors: list[int],  # last committed (bonus) token of each request
        anchor_positions: list[int],
        block_tables: list[list[int]],
        st: SamplingTensors,  # one row per request, position = anchor position + 1
    ) -> tuple[list[list[int]], torch.Tensor | None]:
        """Returns N draft tokens per request, and their probabilities [R, N, V] when any
        request samples (None when all are greedy)."""
        n, q = self.num_spec, self.num_spec + 1
        mask_id = self.drafter.cfg.mask_token_id
        input_ids = torch.tensor(
            [tok for a in anchors for tok in [a] + [mask_id] * n],
            dtype=torch.int64,
            device=self.device,
        )
        positions = torch.tensor(
            [p + i for p in anchor_positions for i in range(q)],
            dtype=torch.int64,
            device=self.device,
        )
        meta = build_attention_metadata(
            block_tables, anchor_positions, [q] * len(anchors), self.block_size, self.device
        )
        with forward_context(meta):
            hidden = self.drafter(input_ids, positions)  # [R * q, hidden]
        draft_hidden = hidden.view(len(anchors), q, -1)[:, 1:]  # [R, N, hidden]
        logits = self.drafter.compute_logits(draft_hidden.flatten(0, 1)).view(len(anchors), n, -1)
        tokens, probs = sample_drafts(logits, st)
        return tokens.tolist(), probs


def block_slots(block_table: list[int], start: int, count: int, block_size: int) -> list[int]:
    return slots_for_positions(block_table, range(start, start + count), block_size)
