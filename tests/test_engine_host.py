"""Host-side engine bookkeeping against straightforward references, on random inputs: the
prefix-cache keys built incrementally, token appending without stop strings, and the cached
per-batch sampling tensors."""

import random

import pytest
import torch

from blockdraft import SamplingParams
from blockdraft.engine.block_manager import BlockManager
from blockdraft.engine.output_processor import OutputProcessor
from blockdraft.engine.sequence import Sequence
from blockdraft.runtime.host_batch import int64_tensors
from blockdraft.runtime.sampling_cache import SamplingTensorCache, sampling_tensors

EOS = 2


def make_seq(prompt: list[int], params: SamplingParams, max_tokens: int = 1000) -> Sequence:
    return Sequence("r", None, prompt, params, seed=7, max_tokens=max_tokens)


@pytest.fixture
def py_rng(rng: torch.Generator) -> random.Random:
    return random.Random(int(torch.randint(0, 2**31, (1,), generator=rng)))


def test_prefix_keys_registered_step_by_step_match_one_shot(py_rng: random.Random) -> None:
    """Blocks registered one step at a time (a decode) get the same chained keys as blocks
    registered all at once; a second request with the same tokens then finds all of them."""
    block_size = 4
    tokens = [py_rng.randrange(100) for _ in range(61)]
    manager = BlockManager(64, block_size, enable_prefix_caching=True)
    seq = make_seq(tokens[:5], SamplingParams())
    for n in range(5, len(tokens) + 1):  # computed tokens grow by one or two per step
        seq.token_ids = tokens[:n]
        assert manager.ensure_capacity(seq, n)
        seq.num_computed_tokens = n - py_rng.randrange(2)
        manager.register_computed_blocks(seq)
    incremental = dict(manager.cached)

    one_shot = BlockManager(64, block_size, enable_prefix_caching=True)
    other = make_seq(tokens, SamplingParams())
    assert one_shot.ensure_capacity(other, len(tokens))
    other.num_computed_tokens = len(tokens)
    one_shot.register_computed_blocks(other)
    assert list(incremental) == list(one_shot.cached)

    again = make_seq(tokens, SamplingParams())
    assert manager.allocate_cached_prefix(again) == (len(tokens) - 1) // block_size * block_size
    assert again.block_table == seq.block_table[: len(again.block_table)]
    # ... and keeps chaining from the shared prefix after a recompute.
    again.num_computed_tokens = len(tokens)
    assert manager.ensure_capacity(again, len(tokens))
    manager.register_computed_blocks(again)
    assert list(manager.cached) == list(incremental)


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


def test_sampling_tensor_cache(py_rng: random.Random) -> None:
    seqs = [
        make_seq([1], SamplingParams(temperature=py_rng.random(), top_k=py_rng.randrange(5)))
        for _ in range(3)
    ]
    cache = SamplingTensorCache(torch.device("cpu"), max_entries=2)
    for batch in ([0, 1, 2], [2, 0], [0, 1, 2], [1], [2, 0]):
        chosen = [seqs[i] for i in batch]
        positions = [py_rng.randrange(100) for _ in batch]
        (position,) = int64_tensors(torch.device("cpu"), positions)
        got = cache.get(chosen, position)
        want = sampling_tensors(chosen, positions, torch.device("cpu"))
        for field in ("temperature", "top_k", "top_p", "min_p", "seed", "position"):
            assert torch.equal(getattr(got, field), getattr(want, field)), field
        assert (got.all_greedy, got.uses_top_k_top_p) == (want.all_greedy, want.uses_top_k_top_p)
    assert len(cache._entries) == 2


def test_int64_tensors(py_rng: random.Random) -> None:
    parts = [[py_rng.randrange(-99, 99) for _ in range(py_rng.randrange(6))] for _ in range(5)]
    parts[0] = parts[0][:1] or [7]  # an odd length first, an empty part next
    parts[1] = []
    views = int64_tensors(torch.device("cpu"), *parts)
    assert [v.tolist() for v in views] == parts
    assert all(v.dtype == torch.int64 and v.is_contiguous() for v in views)
    # 16-byte aligned views whatever the lengths before them (odd ones included): Triton
    # specialises kernels on pointer alignment.
    assert all(v.data_ptr() % 16 == 0 for v in views)
