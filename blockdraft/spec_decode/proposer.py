"""DFlash speculator: writes context K/V for committed tokens and drafts the next block.

Per step, right after the target's forward and verification are queued on the device (before
the step's tokens are read back to the host), all from device tensors:
1. `prepare_inputs`: one kernel turns the step's results (each request's committed rows and
   new token) into the drafter's inputs: context positions/slots per flat target row (PAD for
   rows not committed), and the query blocks of the requests that draft.
2. `write_context`: the target features of every committed row (prompt chunks, and the anchor
   plus accepted drafts of each verify) go through fc/hidden_norm and each draft layer's k/v
   projection into the drafter's paged cache, at the rows' own positions. Rejected rows write
   nothing.
3. `propose`: for each request that has a new anchor, the block [anchor, MASK x N] at positions
   p .. p+N runs through the drafter in one forward; its rows 1..N give N draft tokens. N may
   be below the drafter's block_size - 1 (the engine picks it by batch size): the drafter
   attends within the block it is given, so a shorter block is the same model on fewer masks.
   A DFlash2 drafter's head (its logits, the candidate selector and the path walk) runs in the
   same forward, so inside the same CUDA graph (`candidate_selection`).

The drafter cache shares the target's block tables: a position's drafter K/V sits in the same
slot as its target K/V, so prefix caching, preemption and freeing need no extra bookkeeping.

The proposer owns the drafter's CUDA graphs (one per block length 1+N, as the model runner owns
the target's): a block run replays one when it was captured for the batch, else runs eagerly.
"""

from __future__ import annotations

import torch

from blockdraft.kernels.dflash_inputs import DFlashInputs
from blockdraft.kernels.forward_context import AttentionMetadata, forward_context
from blockdraft.kernels.select import PerDevice, get_dflash_inputs_backend
from blockdraft.layers.sampler import SamplingTensors
from blockdraft.models.dflash2_drafter import DFlash2Drafter
from blockdraft.models.dflash_drafter import DFlashDrafter
from blockdraft.runtime.cuda_graph_runner import CUDAGraphRunner
from blockdraft.spec_decode.candidate_selection import dense_draft_probs, select_drafts
from blockdraft.spec_decode.graphed_context import GraphedContext
from blockdraft.spec_decode.rejection_sampler import sample_drafts


class DFlashProposer:
    def __init__(self, drafter: DFlashDrafter, block_size: int) -> None:
        self.drafter = drafter
        self.block_size = block_size
        self.device = next(drafter.parameters()).device
        self._prepare = PerDevice(get_dflash_inputs_backend)  # Triton on CUDA, else the twin
        self.graphs: dict[int, CUDAGraphRunner] = {}  # block length 1+N -> captured forwards
        self.graphed_contexts: dict[int, GraphedContext] = {}  # their context K/V inputs
        # DFlash2: the drafter's head selects the drafts, from the requests' temperatures and
        # seeds (persistent [max batch] inputs of each graph).
        self.selects = isinstance(drafter, DFlash2Drafter)
        self.graph_sampling: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def prepare_inputs(
        self,
        anchor_tokens: torch.Tensor,  # [C] int64, each request's new token (read if drafting)
        anchor_positions: torch.Tensor,  # [C] int64, position right after its committed rows
        ctx_row_start: torch.Tensor,  # [C] int64, flat target row of its first committed row
        num_ctx: torch.Tensor,  # [C] int64, its committed rows
        proposers: torch.Tensor,  # [R] int64, the requests that draft (indices into C)
        block_tables: torch.Tensor,  # [C, W] int64
        num_drafts: int,  # N
        num_ctx_rows: int,  # rows of the flat target batch
    ) -> DFlashInputs:
        return self._prepare(self.device)(
            anchor_tokens,
            anchor_positions,
            ctx_row_start,
            num_ctx,
            proposers,
            block_tables,
            self.block_size,
            num_drafts,
            self.drafter.cfg.mask_token_id,
            proposers.shape[0],
            num_ctx_rows,
        )

    def write_context(
        self,
        features: torch.Tensor,  # [num_ctx_rows, K * hidden], this step's target features
        inputs: DFlashInputs,  # context positions/slots per row, PAD where not committed
    ) -> None:
        self.drafter.write_context(features, inputs.context_positions, inputs.context_slot_mapping)

    def eager_block(
        self,
        inputs: DFlashInputs,
        num_reqs: int,  # R drafting requests (the inputs hold no padded ones)
        block_tables: torch.Tensor,  # [R, W] int64
        max_seq_len: int,  # an upper bound on inputs.seq_lens, known on the host
        context: torch.Tensor | None = None,  # [R * Q, K * hidden]: features to write first
        st: SamplingTensors | None = None,  # one row per request: a selecting drafter's head
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:  # [R * Q, hidden], or select_drafts' output
        if context is not None:
            self.write_context(context, inputs)
        meta = AttentionMetadata(
            slot_mapping=inputs.slot_mapping,
            query_start_loc=inputs.query_start_loc,
            seq_lens=inputs.seq_lens,
            block_tables=block_tables,
            max_query_len=inputs.input_ids.shape[0] // num_reqs,
            max_seq_len=max_seq_len,
            block_size=self.block_size,
            uniform_query_len=True,
        )
        with forward_context(meta):
            hidden = self.drafter(inputs.input_ids, inputs.positions)
            if not self.selects:
                return hidden
            return select_drafts(
                self.drafter, hidden, inputs.input_ids, inputs.positions, st.temperature, st.seed
            )

    def run_block(
        self,
        inputs: DFlashInputs,
        num_reqs: int,  # R
        block_tables: torch.Tensor,  # [R, W] int64, on the device
        max_seq_len: int,
        context: torch.Tensor | None = None,  # [R * Q, K * hidden]: features to write first
        st: SamplingTensors | None = None,  # one row per request: a selecting drafter's head
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:  # [R * Q, hidden], or select_drafts' output
        """Replays a CUDA graph of the drafter when one was captured for this block length and
        batch, copying the device-built inputs into its buffers on the device; else runs
        eagerly. `context` (a uniform step's features, one row per block row) is written inside
        the graph when it has context inputs, else eagerly before it."""
        rows = inputs.input_ids.shape[0]
        q = rows // num_reqs
        graph, graphed = self.graphs.get(q), self.graphed_contexts.get(q)
        if graph is None or not graph.fits(num_reqs, block_tables.shape[1]):
            return self.eager_block(inputs, num_reqs, block_tables, max_seq_len, context, st)
        if graphed is not None and context is not None and context.shape[0] == rows:
            graphed.load(context, inputs.context_positions, inputs.context_slot_mapping)
        else:
            if context is not None:
                self.write_context(context, inputs)
            if graphed is not None:
                graphed.clear()
        if self.selects:
            temperature, seed = self.graph_sampling[q]
            temperature[:num_reqs].copy_(st.temperature)
            seed[:num_reqs].copy_(st.seed)
        out = graph.run(
            inputs.input_ids, inputs.positions, inputs.slot_mapping, inputs.seq_lens, block_tables
        )
        if self.selects:
            tokens, candidates, q = (t[:num_reqs] for t in out)
            # A copy of the drafts: they wait for the next step's verify, and the target graphs
            # replayed before it may reuse this graph's output memory (one pool, see
            # engine/cuda_graphs.py). The candidates and q are read now, as DFlash's hidden rows.
            return tokens.clone(), candidates, q
        return out[:rows]

    def propose(
        self,
        inputs: DFlashInputs,  # from prepare_inputs, R drafting requests
        block_tables: torch.Tensor,  # [R, W] int64, the drafting requests' tables
        max_seq_len: int,  # an upper bound on inputs.seq_lens, known on the host
        st: SamplingTensors,  # one row per drafting request, position = anchor position + 1
        num_drafts: int,  # N
        context: torch.Tensor | None = None,  # [R * (N+1), K * hidden], see below
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # tokens [R, N] int64, probs [R, N, V]
        """Returns N draft tokens per request, and their probabilities [R, N, V] when any
        request samples (None when all are greedy). Both stay on the device: the next verify
        reads them there, so proposing costs no host readback. `context`: this step's target
        features when their K/V write was left to the block run (a uniform step, whose
        context rows are the block rows), else None (written already)."""
        num_reqs, n = block_tables.shape[0], num_drafts
        if self.selects:
            tokens, candidates, q = self.run_block(
                inputs, num_reqs, block_tables, max_seq_len, context, st
            )
            if st.all_greedy:
                return tokens, None
            # Over the target's vocabulary: the head may hold fewer rows (a token map, a
            # tensor-parallel slice), while the candidates are target ids.
            vocab = self.drafter.cfg.body.vocab_size
            return tokens, dense_draft_probs(candidates, q, vocab)
        hidden = self.run_block(inputs, num_reqs, block_tables, max_seq_len, context)
        draft_hidden = hidden[: num_reqs * (n + 1)].view(num_reqs, n + 1, -1)[:, 1:]
        # All greedy: the argmax of the head's own logits (no float32 copy of [R * N, V])
        logits = self.drafter.compute_logits(draft_hidden.flatten(0, 1), float32=not st.all_greedy)
        return sample_drafts(logits.view(num_reqs, n, -1), st)

    def capture_graphs(
        self,
        num_drafts: int,  # N: the graphs run blocks of 1+N rows
        batch_sizes: list[int],
        max_blocks_per_seq: int,
        pool: object | None,  # the memory pool to share with the other graphs
    ) -> object:  # the pool
        """Captures the block forward (its context K/V write inside) at each batch size, and
        compiles the drafter-input kernel for N."""
        q = num_drafts + 1
        graphed = GraphedContext(self.drafter, batch_sizes[-1] * q, self.device)
        forward = graphed.forward
        if self.selects:
            temperature = torch.zeros(batch_sizes[-1], dtype=torch.float32, device=self.device)
            seed = torch.zeros(batch_sizes[-1], dtype=torch.int64, device=self.device)
            self.graph_sampling[q] = temperature, seed

            def forward(input_ids: torch.Tensor, positions: torch.Tensor) -> tuple:
                r = input_ids.shape[0] // q
                hidden = graphed.forward(input_ids, positions)
                return select_drafts(
                    self.drafter, hidden, input_ids, positions, temperature[:r], seed[:r]
                )

        runner = CUDAGraphRunner(
            forward, q, batch_sizes, max_blocks_per_seq, self.block_size, self.device, pool
        )
        runner.capture()
        self.graphed_contexts[q], self.graphs[q] = graphed, runner
        self._compile_prepare_inputs(num_drafts)
        return runner.pool

    def _compile_prepare_inputs(self, num_drafts: int) -> None:
        """Runs the drafter-input kernel once for N = num_drafts on a dummy request, so that
        its Triton compile happens here and not in the first step that drafts N tokens.
        Writes only fresh output buffers."""
        zero, one = (torch.full((1,), v, dtype=torch.int64, device=self.device) for v in (0, 1))
        tables = torch.zeros(1, 1, dtype=torch.int64, device=self.device)
        self.prepare_inputs(zero, one, zero, one, zero, tables, num_drafts, 1)
