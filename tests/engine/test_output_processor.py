"""`blockdraft.engine.output_processor`: appending several tokens at once (no stop strings)
finishes a request exactly where appending them one by one would, on random inputs."""

import random

from blockdraft import SamplingParams
from blockdraft.engine.output_processor import OutputProcessor
from blockdraft.engine.sequence import Sequence

EOS = 2


def make_seq(prompt: list[int], params: SamplingParams, max_tokens: int = 1000) -> Sequence:
    return Sequence("r", None, prompt, params, seed=7, max_tokens=max_tokens)


def append_token_by_token(proc: OutputProcessor, seq: Sequence, tokens: list[int]) -> int:
    """The per-token rule `append` implements (stop strings aside)."""
    params = seq.params
    for count, tok in enumerate(tokens, start=1):
        seq.token_ids.append(tok)
        if not params.ignore_eos and tok in proc.eos_token_ids:
            seq.finish_reason = "stop"
        elif tok in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", tok
        elif seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= proc.max_model_len:
            seq.finish_reason = "length"
        if seq.finish_reason is not None:
            return count
    return len(tokens)


def test_append_without_stop_strings_matches_token_by_token(py_rng: random.Random) -> None:
    proc = OutputProcessor(None, [EOS], max_model_len=40)
    for _ in range(300):
        params = SamplingParams(
            stop_token_ids=py_rng.sample(range(3, 12), py_rng.randrange(3)),
            ignore_eos=py_rng.random() < 0.3,
        )
        prompt = [20] * py_rng.randrange(1, 30)
        max_tokens = py_rng.randrange(1, 15)
        got, want = make_seq(prompt, params, max_tokens), make_seq(prompt, params, max_tokens)
        while got.finish_reason is None:
            tokens = [py_rng.randrange(0, 40) for _ in range(py_rng.randrange(1, 9))]
            assert proc.append(got, tokens) == append_token_by_token(proc, want, tokens)
            assert (got.token_ids, got.finish_reason, got.stop_reason) == (
                want.token_ids,
                want.finish_reason,
                want.stop_reason,
            )
