"""Turns an incoming request into a Sequence: its prompt tokenized and checked, its max_tokens
and seed resolved. A ValueError says what is wrong with the request."""

from __future__ import annotations

import random

from blockdraft.engine.sequence import Sequence
from blockdraft.sampling_params import SamplingParams
from blockdraft.tokenizer import Tokenizer


class InputProcessor:
    def __init__(
        self, tokenizer: Tokenizer | None, vocab_size: int, max_model_len: int, seed: int | None
    ) -> None:
        self.tokenizer, self.vocab_size, self.max_model_len = tokenizer, vocab_size, max_model_len
        self._seed_rng = random.Random(seed)  # seeds of requests that set none

    def process(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> Sequence:
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
            vocab = self.vocab_size
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
        return Sequence(request_id, text, prompt_ids, params, seed, max_tokens)
