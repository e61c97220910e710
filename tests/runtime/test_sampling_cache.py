"""`blockdraft.runtime.sampling_cache`: the cached per-batch sampling tensors equal freshly
built ones, whatever the batch's order, within the cache's size."""

import random

import torch

from blockdraft import SamplingParams
from blockdraft.engine.sequence import Sequence
from blockdraft.kernels.host_tensors import int64_tensors
from blockdraft.runtime.sampling_cache import SamplingTensorCache, sampling_tensors


def make_seq(prompt: list[int], params: SamplingParams, max_tokens: int = 1000) -> Sequence:
    return Sequence("r", None, prompt, params, seed=7, max_tokens=max_tokens)


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
