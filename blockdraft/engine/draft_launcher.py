"""Queues a speculative step's drafter work right behind the target's, before the step's one
readback: context K/V of the committed rows, the drafter's forward over the proposing requests'
blocks, and draft sampling. Everything data-dependent (how many drafts each verify accepted,
the new anchor tokens) is taken from the device results of the target step, so the GPU runs
the drafter while the host waits for the readback and does the step's bookkeeping.

Every request whose chunk completes (a decode, a last prefill chunk, a verify) proposes, even
if the tokens it is about to read back finish it: the host only learns that after the readback,
and such a request simply drops its drafts. Its drafter block p .. p+N lies in blocks the
scheduler reserved for a caught-up request (`Scheduler._capacity_needed`), so it writes only
the request's own slots. A chunk that does not complete (mid-prefill) writes its context and
drafts nothing.

In the steady state every request verifies N drafts and proposes N more: the context rows are
then R * (N+1), as uniform as the block, and their K/V write (fc, norm, k/v projections, RoPE,
store: a dozen launches that bound a small target's step on the host) runs inside the
drafter's CUDA graph, from persistent inputs (`GraphedContext`). Other steps write it eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockdraft.engine.cuda_graphs import CUDAGraphRunner
from blockdraft.engine.model_runner import LaunchedStep, SamplingTensorCache
from blockdraft.engine.sequence import DraftBatch
from blockdraft.kernels.dflash_inputs import DFlashInputs
from blockdraft.kernels.forward_context import PAD_SLOT_ID, int64_tensors, padded_block_tables
from blockdraft.models.dflash_drafter import DFlashDrafter
from blockdraft.spec_decode.dflash import DFlashProposer


@dataclass
class LaunchedDrafts:
    batch: DraftBatch  # on the device, one row per proposer
    proposers: list[int]  # the chunk of each row


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


def run_drafter_block(
    proposer: DFlashProposer,
    graphs: dict[int, CUDAGraphRunner],  # query length -> captured drafter forwards
    contexts: dict[int, GraphedContext],  # query length -> their context inputs
    inputs: DFlashInputs,
    num_reqs: int,  # R
    block_tables: torch.Tensor,  # [R, W] int64, on the device
    max_seq_len: int,
    context: torch.Tensor | None = None,  # [R * Q, K * hidden]: features to write first
) -> torch.Tensor:  # [R * Q, hidden]
    """Replays a CUDA graph of the drafter when one was captured for this block length and
    batch, copying the device-built inputs into its buffers on the device; else runs eagerly.
    `context` (a uniform step's features, one row per block row) is written inside the graph
    when it has context inputs, else eagerly before it."""
    rows = inputs.input_ids.shape[0]
    q = rows // num_reqs
    graph, graphed = graphs.get(q), contexts.get(q)
    if graph is None or not graph.fits(num_reqs, block_tables.shape[1]):
        return proposer.eager_block(inputs, num_reqs, block_tables, max_seq_len, context)
    if graphed is not None and context is not None and context.shape[0] == rows:
        graphed.load(context, inputs.context_positions, inputs.context_slot_mapping)
    else:
        if context is not None:
            proposer.write_context(context, inputs)
        if graphed is not None:
            graphed.clear()
    out = graph.run(
        inputs.input_ids, inputs.positions, inputs.slot_mapping, inputs.seq_lens, block_tables
    )
    return out[:rows]


class DraftLauncher:
    def __init__(
        self,
        proposer: DFlashProposer,
        sampling: SamplingTensorCache,
        device: torch.device,
    ) -> None:
        self.proposer, self.sampling, self.device = proposer, sampling, device

    def launch(self, step: LaunchedStep, num_drafts: int) -> LaunchedDrafts | None:
        """Queues context K/V for every committed row of `step`, then N drafts for each request
        whose chunk completes; None when none does (or N = 0: the context only). Reads nothing
        back."""
        chunks = step.chunks
        verify = set(step.verify)
        proposers = [i for i, c in enumerate(chunks) if c.completes] if num_drafts else []
        tables = padded_block_tables([c.seq.block_table for c in chunks])
        # Committed rows known on the host: a prefill chunk's all, a verify's anchor (its
        # accepted drafts are added on the device).
        host_num_ctx = [1 if i in verify else len(c.token_ids) for i, c in enumerate(chunks)]
        row_start, num_ctx, starts, decode_idx, verify_idx, proposers_gpu, flat_tables = (
            int64_tensors(
                self.device,
                [end - len(c.token_ids) for end, c in zip(step.row_ends, chunks, strict=True)],
                host_num_ctx,
                [c.start for c in chunks],
                step.decode,
                step.verify,
                proposers,
                [b for t in tables for b in t],
            )
        )
        block_tables = flat_tables.view(len(chunks), -1)  # [C, W]
        anchor_tokens = torch.zeros(len(chunks), dtype=torch.int64, device=self.device)
        if step.decode:
            anchor_tokens.index_copy_(0, decode_idx, step.sampled)
        if step.verify:
            accepted = step.num_accepted  # [V]
            num_ctx = num_ctx.index_add(0, verify_idx, accepted)
            # The bonus / corrected token sits right after the accepted drafts.
            bonus = step.verify_tokens.gather(1, accepted[:, None]).squeeze(1)
            anchor_tokens.index_copy_(0, verify_idx, bonus)
        anchor_positions = starts + num_ctx  # [C]: right after the committed rows

        inputs = self.proposer.prepare_inputs(
            anchor_tokens,
            anchor_positions,
            row_start,
            num_ctx,
            proposers_gpu,
            block_tables,
            max(num_drafts, 1),  # N = 0 has no proposers: no block rows to lay out
            step.row_ends[-1],
        )
        num_props, q = len(proposers), num_drafts + 1
        # A uniform step (every request verified N and proposes N): its context rows are the
        # block rows, and the block run writes them (inside the drafter graph when captured).
        uniform = num_props == len(step.verify) == len(chunks) and all(
            len(c.token_ids) == q for c in chunks
        )
        if not uniform:
            self.proposer.write_context(step.features, inputs)
        if not proposers:
            return None
        if num_props < len(chunks):
            block_tables = block_tables.index_select(0, proposers_gpu)
        # A drafting chunk's anchor is at most one past its last row (a decode's exactly), so
        # its block's keys end by start + len + Q, which its block table covers (the scheduler
        # reserves the lookahead of a chunk that completes).
        max_seq_len = max(chunks[i].start + len(chunks[i].token_ids) for i in proposers) + q
        positions = inputs.positions.view(num_props, q)[:, 0] + 1  # first draft positions
        st = self.sampling.get([chunks[i].seq for i in proposers], positions)
        tokens, probs = self.proposer.propose(
            inputs, block_tables, max_seq_len, st, num_drafts, step.features if uniform else None
        )
        return LaunchedDrafts(DraftBatch(tokens, probs), proposers)
