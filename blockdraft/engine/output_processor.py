"""Appends sampled tokens to a request one by one, stopping it at eos, a stop token, a stop
string, max_tokens or max_model_len, and keeps its detokenized text current."""

from __future__ import annotations

from blockdraft.engine.sequence import Sequence
from blockdraft.outputs import CompletionOutput, RequestOutput
from blockdraft.tokenizer import Tokenizer


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, eos_token_ids: list[int], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len

    def append(self, seq: Sequence, tokens: list[int]) -> int:
        """Appends tokens until the request finishes; returns how many were appended."""
        if seq.params.stop:
            return self._append_checking_text(seq, tokens)
        return self._append_ids(seq, tokens)

    def _append_ids(self, seq: Sequence, tokens: list[int]) -> int:
        """`append` without stop strings: only token ids and lengths can finish the request,
        so find where it finishes and extend once (no per-token bookkeeping on the hot path)."""
        params = seq.params
        room = min(seq.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens)
        count = min(len(tokens), max(room, 1))  # the token reaching a limit is still appended
        finish = "length" if count == max(room, 1) else None
        for i, tok in enumerate(tokens[:count]):
            if not params.ignore_eos and tok in self.eos_token_ids:
                count, finish = i + 1, "stop"
                break
            if tok in params.stop_token_ids:
                count, finish = i + 1, "stop"
                seq.stop_reason = tok
                break
        seq.token_ids.extend(tokens[:count])
        if finish is not None:
            seq.finish_reason = finish
            self.update_text(seq)
        return count

    def _append_checking_text(self, seq: Sequence, tokens: list[int]) -> int:
        params = seq.params
        for count, tok in enumerate(tokens, start=1):
            seq.token_ids.append(tok)
            if not params.ignore_eos and tok in self.eos_token_ids:
                seq.finish_reason = "stop"
            elif tok in params.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", tok
            elif params.stop and self._hit_stop_string(seq):
                pass
            elif seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
                seq.finish_reason = "length"
            if seq.finish_reason is not None:
                self.update_text(seq)
                return count
        return len(tokens)

    def update_text(self, seq: Sequence) -> None:
        if self.tokenizer is None or seq.stop_reason in seq.params.stop:
            return  # no tokenizer, or text already cut at a stop string
        seq.text = self.tokenizer.decode(
            seq.output_token_ids, skip_special_tokens=seq.params.skip_special_tokens
        )

    def _hit_stop_string(self, seq: Sequence) -> bool:
        if self.tokenizer is None:
            return False
        previous = len(seq.text)
        self.update_text(seq)
        # Only text new since the last token can complete a stop string.
        horizon = max(0, previous - max(len(s) for s in seq.params.stop) + 1)
        hits = [(seq.text.find(s, horizon), s) for s in seq.params.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return False
        index, stop = min(hits)
        seq.text = seq.text[:index]
        seq.finish_reason, seq.stop_reason = "stop", stop
        return True

    @staticmethod
    def make_output(seq: Sequence) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            outputs=[
                CompletionOutput(
                    index=0,
                    text=seq.text,
                    token_ids=seq.output_token_ids,  # a fresh slice
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            ],
            finished=seq.finish_reason is not None,
            spec_accept_lengths=list(seq.spec_accept_lengths),
            num_cached_tokens=seq.num_cached_tokens,
        )
