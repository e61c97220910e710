"""One-launch Triton version of `blockdraft.kernels.dflash_inputs.prepare_dflash_inputs_torch`
(the specification, with the layout of the drafter's per-step inputs)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from blockdraft.kernels.dflash_inputs import DFlashInputs
from blockdraft.kernels.forward_context import PAD_SLOT_ID
from blockdraft.kernels.triton_jit_options import unspecialised

# The counts and the block-table width change from step to step: not specialised (Triton would
# compile values of 1 and multiples of 16 apart, i.e. a compile in the middle of serving). Nor
# are the inputs' addresses: `host_tensors` starts each view 16-byte aligned, but a caller may
# pass any slice (once a view's alignment followed the batch's make-up: a compile at concurrency
# 32 on the H200), and the kernel reads them element by element, so alignment buys it nothing.
_RUNTIME_SIZES = ["num_reqs", "num_props", "num_reqs_padded", "num_ctx_rows", "stride_bt",
                  "max_blocks"]  # fmt: skip
_INPUT_POINTERS = ["anchor_tokens_ptr", "anchor_positions_ptr", "ctx_row_start_ptr",
                   "num_ctx_ptr", "proposers_ptr", "block_tables_ptr"]  # fmt: skip


@triton.jit(**unspecialised(_RUNTIME_SIZES, _INPUT_POINTERS))
def _prepare_dflash_inputs_kernel(
    anchor_tokens_ptr,  # [C] int
    anchor_positions_ptr,  # [C] int
    ctx_row_start_ptr,  # [C] int, ascending
    num_ctx_ptr,  # [C] int
    proposers_ptr,  # [R] int, indices into C
    block_tables_ptr,  # [>= C, max_blocks] int
    input_ids_ptr,  # [R_pad * Q] int64
    positions_ptr,  # [R_pad * Q] int64
    slot_mapping_ptr,  # [R_pad * Q] int64
    query_start_loc_ptr,  # [R_pad + 1] int64
    seq_lens_ptr,  # [R_pad] int64
    context_positions_ptr,  # [num_ctx_rows] int64
    context_slot_mapping_ptr,  # [num_ctx_rows] int64
    num_reqs,
    num_props,
    num_reqs_padded,
    num_ctx_rows,
    stride_bt,
    max_blocks,
    block_size,
    mask_token_id,
    NUM_SPEC: tl.constexpr,
    PAD_SLOT: tl.constexpr,
    BLOCK_R: tl.constexpr,  # drafting requests per program
    BLOCK_Q: tl.constexpr,  # >= NUM_SPEC + 1
    BLOCK_CTX: tl.constexpr,  # context rows per program
    SEARCH_STEPS: tl.constexpr,  # >= log2(C + 1): binary-search depth over ctx_row_start
):
    # Each program fills BLOCK_R drafting requests' query block and BLOCK_CTX context rows;
    # the grid covers whichever of the two is larger, so everything is written by exactly one
    # program.
    pid = tl.program_id(0)
    Q: tl.constexpr = NUM_SPEC + 1

    # --- Query block of drafting requests pid * BLOCK_R ...
    prop = pid * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    prop_in = prop < num_reqs_padded
    real = prop < num_props
    req = tl.load(proposers_ptr + prop, mask=real, other=0).to(tl.int64)  # its request in C
    anchor_pos = tl.load(anchor_positions_ptr + req, mask=real, other=0).to(tl.int64)
    anchor_tok = tl.load(anchor_tokens_ptr + req, mask=real, other=mask_token_id).to(tl.int64)
    offs_q = tl.arange(0, BLOCK_Q)  # [BLOCK_Q]
    q_in = prop_in[:, None] & (offs_q < Q)[None, :]  # [BLOCK_R, BLOCK_Q]
    pos = anchor_pos[:, None] + offs_q[None, :]  # [BLOCK_R, BLOCK_Q]
    col = tl.minimum(pos // block_size, max_blocks - 1)
    block = tl.load(
        block_tables_ptr + req[:, None] * stride_bt + col,
        mask=real[:, None] & q_in,
        other=0,
    ).to(tl.int64)
    slot = tl.where(real[:, None], block * block_size + pos % block_size, PAD_SLOT)
    ids = tl.where(offs_q[None, :] == 0, anchor_tok[:, None], mask_token_id)
    flat = prop[:, None].to(tl.int64) * Q + offs_q[None, :]
    tl.store(input_ids_ptr + flat, ids, mask=q_in)
    tl.store(positions_ptr + flat, pos, mask=q_in)
    tl.store(slot_mapping_ptr + flat, slot, mask=q_in)
    tl.store(seq_lens_ptr + prop, anchor_pos + Q, mask=prop_in)
    tl.store(query_start_loc_ptr + prop + 1, (prop + 1).to(tl.int64) * Q, mask=prop_in)
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


SEARCH_STEPS = 16  # binary-search depth: up to 65,535 requests in a step


def prepare_dflash_inputs(
    anchor_tokens: torch.Tensor,  # [C] int64, new token of each request (read for proposers)
    anchor_positions: torch.Tensor,  # [C] int64, position right after its committed rows
    ctx_row_start: torch.Tensor,  # [C] int64, flat target row of the first committed row
    num_ctx: torch.Tensor,  # [C] int64, committed rows (>= 0); spans ascend, no overlap
    proposers: torch.Tensor,  # [R] int64, the requests that draft (indices into C)
    block_tables: torch.Tensor,  # [>= C, max_blocks] int
    block_size: int,
    num_spec: int,
    mask_token_id: int,
    num_reqs_padded: int,  # >= R
    num_ctx_rows: int,  # context buffer length, >= every ctx_row_start + num_ctx
    out: DFlashInputs | None = None,
) -> DFlashInputs:
    """Triton twin of `prepare_dflash_inputs_torch` (the specification); one launch."""
    num_reqs, num_props = anchor_tokens.shape[0], proposers.shape[0]
    if num_reqs >= 2**SEARCH_STEPS:
        raise ValueError(f"{num_reqs} requests in one step: at most {2**SEARCH_STEPS - 1}")
    if num_props > num_reqs_padded:
        raise ValueError(f"{num_props} requests do not fit in {num_reqs_padded} padded ones")
    if out is None:
        out = DFlashInputs.empty(num_reqs_padded, num_spec, num_ctx_rows, anchor_tokens.device)
    block_r, block_ctx = 16, 256
    grid = max(triton.cdiv(num_reqs_padded, block_r), triton.cdiv(num_ctx_rows, block_ctx), 1)
    _prepare_dflash_inputs_kernel[(grid,)](
        anchor_tokens,
        anchor_positions,
        ctx_row_start,
        num_ctx,
        proposers,
        block_tables,
        out.input_ids,
        out.positions,
        out.slot_mapping,
        out.query_start_loc,
        out.seq_lens,
        out.context_positions,
        out.context_slot_mapping,
        num_reqs,
        num_props,
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
        # 2**steps - 1 >= C. Fixed, so the kernel compiles once per N (at start-up, see
        # LLMEngine.capture_graphs), never in the middle of serving when a batch first grows
        # past a power of two; the extra halving steps cost nothing next to the launch.
        SEARCH_STEPS=SEARCH_STEPS,
        num_warps=4,
    )
    return out
