"""The engine: owns the model, the KV pool, the scheduler and the speculator, and advances every
request by one step per `step()` call."""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from pathlib import Path

import torch

from blockdraft.config import EngineConfig
from blockdraft.engine.async_decode import (
    InflightDecode,
    plan_decode_ahead,
    reserve_blocks,
    return_blocks_of_finished,
)
from blockdraft.engine.block_manager import BlockManager
from blockdraft.engine.cuda_graphs import CUDAGraphRunner, ForwardFn, default_batch_sizes
from blockdraft.engine.draft_launcher import (
    DraftLauncher,
    GraphedContext,
    LaunchedDrafts,
    run_drafter_block,
)
from blockdraft.engine.model_runner import (
    LaunchedStep,
    ModelRunner,
    StepOutput,
    allocate_kv_cache,
    kv_bytes_per_block,
)
from blockdraft.engine.output_processor import OutputProcessor
from blockdraft.engine.scheduler import ScheduledChunk, Scheduler
from blockdraft.engine.sequence import PendingDrafts, Sequence
from blockdraft.engine.spec_stats import SpecDecodeStats
from blockdraft.engine.warmup import warm_up_eager_steps
from blockdraft.models.decoder import DecoderLM, fuse_projections
from blockdraft.models.dflash import DFlashConfig, load_drafter
from blockdraft.models.loader import (
    init_dummy_weights,
    iter_checkpoint_tensors,
    load_weights,
    read_checkpoint,
    read_json,
)
from blockdraft.models.model_config import TransformerConfig
from blockdraft.outputs import RequestOutput
from blockdraft.sampling_params import SamplingParams
from blockdraft.spec_decode.dflash import DFlashProposer
from blockdraft.spec_decode.draft_schedule import DraftSchedule, default_num_drafts

logger = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_LEN = 4096


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        t0 = time.perf_counter()
        self.config = config
        self.device = torch.device(config.device)
        model_path = config.model
        if model_path is None:
            from blockdraft.models.gguf_loader import default_model_path

            model_path = default_model_path()
        ckpt = read_checkpoint(model_path, config.load_format)
        target_cfg = TransformerConfig.from_hf(ckpt.hf_config)
        self.tokenizer = ckpt.tokenizer
        self.generation_defaults = ckpt.generation_defaults
        if (config.max_model_len or 0) > target_cfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len {config.max_model_len} exceeds the model's "
                f"max_position_embeddings ({target_cfg.max_position_embeddings})"
            )
        self.max_model_len = config.max_model_len or min(
            target_cfg.max_position_embeddings, DEFAULT_MAX_MODEL_LEN
        )
        spec = config.speculative_config
        draft_cfg, self.num_spec, self.draft_schedule = None, 0, None
        if spec is not None:  # a drafter that does not fit fails here, before any weights load
            draft_cfg = DFlashConfig.from_hf(read_json(Path(spec.model) / "config.json"))
            draft_cfg.check_fits(target_cfg)
            self.num_spec = spec.num_speculative_tokens or default_num_drafts(
                draft_cfg.block_size, self.device.type
            )
            if self.num_spec > draft_cfg.block_size - 1:
                raise ValueError(
                    f"num_speculative_tokens {self.num_spec} exceeds the drafter's "
                    f"block_size - 1 ({draft_cfg.block_size - 1})"
                )
            self.draft_schedule = DraftSchedule.resolve(
                spec.num_speculative_tokens_by_batch, self.num_spec, self.device.type
            )
        # Rows past the committed tokens a step may write (anchor + N masks), for any N the
        # draft schedule picks (all are <= num_spec).
        self.lookahead = lookahead = self.num_spec + 1 if self.num_spec else 0
        # RoPE tables cover the block the drafter writes past the last committed token.
        max_positions = max(target_cfg.max_position_embeddings, self.max_model_len + 2 * lookahead)
        target_cfg = dataclasses.replace(target_cfg, max_position_embeddings=max_positions)

        dtype = config.torch_dtype
        with torch.device(self.device):
            self.model = DecoderLM(target_cfg).to(dtype)
        if config.load_format == "dummy":
            init_dummy_weights(self.model)
        else:
            load_weights(
                dict(self.model.named_parameters()),
                iter_checkpoint_tensors(ckpt),
                str(model_path),
                ignore=lambda name: (
                    "rotary_emb" in name
                    or (name == "lm_head.weight" and target_cfg.tie_word_embeddings)
                ),
            )
        eos_token_ids = ckpt.eos_token_ids
        del ckpt
        self.model.eval().requires_grad_(False)
        fuse_projections(self.model)

        self.proposer: DFlashProposer | None = None
        attention_layers = list(self.model.attention_layers)
        if spec is not None:
            drafter = load_drafter(
                spec.model,
                self.model,
                max_positions,
                dtype,
                self.device,
                dummy=config.load_format == "dummy",
                cfg=draft_cfg,
            )
            fuse_projections(drafter)
            self.model.capture_layer_ids = drafter.cfg.target_layer_ids
            attention_layers += drafter.attention_layers
            self.proposer = DFlashProposer(
                drafter,
                config.block_size,
                lambda inputs, num_reqs, tables, max_seq_len, context: run_drafter_block(
                    self.proposer, self.drafter_graphs, self.drafter_contexts, inputs, num_reqs,
                    tables, max_seq_len, context,
                ),  # fmt: skip
            )

        num_blocks = self._num_kv_blocks(attention_layers, dtype, lookahead)
        allocate_kv_cache(attention_layers, num_blocks, config.block_size, dtype, self.device)
        self.block_manager = BlockManager(
            num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens, lookahead
        )
        self.runner = ModelRunner(
            self.model,
            config.block_size,
            self.device,
            spec.synthetic_acceptance_rate if spec is not None else None,
        )
        self.drafter_graphs: dict[int, CUDAGraphRunner] = {}
        self.drafter_contexts: dict[int, GraphedContext] = {}  # their context K/V inputs
        self.draft_launcher: DraftLauncher | None = None
        if self.proposer is not None:
            self.draft_launcher = DraftLauncher(self.proposer, self.runner.sampling, self.device)
        self.capture_time_s = self.warmup_time_s = 0.0
        if self.device.type == "cuda" and not config.enforce_eager:
            self.capture_graphs(default_batch_sizes(config.max_num_seqs))
        if self.device.type == "cuda":  # Triton compiles now rather than mid-serving
            self.warm_up()
        self.output_processor = OutputProcessor(self.tokenizer, eos_token_ids, self.max_model_len)
        self.eos_token_ids = eos_token_ids
        self.spec_stats = SpecDecodeStats(self.num_spec)
        self.requests: dict[str, Sequence] = {}
        self._seed_rng = random.Random(config.seed)
        # Streaming needs the text of running requests every step; offline generation reads it
        # only when a request finishes (stop strings are checked either way).
        self.detokenize_running = True
        # async_decode: the decode step launched ahead and not read back yet (see async_decode).
        self._inflight: InflightDecode | None = None
        self.load_time_s = time.perf_counter() - t0
        logger.info(
            "engine ready in %.1f s (CUDA graphs captured in %.1f s, eager kernels warmed up "
            "in %.1f s)", self.load_time_s, self.capture_time_s, self.warmup_time_s,
        )

    def capture_graphs(self, batch_sizes: list[int]) -> None:
        """Captures the uniform steps: decode at every batch bucket; verify (target) and
        propose (drafter) of 1+N rows for each N of the draft schedule, at the buckets of the
        batch sizes that use that N. Off CUDA the graphs are eager twins (tests)."""
        t0 = time.perf_counter()
        max_blocks = self._max_blocks_per_seq(self.lookahead)
        pool = None

        def capture(forward: ForwardFn, q: int, sizes: list[int]) -> CUDAGraphRunner:
            nonlocal pool
            runner = CUDAGraphRunner(
                forward, q, sizes, max_blocks, self.config.block_size, self.device, pool
            )
            runner.capture()
            pool = runner.pool
            return runner

        self.runner.graphs[1] = capture(self.model, 1, batch_sizes)
        for n in self.draft_schedule.all_num_drafts if self.draft_schedule else []:
            if n == 0:  # no drafts: the steps after are plain decodes (graphs[1])
                continue
            sizes = self.draft_schedule.graph_batch_sizes(n, batch_sizes)
            if not sizes:  # only batches above max_num_seqs would use this N
                continue
            self.runner.graphs[n + 1] = capture(self.model, n + 1, sizes)
            graphed = GraphedContext(self.proposer.drafter, sizes[-1] * (n + 1), self.device)
            self.drafter_contexts[n + 1] = graphed
            self.drafter_graphs[n + 1] = capture(graphed.forward, n + 1, sizes)
            self._compile_draft_inputs(n)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.capture_time_s = time.perf_counter() - t0

    def warm_up(self) -> None:
        """Runs the eager steps whose kernel variants graph capture does not compile
        (blockdraft/engine/warmup.py)."""
        t0 = time.perf_counter()
        num_drafts = self.draft_schedule.num_drafts(1) if self.draft_schedule else 0
        warm_up_eager_steps(
            self.runner, self.draft_launcher, num_drafts, self.max_model_len,
            self.config.max_num_seqs, self.lookahead,
        )  # fmt: skip
        self.warmup_time_s = time.perf_counter() - t0

    def _compile_draft_inputs(self, num_drafts: int) -> None:
        """Runs the drafter-input kernel once for N = num_drafts on a dummy request, so that
        its Triton compile happens here and not in the first step that drafts N tokens.
        Writes only fresh output buffers."""
        zero, one = (torch.full((1,), v, dtype=torch.int64, device=self.device) for v in (0, 1))
        tables = torch.zeros(1, 1, dtype=torch.int64, device=self.device)
        self.proposer.prepare_inputs(zero, one, zero, one, zero, tables, num_drafts, 1)

    def _max_blocks_per_seq(self, lookahead: int) -> int:
        # A verify at the length limit holds N draft rows past the last token, and the drafter
        # writes its block (lookahead rows) past the new anchor: 2 * lookahead covers both.
        return -(-(self.max_model_len + 2 * lookahead) // self.config.block_size)

    def _num_kv_blocks(self, layers: list, dtype: torch.dtype, lookahead: int) -> int:
        cfg = self.config
        per_seq = self._max_blocks_per_seq(lookahead)
        per_block = kv_bytes_per_block(layers, cfg.block_size, dtype)

        def _gib(num_bytes: float) -> str:
            return f"{num_bytes / 2**30:.2f} GiB"

        if cfg.num_kv_blocks is not None:
            num_blocks = cfg.num_kv_blocks
            room = f"num_kv_blocks {num_blocks} holds {_gib(num_blocks * per_block)}"
            fix = f"raise num_kv_blocks to at least {per_seq} or lower max_model_len"
        else:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                total = torch.cuda.get_device_properties(self.device).total_memory
                kept = (1 - cfg.gpu_memory_utilization) * total
                budget = free - kept
                room = (
                    f"{_gib(free)} is free after the weights, of which gpu_memory_utilization "
                    f"{cfg.gpu_memory_utilization} keeps {_gib(kept)} back"
                )
                fix = (
                    "raise gpu_memory_utilization or lower max_model_len (or free the GPU: "
                    "LLM.shutdown() an engine no longer used)"
                )
            else:
                budget = cfg.kv_cache_memory_gib * 2**30
                room = f"kv_cache_memory_gib gives it {_gib(budget)}"
                fix = "raise kv_cache_memory_gib or lower max_model_len"
            num_blocks = min(int(budget // per_block), per_seq * cfg.max_num_seqs)
        if num_blocks < per_seq:
            raise ValueError(
                f"the KV cache needs {_gib(per_seq * per_block)} for one request of "
                f"max_model_len {self.max_model_len}, but {room}: {fix}"
            )
        return num_blocks

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
        if not isinstance(params, SamplingParams):
            raise ValueError("sampling params must be a SamplingParams")
        text = None
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass token ids")
            text, prompt_ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, list | tuple):
            prompt_ids = list(prompt)
            vocab = self.model.cfg.vocab_size
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt_ids):
                raise ValueError("prompt token ids must be integers")
            if any(not 0 <= t < vocab for t in prompt_ids):
                raise ValueError(f"prompt token ids must be in [0, {vocab})")
        else:
            raise ValueError("prompt must be a string or a list of token ids")
        if not prompt_ids:
            raise ValueError("prompt is empty")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens, but max_model_len is "
                f"{self.max_model_len}: it must leave room for at least one new token"
            )
        room = self.max_model_len - len(prompt_ids)
        max_tokens = min(params.max_tokens or room, room)
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(62)
        seq = Sequence(request_id, text, prompt_ids, params, seed, max_tokens)
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

    # -- one step ------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Runs one engine step; returns the state of every request that got new tokens or
        finished (finished ones are forgotten afterwards)."""
        if self.config.async_decode and self.draft_launcher is None:
            return self._async_decode_step()
        chunks = self.scheduler.schedule()
        if not chunks:
            return []
        launched = self.runner.launch(chunks)
        drafts = None
        if self.draft_launcher is not None:
            # Queued before the readback, so the GPU drafts while the host processes the step.
            # N by the batch the next step verifies: every request running now (those the
            # readback will finish included: any N is lossless, verify takes a prefix).
            num_drafts = self.draft_schedule.num_drafts(self.num_running)
            drafts = self.draft_launcher.launch(launched, num_drafts)
        result = self.runner.finish(launched)  # the step's one device-to-host read
        return self._process_step(chunks, result, drafts)

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
        self._inflight = self._launch_decode_ahead(launched)
        result = self.runner.finish(launched)  # still the step's one device-to-host read
        # Rows of requests that stopped or were aborted after this step was launched ahead.
        live = [i for i, c in enumerate(launched.chunks) if not c.seq.is_finished]
        outputs = self._process_step(
            [launched.chunks[i] for i in live],
            StepOutput(
                [result.new_tokens[i] for i in live], [result.num_accepted[i] for i in live]
            ),
            None,
        )
        if self._inflight is not None:
            self._drop_finished_inflight_rows()
        return outputs

    def _launch_decode_ahead(self, launched: LaunchedStep) -> InflightDecode | None:
        """Launches the decode step after `launched`, or None (drain) when it is not known."""
        chunks = plan_decode_ahead(launched, self.scheduler, self.max_model_len)
        if chunks is None:
            return None
        new_blocks = reserve_blocks(self.block_manager, [c.seq for c in chunks])
        if new_blocks is None:
            return None
        return InflightDecode(self.runner.launch_decode_ahead(chunks, launched), new_blocks)

    def _drop_finished_inflight_rows(self) -> None:
        """Gives back the blocks of the in-flight rows of requests that finished; forgets the
        in-flight step when no row is left (its queued work needs no readback)."""
        return_blocks_of_finished(self._inflight, self.block_manager)
        if not self._inflight.has_live_rows:
            self._inflight = None
