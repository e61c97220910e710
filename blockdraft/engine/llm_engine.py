"""The engine: owns the model, the KV pool, the scheduler and the speculator, and advances every
request by one step per `step()` call."""

from __future__ import annotations

import logging
import time

import torch

from blockdraft.config import EngineConfig
from blockdraft.distributed.tensor_parallel import TensorParallel, building_tensor_parallel
from blockdraft.engine.async_decode import (
    InflightDecode,
    launch_decode_ahead,
    live_rows,
    return_blocks_of_finished,
)
from blockdraft.engine.block_manager import BlockManager
from blockdraft.engine.cuda_graphs import capture_graphs, default_batch_sizes
from blockdraft.engine.input_processor import InputProcessor
from blockdraft.engine.kv_cache import allocate_kv_cache, max_blocks_per_seq, num_kv_blocks
from blockdraft.engine.model_loader import check_tensor_parallel, load_models
from blockdraft.engine.model_runner import LaunchedStep, ModelRunner, StepOutput
from blockdraft.engine.output_processor import OutputProcessor
from blockdraft.engine.scheduler import ScheduledChunk, Scheduler
from blockdraft.engine.sequence import Sequence
from blockdraft.engine.spec_stats import SpecDecodeStats
from blockdraft.engine.tp_workers import TensorParallelWorkers
from blockdraft.engine.warmup import warm_up_eager_steps
from blockdraft.kernels.forward_context import under_kernel_policy
from blockdraft.outputs import RequestOutput
from blockdraft.sampling_params import SamplingParams
from blockdraft.spec_decode.draft_launch import DraftLauncher, LaunchedDrafts
from blockdraft.spec_decode.draft_length import DraftLengthChooser
from blockdraft.spec_decode.drafts import PendingDrafts
from blockdraft.spec_decode.proposer import DFlashProposer

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, tp: TensorParallel | None = None) -> None:
        """`tp`: this process's rank when it is a tensor-parallel worker (tp_workers.py); with
        config.tensor_parallel_size > 1 and no `tp`, this engine is the driver (rank 0) and
        starts the workers."""
        self.workers: TensorParallelWorkers | None = None
        if config.tensor_parallel_size > 1 and tp is None:
            check_tensor_parallel(config)  # before any worker starts
            self.workers = TensorParallelWorkers(config)
            tp = self.workers.tp
        try:
            self._start(config, tp)
        except BaseException:
            if self.workers is not None:
                self.workers.abort("the engine failed to start")
            raise

    def _start(self, config: EngineConfig, tp: TensorParallel | None) -> None:
        t0 = time.perf_counter()
        self.config, self.kernel_policy = config, config.kernel_policy
        self.device = torch.device(config.device)
        self.tp = tp
        if tp is not None:
            # Every rank draws the same random numbers (dummy weights of replicated layers,
            # the synthetic acceptance's coins).
            torch.manual_seed(config.seed)
        with building_tensor_parallel(tp):  # None: unsharded
            loaded = load_models(config, self.device)
        self.model, self.tokenizer = loaded.model, loaded.tokenizer
        self.generation_defaults = loaded.generation_defaults
        self.eos_token_ids = loaded.eos_token_ids
        self.max_model_len, self.num_spec = loaded.max_model_len, loaded.num_spec
        self.draft_schedule, self.lookahead = loaded.draft_schedule, loaded.lookahead
        # N per step: the schedule's for the batch size, or ("auto") chosen from the requests'
        # acceptance and the step costs.
        self.draft_length = self.draft_schedule and DraftLengthChooser.for_device(
            self.draft_schedule, self.device.type
        )
        rate = getattr(config.speculative_config, "synthetic_acceptance_rate", None)
        self.runner = ModelRunner(self.model, config.block_size, self.device, rate)
        self.proposer: DFlashProposer | None = None
        self.draft_launcher: DraftLauncher | None = None
        attention_layers = list(self.model.attention_layers)
        if loaded.drafter is not None:
            self.proposer = DFlashProposer(loaded.drafter, config.block_size)
            self.draft_launcher = DraftLauncher(self.proposer, self.runner.sampling, self.device)
            attention_layers += loaded.drafter.attention_layers
        kv_layers, bs = attention_layers, config.block_size
        # Hybrid models: a state slot per running request, plus a spare that rows of requests
        # without one (warm-up) use.
        hybrid = hasattr(self.model, "allocate_states")
        num_slots = config.max_num_seqs + 1 if hybrid else 0
        state_bytes = num_slots and num_slots * self.model.state_bytes(
            config.torch_dtype, self.lookahead
        )
        num_blocks = num_kv_blocks(
            config, kv_layers, self.device, self.max_model_len, self.lookahead, state_bytes
        )
        if tp is not None:  # one block table for every rank's pool
            num_blocks = tp.min_over_ranks(num_blocks, self.device)
        allocate_kv_cache(kv_layers, num_blocks, bs, config.torch_dtype, self.device)
        if hybrid:
            self.model.allocate_states(num_slots, self.lookahead, config.torch_dtype, self.device)
        prefix_caching = config.enable_prefix_caching and not hybrid
        if hybrid and config.enable_prefix_caching:
            logger.info(
                "prefix caching is off: the model's linear-attention layers keep one recurrent "
                "state per request, not one per cached block"
            )
        self.block_manager = BlockManager(
            num_blocks, bs, prefix_caching, num_state_slots=config.max_num_seqs if hybrid else 0
        )
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens, self.lookahead
        )
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
        # async_decode: the decode step launched ahead and not read back yet (see async_decode).
        self._inflight: InflightDecode | None = None
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
        capture_graphs(self.runner, self.proposer, self.draft_schedule, batch_sizes, max_blocks)
        self.capture_time_s = time.perf_counter() - t0

    @under_kernel_policy
    def warm_up(self) -> None:
        """Runs the eager steps whose kernel variants graph capture does not compile
        (blockdraft/engine/warmup.py)."""
        t0 = time.perf_counter()
        num_drafts = self.draft_schedule.all_num_drafts if self.draft_schedule else []
        warm_up_eager_steps(
            self.runner, self.draft_launcher, num_drafts, self.max_model_len,
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
            if self._inflight is not None:  # its row there is discarded when read back
                self._drop_finished_inflight_rows()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

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
        if self.config.async_decode and self.draft_launcher is None:
            return self._async_decode_step()
        t0 = time.perf_counter()
        chunks = self.scheduler.schedule()
        if not chunks:
            return []
        num_drafts = 0
        if self.draft_launcher is not None:
            # N for the batch the next step verifies: every request running now (those the
            # readback will finish included: any N is lossless, verify takes a prefix).
            running = self.scheduler.running
            num_drafts = self.draft_length.choose((s.acceptance for s in running), len(running))
        if self.workers is not None:
            self.workers.send_step(chunks, num_drafts, self.requests)
        launched, drafts = self.launch_step(chunks, num_drafts)
        if self.draft_launcher is None:
            return self._process_step(chunks, self.runner.finish(launched), None)
        self.spec_stats.record_step(num_drafts)
        result = self.runner.finish(launched)  # the step's one device-to-host read
        outputs = self._process_step(chunks, result, drafts)
        self.draft_length.record_if_uniform(chunks, num_drafts, time.perf_counter() - t0)
        return outputs

    def launch_step(
        self, chunks: list[ScheduledChunk], num_drafts: int
    ) -> tuple[LaunchedStep, LaunchedDrafts | None]:
        """Queues a step's device work and reads nothing back: the target forward with its
        sampling or verification, then, speculating, the drafter's work (before the
        readback, so the GPU drafts while the host processes the step). Tensor-parallel
        workers run it on the driver's chunks."""
        launched = self.runner.launch(chunks)
        if self.draft_launcher is None:
            return launched, None
        return launched, self.draft_launcher.launch(launched.target_step(), num_drafts)

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
            for row, i in enumerate(drafts.proposers):
                seq = chunks[i].seq
                if not seq.is_finished:
                    seq.drafts = PendingDrafts(drafts.batch, row)
        outputs = []
        for seq in touched:
            if seq.is_finished:
                self.requests.pop(seq.request_id, None)
            elif self.detokenize_running:
                self.output_processor.update_text(seq)
            outputs.append(OutputProcessor.make_output(seq))
        return outputs

    # -- async decode (EngineConfig.async_decode; see blockdraft/engine/async_decode.py) -----
    def _async_decode_step(self) -> list[RequestOutput]:
        """`step` with plain decode pipelined: reads back the step launched ahead last call (or
        launches a scheduled one), first launching the next decode step when it is known."""
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            launched = inflight.launched
        else:
            chunks = self.scheduler.schedule()
            if not chunks:
                return []
            launched = self.runner.launch(chunks)
        self._inflight = launch_decode_ahead(
            launched, self.runner, self.scheduler, self.block_manager, self.max_model_len
        )
        result = self.runner.finish(launched)  # still the step's one device-to-host read
        outputs = self._process_step(*live_rows(launched, result), None)
        if self._inflight is not None:
            self._drop_finished_inflight_rows()
        return outputs

    def _drop_finished_inflight_rows(self) -> None:
        """Gives back the blocks of the in-flight rows of requests that finished; forgets the
        in-flight step when no row is left (its queued work needs no readback)."""
        return_blocks_of_finished(self._inflight, self.block_manager)
        if not self._inflight.has_live_rows:
            self._inflight = None
