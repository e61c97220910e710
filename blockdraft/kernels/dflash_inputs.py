"""Builds the DFlash drafter's per-step inputs on the device, with no host round trip.

After the target's forward and the verification of a step, each of the R requests that will
draft next has
- an anchor: its last committed token (the bonus / corrected token of a verify, or the token
  sampled after a completed prefill), at position `anchor_positions[r]`, and
- `num_ctx[r]` committed rows in this step's flat target batch, starting at flat row
  `ctx_row_start[r]`: the rows whose target features become drafter context. They are the
  positions right before the anchor, `anchor_positions[r] - num_ctx[r] ..
  anchor_positions[r] - 1` (a prefill chunk, or a verify's anchor plus its accepted drafts).

The drafter then needs (R_pad >= R requests, so shapes stay fixed for CUDA graphs; Q = N + 1):
- the query block `[anchor, MASK x N]` of each request at positions p .. p + N, with the
  slots those positions occupy (the drafter cache shares the target's block tables);
- attention metadata for that block: query_start_loc and seq_lens (keys 0 .. p + N);
- context positions and slots for the committed rows, in a buffer indexed by flat target row,
  so the target's feature tensor feeds `write_context` without an index_select: every other
  row (rejected drafts, requests not drafting, rows past the batch) gets PAD_SLOT_ID and
  writes nothing;
- the flat indices of the N mask rows of each request, where draft logits are read.

Padded requests r in [R, R_pad) are inert dummies that keep every launch's shape fixed: input
ids MASK, positions 0 .. N, PAD slots (they write nothing), seq_lens N + 1. They read keys
through their block-table row, so the caller must give them a row of valid block ids
(zeros will do); their outputs are to be ignored.

`prepare_dflash_inputs_torch` is the specification; `prepare_dflash_inputs` is the one-kernel
Triton version.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from blockdraft.kernels.forward_context import PAD_SLOT_ID


@dataclass
class DFlashInputs:
    """Drafter inputs for one step. Q = num_spec + 1 rows per (padded) request."""

    input_ids: torch.Tensor  # [R_pad * Q] int64: anchor, then MASK x N
    positions: torch.Tensor  # [R_pad * Q] int64
    slot_mapping: torch.Tensor  # [R_pad * Q] int64, PAD for padded requests
    query_start_loc: torch.Tensor  # [R_pad + 1] int64: r * Q
    seq_lens: torch.Tensor  # [R_pad] int64: anchor position + Q (padded: Q)
    context_positions: torch.Tensor  # [num_ctx_rows] int64, 0 where not committed
    context_slot_mapping: torch.Tensor  # [num_ctx_rows] int64, PAD where not committed
    sample_indices: torch.Tensor  # [R_pad * N] int64: r * Q + 1 + i, row of draft i of r

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
            sample_indices=buf(num_reqs_padded * num_spec),
        )


def _slots(
    block_tables: torch.Tensor,  # [>= R, max_blocks] int
    req: torch.Tensor,  # [...] int64 request of each position
    pos: torch.Tensor,  # [...] int64
    block_size: int,
) -> torch.Tensor:  # [...] int64
    # The column is clamped so that a position past the table (a caller bug, or a row that
    # is masked out anyway) never reads out of bounds.
    col = (pos // block_size).clamp(max=block_tables.shape[1] - 1)
    return block_tables[req, col].to(torch.int64) * block_size + pos % block_size


def prepare_dflash_inputs_torch(
    anchor_tokens: torch.Tensor,  # [R] int64, last committed token of each request
    anchor_positions: torch.Tensor,  # [R] int64, its position
    ctx_row_start: torch.Tensor,  # [R] int64, flat target row of the first committed row
    num_ctx: torch.Tensor,  # [R] int64, committed rows (>= 0); spans must not overlap and
    # must ascend: ctx_row_start[r] + num_ctx[r] <= ctx_row_start[r + 1]
    block_tables: torch.Tensor,  # [>= R, max_blocks] int
    block_size: int,
    num_spec: int,
    mask_token_id: int,
    num_reqs_padded: int,
    num_ctx_rows: int,  # context buffer length, >= every ctx_row_start + num_ctx
    out: DFlashInputs | None = None,
) -> DFlashInputs:
    num_reqs = anchor_tokens.shape[0]
    if num_reqs > num_reqs_padded:
        raise ValueError(f"{num_reqs} requests do not fit in {num_reqs_padded} padded ones")
    device = anchor_tokens.device
    n, q = num_spec, num_spec + 1
    if out is None:
        out = DFlashInputs.empty(num_reqs_padded, num_spec, num_ctx_rows, device)
    i64 = dict(dtype=torch.int64, device=device)
    real = torch.arange(num_reqs_padded, **i64) < num_reqs  # [R_pad]
    req = torch.arange(num_reqs_padded, **i64).clamp(max=max(num_reqs - 1, 0))  # [R_pad]
    offs = torch.arange(q, **i64)  # [Q]

    def per_req(values: torch.Tensor, pad: int) -> torch.Tensor:  # [R] -> [R_pad]
        padded = torch.full((num_reqs_padded,), pad, **i64)
        padded[:num_reqs] = values
        return padded

    anchor_pos = per_req(anchor_positions.to(torch.int64), 0)  # [R_pad]
    positions = anchor_pos[:, None] + offs[None, :]  # [R_pad, Q]
    input_ids = torch.full((num_reqs_padded, q), mask_token_id, **i64)
    input_ids[:num_reqs, 0] = anchor_tokens
    slots = torch.full((num_reqs_padded, q), PAD_SLOT_ID, **i64)
    if num_reqs:
        slots = torch.where(
            real[:, None], _slots(block_tables, req[:, None], positions, block_size), slots
        )
    out.input_ids.copy_(input_ids.flatten())
    out.positions.copy_(positions.flatten())
    out.slot_mapping.copy_(slots.flatten())
    out.query_start_loc.copy_(torch.arange(num_reqs_padded + 1, **i64) * q)
    out.seq_lens.copy_(anchor_pos + q)
    out.sample_indices.copy_(
        (torch.arange(num_reqs_padded, **i64)[:, None] * q + 1 + torch.arange(n, **i64)).flatten()
    )

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


@triton.jit
def _prepare_dflash_inputs_kernel(
    anchor_tokens_ptr,  # [R] int
    anchor_positions_ptr,  # [R] int
    ctx_row_start_ptr,  # [R] int, ascending
    num_ctx_ptr,  # [R] int
    block_tables_ptr,  # [>= R, max_blocks] int
    input_ids_ptr,  # [R_pad * Q] int64
    positions_ptr,  # [R_pad * Q] int64
    slot_mapping_ptr,  # [R_pad * Q] int64
    query_start_loc_ptr,  # [R_pad + 1] int64
    seq_lens_ptr,  # [R_pad] int64
    context_positions_ptr,  # [num_ctx_rows] int64
    context_slot_mapping_ptr,  # [num_ctx_rows] int64
    sample_indices_ptr,  # [R_pad * N] int64
    num_reqs,
    num_reqs_padded,
    num_ctx_rows,
    stride_bt,
    max_blocks,
    block_size,
    mask_token_id,
    NUM_SPEC: tl.constexpr,
    PAD_SLOT: tl.constexpr,
    BLOCK_R: tl.constexpr,  # requests per program
    BLOCK_Q: tl.constexpr,  # >= NUM_SPEC + 1
    BLOCK_CTX: tl.constexpr,  # context rows per program
    SEARCH_STEPS: tl.constexpr,  # >= log2(R + 1): binary-search depth over ctx_row_start
):
    # Each program fills BLOCK_R requests' query block and BLOCK_CTX context rows; the grid
    # covers whichever of the two is larger, so everything is written by exactly one program.
    pid = tl.program_id(0)
    Q: tl.constexpr = NUM_SPEC + 1

    # --- Query block of requests pid * BLOCK_R ...
    req = pid * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    req_in = req < num_reqs_padded
    real = req < num_reqs
    anchor_pos = tl.load(anchor_positions_ptr + req, mask=real, other=0).to(tl.int64)
    anchor_tok = tl.load(anchor_tokens_ptr + req, mask=real, other=mask_token_id).to(tl.int64)
    offs_q = tl.arange(0, BLOCK_Q)  # [BLOCK_Q]
    q_in = req_in[:, None] & (offs_q < Q)[None, :]  # [BLOCK_R, BLOCK_Q]
    pos = anchor_pos[:, None] + offs_q[None, :]  # [BLOCK_R, BLOCK_Q]
    col = tl.minimum(pos // block_size, max_blocks - 1)
    block = tl.load(
        block_tables_ptr + req[:, None].to(tl.int64) * stride_bt + col,
        mask=real[:, None] & q_in,
        other=0,
    ).to(tl.int64)
    slot = tl.where(real[:, None], block * block_size + pos % block_size, PAD_SLOT)
    ids = tl.where(offs_q[None, :] == 0, anchor_tok[:, None], mask_token_id)
    flat = req[:, None].to(tl.int64) * Q + offs_q[None, :]
    tl.store(input_ids_ptr + flat, ids, mask=q_in)
    tl.store(positions_ptr + flat, pos, mask=q_in)
    tl.store(slot_mapping_ptr + flat, slot, mask=q_in)
    # Draft i of request r is read from row r * Q + 1 + i.
    sample = req[:, None].to(tl.int64) * NUM_SPEC + offs_q[None, :] - 1
    tl.store(sample_indices_ptr + sample, flat, mask=q_in & (offs_q[None, :] >= 1))
    tl.store(seq_lens_ptr + req, anchor_pos + Q, mask=req_in)
    tl.store(query_start_loc_ptr + req + 1, (req + 1).to(tl.int64) * Q, mask=req_in)
    if pid == 0:
        tl.store(query_start_loc_ptr, tl.zeros([], dtype=tl.int64))

    # --- Context rows pid * BLOCK_CTX ...
    rows = pid * BLOCK_CTX + tl.arange(0, BLOCK_CTX)  # [BLOCK_CTX]
    rows_in = rows < num_ctx_rows
    # Branchless binary search: owner count = number of requests whose span starts at or
    # before the row (starts ascend), taken in halving steps.
    count = tl.zeros([BLOCK_CTX], dtype=tl.int32)
    for k in tl.static_range(SEARCH_STEPS):
        step = 1 << (SEARCH_STEPS - 1 - k)
        cand = count + step
        start = tl.load(ctx_row_start_ptr + cand - 1, mask=cand <= num_reqs, other=0)
        count = tl.where((cand <= num_reqs) & (start <= rows), cand, count)
    owner = tl.maximum(count - 1, 0)
    has_owner = count > 0
    start = tl.load(ctx_row_start_ptr + owner, mask=has_owner, other=0)
    n_ctx = tl.load(num_ctx_ptr + owner, mask=has_owner, other=0)
    j = rows - start
    committed = has_owner & rows_in & (j < n_ctx)
    ctx_pos = tl.load(anchor_positions_ptr + owner, mask=committed, other=0) - n_ctx + j
    ctx_pos = tl.where(committed, ctx_pos, 0).to(tl.int64)
    ctx_col = tl.minimum(ctx_pos // block_size, max_blocks - 1)
    ctx_block = tl.load(
        block_tables_ptr + owner.to(tl.int64) * stride_bt + ctx_col, mask=committed, other=0
    ).to(tl.int64)
    ctx_slot = tl.where(committed, ctx_block * block_size + ctx_pos % block_size, PAD_SLOT)
    tl.store(context_positions_ptr + rows, ctx_pos, mask=rows_in)
    tl.store(context_slot_mapping_ptr + rows, ctx_slot, mask=rows_in)


def prepare_dflash_inputs(
    anchor_tokens: torch.Tensor,  # [R] int64, last committed token of each request
    anchor_positions: torch.Tensor,  # [R] int64, its position
    ctx_row_start: torch.Tensor,  # [R] int64, flat target row of the first committed row
    num_ctx: torch.Tensor,  # [R] int64, committed rows (>= 0); spans ascend, no overlap
    block_tables: torch.Tensor,  # [>= R, max_blocks] int
    block_size: int,
    num_spec: int,
    mask_token_id: int,
    num_reqs_padded: int,
    num_ctx_rows: int,  # context buffer length, >= every ctx_row_start + num_ctx
    out: DFlashInputs | None = None,
) -> DFlashInputs:
    """Triton twin of `prepare_dflash_inputs_torch` (the specification); one launch."""
    num_reqs = anchor_tokens.shape[0]
    if num_reqs > num_reqs_padded:
        raise ValueError(f"{num_reqs} requests do not fit in {num_reqs_padded} padded ones")
    if out is None:
        out = DFlashInputs.empty(num_reqs_padded, num_spec, num_ctx_rows, anchor_tokens.device)
    block_r, block_ctx = 16, 256
    grid = max(triton.cdiv(num_reqs_padded, block_r), triton.cdiv(num_ctx_rows, block_ctx), 1)
    _prepare_dflash_inputs_kernel[(grid,)](
        anchor_tokens,
        anchor_positions,
        ctx_row_start,
        num_ctx,
        block_tables,
        out.input_ids,
        out.positions,
        out.slot_mapping,
        out.query_start_loc,
        out.seq_lens,
        out.context_positions,
        out.context_slot_mapping,
        out.sample_indices,
        num_reqs,
        num_reqs_padded,
        num_ctx_rows,
        block_tables.stride(0),
        block_tables.shape[1],
        block_size,
        mask_token_id,
        NUM_SPEC=num_spec,
        PAD_SLOT=PAD_SLOT_ID,
        BLOCK_R=block_r,
        BLOCK_Q=triton.next_power_of_2(num_spec + 1),
        BLOCK_CTX=block_ctx,
        # 2**steps - 1 >= R_pad >= R; from the padded count, so the kernel compiles once per
        # CUDA-graph size bucket rather than once per request count.
        SEARCH_STEPS=max(1, num_reqs_padded.bit_length()),
        num_warps=4,
    )
    return out
