"""Builds the DFlash drafter's per-step inputs on the device, with no host round trip.

After the target's forward and the verification of a step (before anything is read back),
each of the step's C requests (its scheduled chunks, in flat-batch order) has
- `num_ctx[c]` committed rows in the flat target batch, starting at flat row
  `ctx_row_start[c]`: the rows whose target features become drafter context (a whole prefill
  chunk, a verify's anchor plus its accepted drafts, a decode's one row). They sit at the
  positions right before `anchor_positions[c]`: `anchor_positions[c] - num_ctx[c] ..
  anchor_positions[c] - 1`;
- for the R requests listed in `proposers` (those whose chunk completes, so they have a new
  token to draft from), an anchor: that new token `anchor_tokens[c]` (the bonus / corrected
  token of a verify, or the token sampled after a decode or a last prefill chunk), at position
  `anchor_positions[c]`. A request not listed (mid-prefill) only writes context: it gets no
  query block, since the block past its allocated blocks would land in wrong slots.

The drafter then needs (R_pad >= R drafting requests, so shapes stay fixed for CUDA graphs;
Q = N + 1):
- the query block `[anchor, MASK x N]` of each drafting request at positions p .. p + N, with
  the slots those positions occupy (the drafter cache shares the target's block tables);
- attention metadata for that block: query_start_loc and seq_lens (keys 0 .. p + N);
- context positions and slots for the committed rows, in a buffer indexed by flat target row,
  so the target's feature tensor feeds `write_context` without an index_select: every other
  row (rejected drafts, rows past the batch) gets PAD_SLOT_ID and writes nothing.

Padded requests r in [R, R_pad) are inert dummies that keep every launch's shape fixed: input
ids MASK, positions 0 .. N, PAD slots (they write nothing), seq_lens N + 1. They read keys
through their block-table row, so the caller must give them a row of valid block ids
(zeros will do); their outputs are to be ignored.

`prepare_dflash_inputs_torch` is the specification; `prepare_dflash_inputs` (in
`triton_dflash_inputs`) is the one-kernel Triton version. The two live apart because importing
triton early would fix TRITON_INTERPRET before `select` reads it (and triton may be missing).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockdraft.kernels.forward_context import PAD_SLOT_ID


@dataclass
class DFlashInputs:
    """Drafter inputs for one step. Q = num_spec + 1 rows per (padded) drafting request."""

    input_ids: torch.Tensor  # [R_pad * Q] int64: anchor, then MASK x N
    positions: torch.Tensor  # [R_pad * Q] int64
    slot_mapping: torch.Tensor  # [R_pad * Q] int64, PAD for padded requests
    query_start_loc: torch.Tensor  # [R_pad + 1] int64: r * Q
    seq_lens: torch.Tensor  # [R_pad] int64: anchor position + Q (padded: Q)
    context_positions: torch.Tensor  # [num_ctx_rows] int64, 0 where not committed
    context_slot_mapping: torch.Tensor  # [num_ctx_rows] int64, PAD where not committed

    @classmethod
    def empty(
        cls, num_reqs_padded: int, num_spec: int, num_ctx_rows: int, device: torch.device
    ) -> DFlashInputs:
        """Buffers to fill in place (their contents are overwritten entirely)."""
        q = num_spec + 1

        def buf(n: int) -> torch.Tensor:
            return torch.empty(n, dtype=torch.int64, device=device)

        return cls(
            input_ids=buf(num_reqs_padded * q),
            positions=buf(num_reqs_padded * q),
            slot_mapping=buf(num_reqs_padded * q),
            query_start_loc=buf(num_reqs_padded + 1),
            seq_lens=buf(num_reqs_padded),
            context_positions=buf(num_ctx_rows),
            context_slot_mapping=buf(num_ctx_rows),
        )


def _slots(
    block_tables: torch.Tensor,  # [>= C, max_blocks] int
    req: torch.Tensor,  # [...] int64 request of each position
    pos: torch.Tensor,  # [...] int64
    block_size: int,
) -> torch.Tensor:  # [...] int64
    # The column is clamped so that a position past the table (a caller bug, or a row that
    # is masked out anyway) never reads out of bounds.
    col = (pos // block_size).clamp(max=block_tables.shape[1] - 1)
    return block_tables[req, col].to(torch.int64) * block_size + pos % block_size


def prepare_dflash_inputs_torch(
    anchor_tokens: torch.Tensor,  # [C] int64, new token of each request (read for proposers)
    anchor_positions: torch.Tensor,  # [C] int64, position right after its committed rows
    ctx_row_start: torch.Tensor,  # [C] int64, flat target row of the first committed row
    num_ctx: torch.Tensor,  # [C] int64, committed rows (>= 0); spans must not overlap and
    # must ascend: ctx_row_start[c] + num_ctx[c] <= ctx_row_start[c + 1]
    proposers: torch.Tensor,  # [R] int64, the requests that draft (indices into C)
    block_tables: torch.Tensor,  # [>= C, max_blocks] int
    block_size: int,
    num_spec: int,
    mask_token_id: int,
    num_reqs_padded: int,  # >= R
    num_ctx_rows: int,  # context buffer length, >= every ctx_row_start + num_ctx
    out: DFlashInputs | None = None,
) -> DFlashInputs:
    num_reqs, num_props = anchor_tokens.shape[0], proposers.shape[0]
    if num_props > num_reqs_padded:
        raise ValueError(f"{num_props} requests do not fit in {num_reqs_padded} padded ones")
    device = anchor_tokens.device
    q = num_spec + 1
    if out is None:
        out = DFlashInputs.empty(num_reqs_padded, num_spec, num_ctx_rows, device)
    i64 = dict(dtype=torch.int64, device=device)
    real = torch.arange(num_reqs_padded, **i64) < num_props  # [R_pad]
    offs = torch.arange(q, **i64)  # [Q]

    def per_proposer(values: torch.Tensor, pad: int) -> torch.Tensor:  # [C] -> [R_pad]
        padded = torch.full((num_reqs_padded,), pad, **i64)
        padded[:num_props] = values[proposers]
        return padded

    anchor_pos = per_proposer(anchor_positions.to(torch.int64), 0)  # [R_pad]
    positions = anchor_pos[:, None] + offs[None, :]  # [R_pad, Q]
    input_ids = torch.full((num_reqs_padded, q), mask_token_id, **i64)
    input_ids[:num_props, 0] = anchor_tokens[proposers]
    slots = torch.full((num_reqs_padded, q), PAD_SLOT_ID, **i64)
    if num_props:
        req = per_proposer(torch.arange(num_reqs, **i64), 0)  # [R_pad] request of each block
        slots = torch.where(
            real[:, None], _slots(block_tables, req[:, None], positions, block_size), slots
        )
    out.input_ids.copy_(input_ids.flatten())
    out.positions.copy_(positions.flatten())
    out.slot_mapping.copy_(slots.flatten())
    out.query_start_loc.copy_(torch.arange(num_reqs_padded + 1, **i64) * q)
    out.seq_lens.copy_(anchor_pos + q)

    # Context: the owner of flat row t is the last request starting at or before t; the row
    # is committed when it also lies inside that request's span.
    rows = torch.arange(num_ctx_rows, **i64)  # [num_ctx_rows]
    ctx_pos = torch.zeros(num_ctx_rows, **i64)
    ctx_slot = torch.full((num_ctx_rows,), PAD_SLOT_ID, **i64)
    if num_reqs:
        starts = ctx_row_start.to(torch.int64)
        owner = (torch.searchsorted(starts, rows, right=True) - 1).clamp(min=0)
        j = rows - starts[owner]
        committed = (j >= 0) & (j < num_ctx[owner])
        pos = anchor_positions[owner] - num_ctx[owner] + j
        ctx_pos = torch.where(committed, pos, ctx_pos)
        ctx_slot = torch.where(
            committed, _slots(block_tables, owner, pos.clamp(min=0), block_size), ctx_slot
        )
    out.context_positions.copy_(ctx_pos)
    out.context_slot_mapping.copy_(ctx_slot)
    return out
