"""The engine: owns the model, the KV pool, the scheduler and the speculator, and advances every
request by one step per `step()` call."""

from __future__ import annotations

import logging
import time

import torch

from blockdraft.config import EngineConfig
from blockdraft.distributed.tensor_parallel import TensorParallel
from blockdraft.engine.async_decode import DecodePipeline
from blockdraft.engine.cpu_linear_plan import cpu_linear_policy
from blockdraft.engine.cuda_graphs import capture_graphs, default_batch_sizes
from blockdraft.engine.input_processor import InputProcessor
from blockdraft.engine.kv_cache import allocate_kv_pool, max_blocks_per_seq
from blockdraft.engine.model_loader import load_rank_models
from blockdraft.engine.model_runner import LaunchedStep, ModelRunner, StepOutput
from blockdraft.engine.output_processor import OutputProcessor
from blockdraft.engine.scheduler import ScheduledChunk, Scheduler
from blockdraft.engine.sequence import Sequence
from blockdraft.engine.spec_stats import SpecDecodeStats
from blockdraft.engine.tp_workers import TensorParallelWorkers
from blockdraft.engine.warmup import warm_up_eager_steps
from blockdraft.kernels.forward_context import under_kernel_policy
from blockdraft.outputs import RequestOutput
from blockdraft.runtime.feature_ring import FeatureRing
from blockdraft.sampling_params import SamplingParams
from blockdraft.spec_decode.draft_launch import DEFERRED_CONTEXT_MIN_ROWS, LaunchedDrafts
from blockdraft.spec_decode.speculator import build_speculator

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, tp: TensorParallel | None = None) -> None:
        """`tp`: this process's rank when it is a tensor-parallel worker (tp_workers.py); with
        config.tensor_parallel_size > 1 and no `tp`, this engine is the driver (rank 0) and
        starts the workers."""
        self.workers: TensorParallelWorkers | None = None
        if config.tensor_parallel_size > 1 and tp is None:
            self.workers = TensorParallelWorkers(config)
            with self.workers.aborting_on_failure():
                self._start(config, self.workers.tp)
        else:
            self._start(config, tp)

    def _start(self, config: EngineConfig, tp: TensorParallel | None) -> None:
        t0 = time.perf_counter()
        self.config, self.kernel_policy = config, config.kernel_policy
        self.device = torch.device(config.device)
        self.tp = tp
        loaded = load_rank_models(config, self.device, tp)
        if self.device.type == "cpu":  # this machine's BLAS decides how few-row linears run
            self.kernel_policy = cpu_linear_policy(self.kernel_policy, loaded.model, loaded.drafter)
        self.model, self.tokenizer = loaded.model, loaded.tokenizer
        self.generation_defaults = loaded.generation_defaults
        self.eos_token_ids = loaded.eos_token_ids
        self.max_model_len, self.num_spec = loaded.max_model_len, loaded.num_spec
        self.draft_schedule, self.lookahead = loaded.draft_schedule, loaded.lookahead
        rate = getattr(config.speculative_config, "synthetic_acceptance_rate", None)
        self.runner = ModelRunner(self.model, config.block_size, self.device, rate)
        self.proposer, self.draft_launcher, self.draft_length = build_speculator(
            loaded.drafter, self.draft_schedule, self.runner.sampling, config.block_size,
            self.device,
        )  # fmt: skip
        self.block_manager = allocate_kv_pool(config, loaded, self.device, tp)
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens, self.lookahead
        )
        # async_decode: the decode step launched ahead and not read back yet (see async_decode);
        # a speculative engine's steps at N = 0 too (the hooks below).
        hooks = self if self.draft_launcher is not None else None
        self.decode_pipeline = DecodePipeline(
            self.runner, self.scheduler, self.max_model_len, hooks
        )
        # N chosen for the next step when it was asked while launching ahead; the count of
        # freed requests' blocks the drafter's deferred context has seen.
        self.next_num_drafts: int | None = None
        self.frees_seen = 0
        # When the last step that ran something ended (None: none since the engine was idle).
        self.last_step_end: float | None = None
        pages = self.block_manager.window_pages
        if self.draft_launcher is not None and pages is not None:
            # Deferred rows must stay inside the window until written: a page left behind it
            # may pass to another block meanwhile.
            rows = pages.window - config.block_size
            self.draft_launcher.max_deferred_rows = rows
            if rows < DEFERRED_CONTEXT_MIN_ROWS:
                self.draft_launcher.defer_context = False
        elif self.draft_launcher is not None:
            self.block_manager.reallocated = set()
        self.capture_time_s = self.warmup_time_s = 0.0
        if self.device.type == "cuda" and not config.enforce_eager:
            self.capture_graphs(default_batch_sizes(config.max_num_seqs))
        if self.device.type == "cuda":  # Triton compiles now rather than mid-serving
            self.warm_up()
        vocab, max_len = self.model.cfg.vocab_size, self.max_model_len
        self.input_processor = InputProcessor(self.tokenizer, vocab, max_len, config.seed)
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_token_ids, max_len)
        self.spec_stats = SpecDecodeStats(self.num_spec)
        self.requests: dict[str, Sequence] = {}
        # Streaming needs the text of running requests every step; offline generation reads it
        # only when a request finishes (stop strings are checked either way).
        self.detokenize_running = True
        self.load_time_s = time.perf_counter() - t0
        gpu = f" (CUDA graphs {self.capture_time_s:.1f} s, warm-up {self.warmup_time_s:.1f} s)"
        logger.info(
            "engine ready in %.1f s%s", self.load_time_s, gpu * (self.device.type == "cuda")
        )

    @under_kernel_policy
    def capture_graphs(self, batch_sizes: list[int]) -> None:
        """Captures the uniform steps' graphs (blockdraft/engine/cuda_graphs.py)."""
        t0 = time.perf_counter()
        max_blocks = max_blocks_per_seq(self.max_model_len, self.lookahead, self.config.block_size)
        ring = self._feature_ring(max(batch_sizes))
        capture_graphs(
            self.runner, self.proposer, self.draft_schedule, batch_sizes, max_blocks, ring
        )
        self.runner.feature_ring = ring
        if self.draft_launcher is not None:
            self.draft_launcher.feature_ring = ring
        self.capture_time_s = time.perf_counter() - t0

    def _feature_ring(self, max_batch: int) -> FeatureRing | None:
        """Where the decode graphs keep the features of steps whose drafter context waits (as
        many rows as may wait, and a batch): None when none waits."""
        if self.draft_launcher is None or not self.draft_launcher.defer_context:
            return None
        model = self.model
        width = model.cfg.hidden_size * len(model.capture_layer_ids)
        dtype = self.config.torch_dtype
        row_bytes = width * dtype.itemsize
        capacity = self.draft_launcher.deferred_row_limit(row_bytes) + max_batch
        return FeatureRing(capacity, width, max_batch, dtype, self.device)

    @under_kernel_policy
    def warm_up(self) -> None:
        """Runs the eager steps whose kernel variants graph capture does not compile
        (blockdraft/engine/warmup.py)."""
        t0 = time.perf_counter()
        warm_up_eager_steps(
            self.runner, self.draft_launcher, self.draft_schedule, self.max_model_len,
            self.config.max_num_seqs, self.lookahead,
        )  # fmt: skip
        self.warmup_time_s = time.perf_counter() - t0

    # -- requests ----------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
    ) -> None:
        """Validates and queues a request; a ValueError leaves the engine untouched."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = self.input_processor.process(request_id, prompt, params)
        self.requests[request_id] = seq
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> None:
        seq = self.requests.pop(request_id, None)
        if seq is not None and not seq.is_finished:
            seq.finish_reason = "abort"
            self.scheduler.finish(seq)
            # Its row in a decode step launched ahead is discarded when read back.
            self.decode_pipeline.drop_finished_rows()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self.decode_pipeline.inflight is not None

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def shutdown(self) -> None:
        """Stops the tensor-parallel workers, if any (a second call does nothing)."""
        if self.workers is not None:
            self.workers.shutdown()

    # -- one step ------------------------------------------------------------------------
    @torch.inference_mode()
    @under_kernel_policy
    def step(self) -> list[RequestOutput]:
        """Runs one engine step; returns the state of every request that got new tokens or
        finished (finished ones are forgotten afterwards)."""
        if self.workers is not None:
            with self.workers.failing_loudly():
                return self._step()
        return self._step()

    def _step(self) -> list[RequestOutput]:
        if self.config.async_decode:
            if self.draft_launcher is None:
                return self._async_decode_step()
            if self.decode_pipeline.inflight is not None:
                return self._draft_free_step()
        t0 = time.perf_counter()
        chunks = self.scheduler.schedule()
        if not chunks:
            self.last_step_end = None
            return []
        num_drafts, write_first = 0, False
        if self.draft_launcher is not None:
            # N for the batch the next step verifies: every request running now (those the
            # readback will finish included: any N is lossless, verify takes a prefix).
            running = self.scheduler.running
            num_drafts = self.next_num_drafts
            if num_drafts is None:
                num_drafts = self.draft_length.choose((s.acceptance for s in running), len(running))
            self.next_num_drafts = None
            write_first = self.deferred_rows_may_be_overwritten()
        window_updates = self._take_window_updates()
        if self.workers is not None:
            self.workers.send_step(chunks, num_drafts, self.requests, window_updates, write_first)
        self.apply_window_updates(window_updates)
        launched, drafts = self.launch_step(chunks, num_drafts, write_first)
        if self.draft_launcher is None:
            return self._process_step(chunks, self.runner.finish(launched), None)
        self.spec_stats.record_step(num_drafts)
        if not num_drafts and self.config.async_decode:
            self.decode_pipeline.launch_ahead(launched)
        result = self.runner.finish(launched)  # the step's one device-to-host read
        outputs = self._process_step(chunks, result, drafts)
        self.decode_pipeline.drop_finished_rows()
        self.draft_length.record_if_uniform(chunks, num_drafts, self._step_seconds(t0))
        return outputs

    def _step_seconds(self, t0: float) -> float:
        """A step's cost for the draft-length chooser: from the end of the step before it (else
        from `t0`, its start) to now. The host's time between steps (the caller's loop, a
        device sync it makes) is part of what each step costs; and where the caller waits for
        the device, a step launched ahead is read back at once: timed from its own start alone
        it looked ~10x cheaper than it was (a benchmark that synced before every step made
        plain decoding look so cheap that the batch stopped drafting)."""
        end = time.perf_counter()
        start = t0 if self.last_step_end is None else self.last_step_end
        # An engine left with nothing to run may wait for requests (a server): not a cost.
        self.last_step_end = end if self.has_unfinished_requests() else None
        return end - start

    def _take_window_updates(self) -> tuple[list[int], list[int]] | None:
        pages = self.block_manager.window_pages
        return None if pages is None else pages.take_updates()

    def apply_window_updates(self, updates: tuple[list[int], list[int]] | None) -> None:
        """The drafter's window pages the scheduler gave or took back for this step (see
        window_pages.py), into the device map its layers read."""
        if updates is not None:
            self.block_manager.window_pages.apply(*updates)

    def launch_step(
        self, chunks: list[ScheduledChunk], num_drafts: int, write_deferred_first: bool = False
    ) -> tuple[LaunchedStep, LaunchedDrafts | None]:
        """Queues a step's device work and reads nothing back: the target forward with its
        sampling or verification, then, speculating, the drafter's work (before the
        readback, so the GPU drafts while the host processes the step). Tensor-parallel
        workers run it on the driver's chunks."""
        launched = self.runner.launch(chunks)
        if self.draft_launcher is None:
            return launched, None
        target = launched.target_step()
        return launched, self.draft_launcher.launch(target, num_drafts, write_deferred_first)

    def _process_step(
        self, chunks: list[ScheduledChunk], result: StepOutput, drafts: LaunchedDrafts | None
    ) -> list[RequestOutput]:
        """Appends a read-back step's tokens, finishes the requests that stop, and returns
        the outputs of the requests it touched."""
        touched: list[Sequence] = []
        for chunk, tokens, accepted in zip(
            chunks, result.new_tokens, result.num_accepted, strict=True
        ):
            seq = chunk.seq
            if accepted is not None:
                self.spec_stats.record(accepted, chunk.num_drafts)
                self.draft_length.observe(seq.acceptance, accepted, chunk.num_drafts)
                seq.num_computed_tokens = chunk.start + 1 + accepted
                seq.drafts = None
            else:
                seq.num_computed_tokens = chunk.start + len(chunk.token_ids)
            if not tokens:
                continue
            appended = self.output_processor.append(seq, tokens)
            if accepted is not None:
                seq.spec_accept_lengths.append(appended)
            seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens)
            self.block_manager.register_computed_blocks(seq)
            if seq.finish_reason is not None:
                self.scheduler.finish(seq)
            touched.append(seq)
        if drafts is not None:
            # The drafts stay on the device; each surviving proposer keeps its row for its
            # next verify, finished ones drop theirs.
            for i, pending in drafts.pending():
                if not chunks[i].seq.is_finished:
                    chunks[i].seq.drafts = pending
        outputs = []
        for seq in touched:
            if seq.is_finished:
                self.requests.pop(seq.request_id, None)
            elif self.detokenize_running:
                self.output_processor.update_text(seq)
            outputs.append(OutputProcessor.make_output(seq))
        return outputs

    # -- async decode (EngineConfig.async_decode; see blockdraft/engine/async_decode.py) -----
    def _draft_free_step(self) -> list[RequestOutput]:
        """A speculative engine's step while its batch drafts nothing: the decode step launched
        ahead is read back (after the next one is launched, if it drafts nothing too)."""
        t0 = time.perf_counter()
        chunks, result = self.decode_pipeline.advance()
        pipelined = self.decode_pipeline.inflight is not None  # the next step launched ahead
        outputs = self._process_step(chunks, result, None)
        self.decode_pipeline.drop_finished_rows()
        if chunks:
            self.spec_stats.record_step(0)
            self.draft_length.record_if_uniform(chunks, 0, self._step_seconds(t0), pipelined)
        return outputs

    @property
    def blocks_freed_unseen(self) -> bool:
        """Blocks were freed since the last synchronous step wrote the deferred context."""
        return self.block_manager.num_frees != self.frees_seen

    def deferred_rows_may_be_overwritten(self) -> bool:
        """Whether the drafter's deferred context must be written before this step's rows: a
        block some deferred row lies in was taken by another request since the last look. A
        drafter with window pages: whether blocks were freed at all (a freed block's pages may
        pass to any block)."""
        bm = self.block_manager
        if bm.reallocated is None:
            freed = self.blocks_freed_unseen
            self.frees_seen = bm.num_frees
            return freed
        taken = bm.reallocated
        if not taken:  # most steps: nothing changed hands
            return False
        bm.reallocated = set()
        return self.draft_launcher.deferred_rows_lie_in(taken)

    def allow_decode_ahead(self, seqs: list[Sequence]) -> bool:
        """`DecodeAheadHooks`: the next step may be launched ahead when it drafts nothing and
        its rows' context can wait; with window pages, also only when no block was freed since
        the deferred rows were taken (the synchronous step writes them first)."""
        if not self.draft_launcher.defer_context:
            return False
        if self.block_manager.reallocated is None and self.blocks_freed_unseen:
            return False
        self.next_num_drafts = self.draft_length.choose((s.acceptance for s in seqs), len(seqs))
        return self.next_num_drafts == 0

    def decode_ahead_launched(self, step: LaunchedStep) -> None:
        """`DecodeAheadHooks`: keeps the step's rows for the drafter's deferred context."""
        self.next_num_drafts = None
        if self.block_manager.window_pages is not None:
            self.apply_window_updates(self._take_window_updates())
        # A block reserved for the step may hold deferred rows: they are written first.
        chunks = step.chunks
        self.draft_launcher.defer_decode_rows(
            step.features,
            [c.start for c in chunks],
            [c.seq.block_table for c in chunks],
            self.deferred_rows_may_be_overwritten(),
            step.feature_ring_start,
        )

    def _async_decode_step(self) -> list[RequestOutput]:
        """`step` with plain decode pipelined: processes the step the pipeline reads back, then
        drops the rows of the step launched ahead that this one finished."""
        read = self.decode_pipeline.advance()
        if read is None:
            return []
        outputs = self._process_step(*read, None)
        self.decode_pipeline.drop_finished_rows()
        return outputs
