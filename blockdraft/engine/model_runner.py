"""Model runner: turns a scheduled step into flat tensors, runs the target, samples or verifies
(`launch`, all queued on the device), then reads the results back once (`finish`). The engine
queues the drafter's work between the two. It orchestrates; the verify's inputs and rejection
sampling are the speculator's (blockdraft/spec_decode/verify.py)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from blockdraft.engine.scheduler import ScheduledChunk
from blockdraft.kernels.forward_context import (
    LinearStateMetadata,
    build_linear_metadata,
    forward_context,
)
from blockdraft.kernels.host_tensors import host_int64, int64_tensors
from blockdraft.layers.sampler import sample
from blockdraft.models.llama import DecoderLM
from blockdraft.runtime.commit_graphs import CommitGraphs
from blockdraft.runtime.cuda_graph_runner import CUDAGraphRunner
from blockdraft.runtime.feature_ring import FeatureRing
from blockdraft.runtime.host_batch import (
    build_attention_metadata,
    flat_slots,
    padded_block_tables,
)
from blockdraft.runtime.sampling_cache import SamplingTensorCache
from blockdraft.spec_decode.draft_launch import TargetStep
from blockdraft.spec_decode.verify import Verifier, VerifyInputs


@dataclass
class StepOutput:
    """Per scheduled chunk: the tokens to append (empty mid-prefill) and, for a verify, how many
    drafts were accepted."""

    new_tokens: list[list[int]]
    num_accepted: list[int | None]


@dataclass
class LaunchedStep:
    """A step whose target forward, sampling and verification are queued on the device and not
    yet read back: what the drafter needs is here, on the device, so that its work can be
    queued behind them before the host waits for the readback."""

    chunks: list[ScheduledChunk]
    row_ends: list[int]  # [C] flat row after each chunk's last row
    decode: list[int]  # chunks that sampled a next token (decode, last prefill chunk)
    verify: list[int]  # chunks that verified drafts
    sampled: torch.Tensor | None  # [len(decode)] int64 next tokens
    verify_tokens: torch.Tensor | None  # [len(verify), N+1] int64, -1 past the bonus token
    num_accepted: torch.Tensor | None  # [len(verify)] int64 accepted drafts
    features: torch.Tensor | None  # [num_tokens, K * hidden] target features (speculating)
    # The three results above, flat, on their way to the host (None: nothing to read), and the
    # event after which they are there (None: they already are, off CUDA).
    readback: torch.Tensor | None  # [D + V * (N+1) + V] int64
    readback_ready: torch.cuda.Event | None
    # Where a decode graph left the features in the drafter's feature ring (unwrapped row of
    # the first request's; None: not there, an eager step or no ring).
    feature_ring_start: int | None = None

    def target_step(self) -> TargetStep:
        """The step as the drafter sees it."""
        chunks = self.chunks
        return TargetStep(
            [c.start for c in chunks],
            [len(c.token_ids) for c in chunks],
            self.row_ends,
            [c.completes for c in chunks],
            [c.seq.block_table for c in chunks],
            [c.seq for c in chunks],
            self.decode,
            self.verify,
            self.sampled,
            self.verify_tokens,
            self.num_accepted,
            self.features,
            self.feature_ring_start,
        )


def start_readback(
    values: torch.Tensor,  # [n] int64 on the device
) -> tuple[torch.Tensor, torch.cuda.Event | None]:  # [n] int64 on the host, its ready event
    """Queues the copy of a step's results to (page-locked) host memory right behind the work
    that produces them. Waiting on the event then waits for that point of the stream only, not
    for the drafter work queued after it: the host does the step's bookkeeping while the GPU
    drafts."""
    if values.device.type != "cuda":
        return values, None
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host, ready


def run_forward(
    module: torch.nn.Module,
    graphs: dict[int, CUDAGraphRunner],
    token_ids: list[list[int]],
    starts: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
    device_ids: tuple[torch.Tensor, torch.Tensor] | None = None,  # rows [D], ids [D] int64
    linear: LinearStateMetadata | None = None,  # hybrid models' state slots
) -> object:
    """One forward over a flat batch: replays a CUDA graph when every request has the same
    number of rows and one was captured for it, else runs eagerly. Outputs are sliced to the
    real rows. `device_ids` are input ids only the device holds (the drafts a verify checks):
    they are written over those flat rows' placeholders there, so the host never reads them."""
    query_lens = [len(t) for t in token_ids]
    flat_ids = [t for ids in token_ids for t in ids]
    positions = [s + i for s, n in zip(starts, query_lens, strict=True) for i in range(n)]
    graph = graphs.get(query_lens[0]) if len(set(query_lens)) == 1 else None
    if linear is not None and linear.prefill:  # a hybrid target's graphs decode or verify
        graph = None
    if graph is not None and graph.fits(len(starts), max(len(t) for t in block_tables)):
        rows = len(flat_ids)
        slots = flat_slots(block_tables, starts, query_lens, block_size)
        seq_lens = [s + n for s, n in zip(starts, query_lens, strict=True)]
        # The graph's inputs come from the host: one host tensor for the flat ones.
        pinned = device.type == "cuda"
        flat = host_int64(flat_ids + positions + slots + seq_lens, pinned)
        ids, pos, slot_mapping, lens = flat.split([rows, rows, rows, len(seq_lens)])
        tables = host_int64(padded_block_tables(block_tables), pinned)
        states = None if linear is None else (linear.state_slots, linear.fresh)
        out = graph.run(ids, pos, slot_mapping, lens, tables, device_ids, states)
        if isinstance(out, tuple):
            return tuple(o[:rows] if o is not None else None for o in out)
        return out[:rows]
    meta = build_attention_metadata(block_tables, starts, query_lens, block_size, device)
    meta.linear = linear
    ids, pos = int64_tensors(device, flat_ids, positions)
    if device_ids is not None:
        ids.index_copy_(0, *device_ids)
    with forward_context(meta):
        return module(ids, pos)


class ModelRunner:
    def __init__(
        self,
        model: DecoderLM,
        block_size: int,
        device: torch.device,
        synthetic_acceptance_rate: float | None = None,
    ) -> None:
        self.model = model
        self.graphs: dict[int, CUDAGraphRunner] = {}  # query length -> captured forwards
        self.block_size, self.device = block_size, device
        self.sampling = SamplingTensorCache(device)
        self.verifier = Verifier(self.sampling, device, synthetic_acceptance_rate)
        # Hybrid models: linear-attention state slots, committed after each verify (by a
        # captured graph per batch bucket on CUDA, blockdraft/engine/cuda_graphs.py).
        self.has_linear_state = hasattr(model, "commit_verified")
        self.commit_graphs: CommitGraphs | None = None
        # Speculating with deferred context: the decode graphs keep their features here.
        self.feature_ring: FeatureRing | None = None

    @torch.inference_mode()
    def launch(self, chunks: list[ScheduledChunk]) -> LaunchedStep:
        """Queues the target forward, the sampling of completing chunks and the verification
        of drafts; reads nothing back."""
        query_lens = [len(c.token_ids) for c in chunks]
        ends = list(itertools.accumulate(query_lens))
        decode = [i for i, c in enumerate(chunks) if c.completes and not c.num_drafts]
        verify = [i for i, c in enumerate(chunks) if c.num_drafts]
        prepared = None
        if verify:
            v_chunks = [chunks[i] for i in verify]
            prepared = self.verifier.prepare(
                [c.seq.drafts for c in v_chunks],
                [c.seq for c in v_chunks],
                [c.start for c in v_chunks],
                [ends[i] for i in verify],
                v_chunks[0].num_drafts,
            )
        hidden, features = self._forward(
            chunks, None if prepared is None else (prepared.draft_rows, prepared.drafts.flatten())
        )
        ring_start = self._take_ring_start()
        sampled = verify_tokens = num_accepted = None
        if decode:
            sampled = self._sample(decode, [ends[i] for i in decode], chunks, hidden)
        if prepared is not None:
            verify_tokens, num_accepted = self._verify(prepared, hidden)
            if self.has_linear_state:
                self._commit_states([chunks[i] for i in verify], num_accepted)
        parts = [t.flatten() for t in (sampled, verify_tokens, num_accepted) if t is not None]
        readback, ready = start_readback(torch.cat(parts)) if parts else (None, None)
        return LaunchedStep(
            chunks,
            ends,
            decode,
            verify,
            sampled,
            verify_tokens,
            num_accepted,
            features,
            readback,
            ready,
            ring_start,
        )

    @torch.inference_mode()
    def launch_decode_ahead(
        self, chunks: list[ScheduledChunk], previous: LaunchedStep
    ) -> LaunchedStep:
        """Async decode: queues the decode step after `previous` before `previous` is read back.
        Chunk i is one row at position `start`, where previous's chunk i samples its token: the
        row's input id is that token, taken from `previous.sampled` on the device (written over
        the placeholder id). The token is not on the host yet, so the sampling position (the
        seeded sampler hashes it) is start + 1, not seq.num_tokens as in `_sample`."""
        n = len(chunks)
        rows, positions = int64_tensors(self.device, list(range(n)), [c.start + 1 for c in chunks])
        hidden, features = self._forward(chunks, (rows, previous.sampled))
        ring_start = self._take_ring_start()
        st = self.sampling.get([c.seq for c in chunks], positions)
        sampled = sample(self.model.compute_logits(hidden[rows]), st)
        readback, ready = start_readback(sampled)
        every = list(range(n))
        return LaunchedStep(
            chunks,
            [i + 1 for i in every],
            every,
            [],
            sampled,
            None,
            None,
            features,
            readback,
            ready,
            ring_start,
        )

    def _take_ring_start(self) -> int | None:
        """Where the forward just run left its features in the feature ring (None: not there)."""
        return None if self.feature_ring is None else self.feature_ring.take_start()

    def _forward(
        self,
        chunks: list[ScheduledChunk],
        device_ids: tuple[torch.Tensor, torch.Tensor] | None,  # rows [D], ids [D] int64
    ) -> object:
        """The target forward over the chunks' rows (`run_forward`), with `device_ids` written
        over placeholder ids that only the device holds."""
        return run_forward(
            self.model,
            self.graphs,
            [c.token_ids for c in chunks],
            [c.start for c in chunks],
            [c.seq.block_table for c in chunks],
            self.block_size,
            self.device,
            device_ids,
            self._linear_metadata(chunks) if self.has_linear_state else None,
        )

    def _linear_metadata(self, chunks: list[ScheduledChunk]) -> LinearStateMetadata:
        """Each chunk's state slot (requests without one, warm-up rows, use the spare last
        slot), whether it starts the request, and whether it is a verify block."""
        slots = [-1 if c.seq.state_slot is None else c.seq.state_slot for c in chunks]
        slot_tensor, starts = int64_tensors(self.device, slots, [c.start for c in chunks])
        return build_linear_metadata(
            slot_tensor,
            starts == 0,
            [len(c.token_ids) for c in chunks],
            [c.num_drafts > 0 for c in chunks],
        )

    def _commit_states(
        self,
        chunks: list[ScheduledChunk],  # the verified chunks
        num_accepted: torch.Tensor,  # [V] int64 on the device
    ) -> None:
        """Linear-attention states at each verify's accepted length: the rows before the
        drafts and the accepted drafts (queued on the device, nothing read back)."""
        slots = [-1 if c.seq.state_slot is None else c.seq.state_slot for c in chunks]
        slot_tensor, before = int64_tensors(
            self.device, slots, [len(c.token_ids) - c.num_drafts for c in chunks]
        )
        if self.commit_graphs is not None:
            self.commit_graphs.run(slot_tensor, before + num_accepted)
        else:
            self.model.commit_verified(slot_tensor, before + num_accepted)

    def finish(self, step: LaunchedStep) -> StepOutput:
        """The step's one device-to-host read (one sync), for decode and verify alike."""
        chunks, decode, verify = step.chunks, step.decode, step.verify
        if step.readback_ready is not None:
            step.readback_ready.synchronize()
        host = step.readback.tolist() if step.readback is not None else []
        new_tokens: list[list[int]] = [[] for _ in chunks]
        num_accepted: list[int | None] = [None] * len(chunks)
        for i, tok in zip(decode, host[: len(decode)], strict=True):
            new_tokens[i] = [tok]
        if verify:
            q = chunks[verify[0]].num_drafts + 1
            rows, counts = host[len(decode) : -len(verify)], host[-len(verify) :]
            for j, (i, n) in enumerate(zip(verify, counts, strict=True)):
                new_tokens[i], num_accepted[i] = rows[j * q : j * q + n + 1], n
        return StepOutput(new_tokens, num_accepted)

    def _sample(
        self, decode: list[int], ends: list[int], chunks: list[ScheduledChunk], hidden: torch.Tensor
    ) -> torch.Tensor:  # [len(decode)] int64 next tokens, on the device
        seqs = [chunks[i].seq for i in decode]
        rows, positions = int64_tensors(
            self.device, [e - 1 for e in ends], [s.num_tokens for s in seqs]
        )
        st = self.sampling.get(seqs, positions)
        return sample(self.model.compute_logits(hidden[rows]), st)

    def _verify(
        self, v: VerifyInputs, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:  # tokens [R, N+1], accepted [R], on the device
        num_rows, n = v.drafts.shape
        logits = self.model.compute_logits(hidden[v.logit_rows]).view(num_rows, n + 1, -1)
        return self.verifier.verify(v, logits)
