"""Offline Python API, shaped like vLLM's `LLM`."""

from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
import sys
from collections.abc import Sequence

import torch
from tqdm.auto import tqdm

from blockdraft.assets import default_drafter_path
from blockdraft.config import EngineConfig, SpeculativeConfig, check_can_run
from blockdraft.engine.llm_engine import LLMEngine
from blockdraft.outputs import RequestOutput
from blockdraft.sampling_params import SamplingParams
from blockdraft.threads import ThreadChoice, apply_num_threads

logger = logging.getLogger(__name__)

Prompt = str | list[int]


class LLM:
    """`LLM(model=..., speculative_config={"method": "dflash", "model": DRAFT})`.

    With no `model`, the embedded SmolLM2-135M-Instruct is used, on the CPU with its shipped
    drafter (`speculative_config="auto"`; None turns speculation off). Other keyword arguments are
    EngineConfig fields (blockdraft/config.py), e.g. `async_decode=True`, `num_threads=1`.

    `shutdown()` (or leaving a `with LLM(...) as llm:` block, or deleting the last reference)
    frees the model, the drafter, the KV cache and the CUDA graphs at once.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        speculative_config: SpeculativeConfig | dict | str | None = "auto",
        **engine_args: object,
    ) -> None:
        self.engine: LLMEngine | None = None
        _check_engine_args(engine_args)
        self.config = EngineConfig(
            model=model, speculative_config=speculative_config, **engine_args
        )
        check_can_run(self.config)
        self.threads = apply_num_threads(self.config.num_threads)
        self.engine = LLMEngine(self.config)
        self.engine.detokenize_running = False  # generate() returns only finished requests
        self._counter = itertools.count()
        logger.info("%s", describe_engine(self.engine, self.threads))

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __del__(self) -> None:
        if not sys.is_finalizing():  # at interpreter exit everything goes anyway
            self.shutdown()

    def shutdown(self) -> None:
        """Frees the engine's memory now (device memory included); the LLM is unusable after.
        A second call does nothing."""
        engine, self.engine = getattr(self, "engine", None), None
        if engine is None:
            return
        on_cuda = engine.device.type == "cuda"
        engine.shutdown()  # its tensor-parallel workers, if any
        # The engine's parts reference each other (the drafter's step callback holds the
        # engine), so dropping the engine alone frees nothing until the garbage collector runs,
        # and a new engine sized from free GPU memory would find the old one still there.
        # Clearing its attributes frees the model, KV cache, graphs and drafter by refcount.
        vars(engine).clear()
        del engine
        if on_cuda:  # any cycle left, then the allocator's cache back to the driver
            gc.collect()
            torch.cuda.empty_cache()

    def _live_engine(self) -> LLMEngine:
        if self.engine is None:
            raise RuntimeError("this LLM was shut down; create a new one")
        return self.engine

    @property
    def tokenizer(self):
        return self._live_engine().tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's convention: the checkpoint's generation_config.json sets the defaults."""
        return SamplingParams(**self._live_engine().generation_defaults)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        engine = self._live_engine()
        ids = []
        try:
            for prompt, params in zip(prompts, sampling_params, strict=True):
                request_id = str(next(self._counter))
                engine.add_request(request_id, prompt, params)
                ids.append(request_id)
        except ValueError:
            for request_id in ids:  # a bad prompt rejects the whole call, and leaves no trace
                engine.abort_request(request_id)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """Generates the reply to each conversation; with `continue_final_message` (and
        `add_generation_prompt=False`), continues each conversation's final assistant message."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so no chat template")
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = []
        for conversation in conversations:
            _check_messages(conversation)
            prompts.append(
                self.tokenizer.encode_chat(
                    conversation, add_generation_prompt, continue_final_message
                )
            )
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        pending = set(ids)
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Generating", disable=not use_tqdm) as bar:
            while pending:
                for out in self.engine.step():
                    if out.finished and out.request_id in pending:
                        finished[out.request_id] = out
                        pending.discard(out.request_id)
                        bar.update(1)
        return [finished[i] for i in ids]


def _check_engine_args(engine_args: dict) -> None:
    """An unknown keyword (a vLLM-only one, a typo) names the ones that exist."""
    known = [f.name for f in dataclasses.fields(EngineConfig) if f.init]
    unknown = sorted(set(engine_args) - set(known))
    if unknown:
        raise ValueError(
            f"LLM got unknown argument(s) {', '.join(unknown)}; it takes {', '.join(known)}"
        )


def describe_engine(engine: LLMEngine, threads: ThreadChoice) -> str:
    """One line naming what runs: target, drafter, device, dtype and CPU threads."""
    cfg = engine.config
    model = cfg.model or "SmolLM2-135M-Instruct (embedded)"
    spec = cfg.speculative_config
    if spec is None:
        drafter = "no drafter"
    else:
        shipped = spec.model == default_drafter_path()
        drafter = "the shipped SmolLM2 drafter" if shipped else f"drafter {spec.model}"
        drafts = f"up to {engine.num_spec} draft{'s' if engine.num_spec > 1 else ''} a step"
        draft_cfg = engine.proposer.drafter.cfg if engine.proposer is not None else None
        if draft_cfg is not None and draft_cfg.draft_vocab_size is not None:  # token map, d2t
            vocab = draft_cfg.body.vocab_size
            drafts += f" from {draft_cfg.draft_vocab_size:,} of {vocab:,} tokens"
        drafter += f" ({drafts})"
    ranks = cfg.tensor_parallel_size
    device = f"device {cfg.device}" + (f" x {ranks} tensor-parallel ranks" if ranks > 1 else "")
    return (
        f"{model}, {drafter}, {device}, {cfg.dtype}, "
        f"{threads.num_threads} CPU thread{'s' if threads.num_threads > 1 else ''} "
        f"({threads.reason})"
    )


def _check_messages(messages: object) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    for m in messages:
        if (
            not isinstance(m, dict)
            or not isinstance(m.get("role"), str)
            or not isinstance(m.get("content"), str)
        ):
            raise ValueError("each message must be a dict with string 'role' and 'content'")
