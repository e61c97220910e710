"""Model runner: turns a scheduled step into flat tensors, runs the target, samples or verifies
(`launch`, all queued on the device), then reads the results back once (`finish`). The engine
queues the drafter's work between the two. It orchestrates; the feature logic lives in the
modules it calls."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import torch

from blockdraft.engine.cuda_graphs import CUDAGraphRunner
from blockdraft.engine.scheduler import ScheduledChunk
from blockdraft.engine.sequence import DraftBatch, Sequence
from blockdraft.kernels.forward_context import (
    build_attention_metadata,
    flat_slots,
    forward_context,
    host_int64,
    int64_tensors,
    padded_block_tables,
)
from blockdraft.layers.attention import PagedAttention
from blockdraft.layers.sampler import SamplingTensors, sample
from blockdraft.models.llama import DecoderLM
from blockdraft.spec_decode.rejection_sampler import rejection_sample

# Split-K counters per attention layer (PagedAttention.split_counters): split-K only runs where
# num_seqs * num_kv_heads programs leave SMs idle, so this covers any GPU's SM count.
SPLIT_COUNTERS = 1024


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


def allocate_kv_cache(
    layers: list[PagedAttention],
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    for attn in layers:
        # One extra block at the end takes the writes of padded rows (see store_kv).
        shape = (num_blocks + 1, block_size, attn.num_kv_heads, attn.head_dim)
        attn.key_cache = torch.zeros(shape, dtype=dtype, device=device)
        attn.value_cache = torch.zeros(shape, dtype=dtype, device=device)
        attn.split_counters = torch.zeros(SPLIT_COUNTERS, dtype=torch.int32, device=device)


def kv_bytes_per_block(layers: list[PagedAttention], block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return sum(2 * block_size * a.num_kv_heads * a.head_dim * elem for a in layers)


def run_forward(
    module: torch.nn.Module,
    graphs: dict[int, CUDAGraphRunner],
    token_ids: list[list[int]],
    starts: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
    device_ids: tuple[torch.Tensor, torch.Tensor] | None = None,  # rows [D], ids [D] int64
) -> object:
    """One forward over a flat batch: replays a CUDA graph when every request has the same
    number of rows and one was captured for it, else runs eagerly. Outputs are sliced to the
    real rows. `device_ids` are input ids only the device holds (the drafts a verify checks):
    they are written over those flat rows' placeholders there, so the host never reads them."""
    query_lens = [len(t) for t in token_ids]
    flat_ids = [t for ids in token_ids for t in ids]
    positions = [s + i for s, n in zip(starts, query_lens, strict=True) for i in range(n)]
    graph = graphs.get(query_lens[0]) if len(set(query_lens)) == 1 else None
    if graph is not None and graph.fits(len(starts), max(len(t) for t in block_tables)):
        rows = len(flat_ids)
        slots = flat_slots(block_tables, starts, query_lens, block_size)
        seq_lens = [s + n for s, n in zip(starts, query_lens, strict=True)]
        # The graph's inputs come from the host: one host tensor for the flat ones.
        pinned = device.type == "cuda"
        flat = host_int64(flat_ids + positions + slots + seq_lens, pinned)
        ids, pos, slot_mapping, lens = flat.split([rows, rows, rows, len(seq_lens)])
        tables = host_int64(padded_block_tables(block_tables), pinned)
        out = graph.run(ids, pos, slot_mapping, lens, tables, device_ids)
        if isinstance(out, tuple):
            return tuple(o[:rows] if o is not None else None for o in out)
        return out[:rows]
    meta = build_attention_metadata(block_tables, starts, query_lens, block_size, device)
    ids, pos = int64_tensors(device, flat_ids, positions)
    if device_ids is not None:
        ids.index_copy_(0, *device_ids)
    with forward_context(meta):
        return module(ids, pos)


def sampling_tensors(
    seqs: list[Sequence], positions: list[int], device: torch.device
) -> SamplingTensors:
    return SamplingTensors.from_lists(
        temperature=[s.params.temperature for s in seqs],
        top_k=[s.params.top_k for s in seqs],
        top_p=[s.params.top_p for s in seqs],
        min_p=[s.params.min_p for s in seqs],
        seed=[s.seed for s in seqs],
        position=positions,
        device=device,
    )


@dataclass
class VerifyInputs:
    """A verify batch's device inputs, prepared before the forward: its drafts are input ids
    that only the device holds."""

    logit_rows: torch.Tensor  # [R * (N+1)] int64: flat rows of each anchor and its drafts
    draft_rows: torch.Tensor  # [R * N] int64: flat rows whose input id is a draft
    drafts: torch.Tensor  # [R, N] int64
    draft_probs: torch.Tensor | None  # [R, N, V] float32; None => drafts are one-hot
    st: SamplingTensors  # one row per request; position = first draft position


def shared_draft_batch(seqs: list[Sequence]) -> tuple[DraftBatch | None, list[int]]:
    """The one DraftBatch holding every request's drafts (None when they span several), and
    the rows to take from it ([] when it is taken whole, in order: the usual step, where the
    requests proposed last step are verified now)."""
    batch = seqs[0].drafts.batch
    if any(s.drafts.batch is not batch for s in seqs):
        return None, []
    rows = [s.drafts.row for s in seqs]
    return batch, [] if rows == list(range(batch.tokens.shape[0])) else rows


def gather_drafts(
    seqs: list[Sequence],
    batch: DraftBatch | None,  # shared by every request, from shared_draft_batch
    rows: torch.Tensor | None,  # [R] int64 on the device: rows of `batch`; None => all, in order
    num_drafts: int,  # N verified this step: each request's first N (it may hold more)
    need_probs: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # drafts [R, N] int64, probs [R, N, V] f32
    """Each request's drafts to verify, gathered on the device (no sync)."""
    if batch is None:
        return stack_drafts(seqs, num_drafts, need_probs)
    tokens = batch.tokens[:, :num_drafts]
    probs = batch.probs[:, :num_drafts] if need_probs and batch.probs is not None else None
    if rows is None:
        return tokens, probs
    return tokens.index_select(0, rows), None if probs is None else probs.index_select(0, rows)


def stack_drafts(
    seqs: list[Sequence], num_drafts: int, need_probs: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:  # drafts [R, N] int64, probs [R, N, V] f32
    """Drafts from several propose steps: a request whose verify did not fit the token budget
    kept the drafts of an earlier step (possibly more than N, when the batch was smaller)."""
    pending = [s.drafts for s in seqs]
    tokens = torch.stack([d.batch.tokens[d.row, :num_drafts] for d in pending])
    if not need_probs or all(d.batch.probs is None for d in pending):
        return tokens, None
    vocab = next(d.batch.probs.shape[-1] for d in pending if d.batch.probs is not None)
    # A request proposed in an all-greedy batch has no probabilities: its drafts are one-hot.
    probs = [
        d.batch.probs[d.row, :num_drafts] if d.batch.probs is not None else one_hot_f32(t, vocab)
        for d, t in zip(pending, tokens, strict=True)
    ]
    return tokens, torch.stack(probs)


def one_hot_f32(tokens: torch.Tensor, vocab: int) -> torch.Tensor:  # tokens [N] -> [N, V] f32
    # By scatter: F.one_hot checks its values on the host (a sync) on some devices.
    out = torch.zeros(len(tokens), vocab, dtype=torch.float32, device=tokens.device)
    return out.scatter_(1, tokens[:, None], 1.0)


class SamplingTensorCache:
    """Sampling parameters of a batch of requests on the device, built once per batch
    composition: they are constant per request, and consecutive steps mostly run the same
    requests in the same order. Only the positions are new each step."""

    def __init__(self, device: torch.device, max_entries: int = 4) -> None:
        self.device, self.max_entries = device, max_entries
        self._entries: dict[tuple[Sequence, ...], SamplingTensors] = {}

    def get(
        self,
        seqs: list[Sequence],
        position: torch.Tensor,  # [len(seqs)] int64 on the device
    ) -> SamplingTensors:
        key = tuple(seqs)  # Sequence compares by identity
        st = self._entries.get(key)
        if st is None:
            st = sampling_tensors(seqs, [0] * len(seqs), self.device)
            if len(self._entries) >= self.max_entries:
                del self._entries[next(iter(self._entries))]  # the oldest
            self._entries[key] = st
        return dataclasses.replace(st, position=position)


class ModelRunner:
    def __init__(
        self,
        model: DecoderLM,
        block_size: int,
        device: torch.device,
        synthetic_acceptance_rate: float | None = None,
    ) -> None:
        self.model = model
        self.synthetic_acceptance_rate = synthetic_acceptance_rate
        self.graphs: dict[int, CUDAGraphRunner] = {}  # query length -> captured forwards
        self.block_size, self.device = block_size, device
        self.sampling = SamplingTensorCache(device)

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
            prepared = self._prepare_verify([chunks[i] for i in verify], [ends[i] for i in verify])
        hidden, features = self._forward(
            chunks, None if prepared is None else (prepared.draft_rows, prepared.drafts.flatten())
        )
        sampled = verify_tokens = num_accepted = None
        if decode:
            sampled = self._sample(decode, [ends[i] for i in decode], chunks, hidden)
        if prepared is not None:
            verify_tokens, num_accepted = self._verify(prepared, hidden)
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
        st = self.sampling.get([c.seq for c in chunks], positions)
        sampled = sample(self.model.compute_logits(hidden[rows]), st)
        readback, ready = start_readback(sampled)
        every = list(range(n))
        return LaunchedStep(
            chunks, [i + 1 for i in every], every, [], sampled, None, None, features, readback,
            ready,
        )

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
        )

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

    def _prepare_verify(self, chunks: list[ScheduledChunk], ends: list[int]) -> VerifyInputs:
        n = chunks[0].num_drafts
        seqs = [c.seq for c in chunks]
        batch, batch_rows = shared_draft_batch(seqs)
        # One transfer for the host-built indices. The first draft sits one past the anchor,
        # the last committed token.
        logit_rows, draft_rows, positions, rows = int64_tensors(
            self.device,
            [e - n - 1 + j for e in ends for j in range(n + 1)],
            [e - n + j for e in ends for j in range(n)],
            [c.start + 1 for c in chunks],
            batch_rows,
        )
        st = self.sampling.get(seqs, positions)
        # Greedy verification and the synthetic benchmark mode never read draft probabilities.
        need_probs = not st.all_greedy and self.synthetic_acceptance_rate is None
        drafts, probs = gather_drafts(seqs, batch, rows if batch_rows else None, n, need_probs)
        return VerifyInputs(logit_rows, draft_rows, drafts.to(torch.int64), probs, st)

    def _verify(
        self, v: VerifyInputs, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:  # tokens [R, N+1], accepted [R], on the device
        num_rows, n = v.drafts.shape
        logits = self.model.compute_logits(hidden[v.logit_rows]).view(num_rows, n + 1, -1)
        if self.synthetic_acceptance_rate is not None:
            return self._synthetic_verify(logits, v.drafts)
        return rejection_sample(logits, v.drafts, v.draft_probs, v.st)

    def _synthetic_verify(
        self,
        logits: torch.Tensor,  # [R, N+1, V]
        drafts: torch.Tensor,  # [R, N] int64
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Benchmark mode: each draft is accepted with a fixed probability (the cost of real
        verification is still paid, by computing the target's argmax)."""
        num_rows, n = drafts.shape
        coin = torch.rand(num_rows, n, device=drafts.device) < self.synthetic_acceptance_rate
        accepted = coin.long().cumprod(dim=1).sum(dim=1)
        out = torch.cat([drafts, logits[:, -1:].argmax(-1)], dim=1)
        out.scatter_(1, accepted[:, None], logits.argmax(-1).gather(1, accepted[:, None]))
        return out, accepted
