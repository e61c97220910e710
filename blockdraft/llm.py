"""Offline Python API, shaped like vLLM's `LLM`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from tqdm.auto import tqdm

from blockdraft.config import EngineConfig, SpeculativeConfig
from blockdraft.engine.llm_engine import LLMEngine
from blockdraft.outputs import RequestOutput
from blockdraft.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """`LLM(model=..., speculative_config={"method": "dflash", "model": DRAFT})`.

    With no `model`, the embedded SmolLM2-135M-Instruct is used, on the CPU with its shipped
    drafter (`speculative_config="auto"`; None turns speculation off). Other keyword arguments are
    EngineConfig fields (blockdraft/config.py), e.g. `async_decode=True`.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        speculative_config: SpeculativeConfig | dict | str | None = "auto",
        **engine_args: object,
    ) -> None:
        self.config = EngineConfig(
            model=model, speculative_config=speculative_config, **engine_args
        )
        self.engine = LLMEngine(self.config)
        self.engine.detokenize_running = False  # generate() returns only finished requests
        self._counter = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's convention: the checkpoint's generation_config.json sets the defaults."""
        return SamplingParams(**self.engine.generation_defaults)

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
        ids = []
        try:
            for prompt, params in zip(prompts, sampling_params, strict=True):
                request_id = str(next(self._counter))
                self.engine.add_request(request_id, prompt, params)
                ids.append(request_id)
        except ValueError:
            for request_id in ids:  # a bad prompt rejects the whole call, and leaves no trace
                self.engine.abort_request(request_id)
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


def _check_messages(messages: object) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(
            m.get("content"), str
        ):
            raise ValueError("each message must be a dict with string 'role' and 'content'")
