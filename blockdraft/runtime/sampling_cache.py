"""Per-request sampling parameters as device tensors: built once per batch composition and
shared by the target's sampling, the verify and the drafter's draft sampling."""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

from blockdraft.layers.sampler import SamplingTensors
from blockdraft.sampling_params import SamplingParams


class SamplingRequest(Protocol):
    """What sampling reads of a request (the engine's Sequence); hashed by identity."""

    params: SamplingParams
    seed: int  # resolved: the request's own or one drawn from the engine's seed


def sampling_tensors(
    requests: list[SamplingRequest], positions: list[int], device: torch.device
) -> SamplingTensors:
    return SamplingTensors.from_lists(
        temperature=[r.params.temperature for r in requests],
        top_k=[r.params.top_k for r in requests],
        top_p=[r.params.top_p for r in requests],
        min_p=[r.params.min_p for r in requests],
        seed=[r.seed for r in requests],
        position=positions,
        device=device,
    )


class SamplingTensorCache:
    """Sampling parameters of a batch of requests on the device, built once per batch
    composition: they are constant per request, and consecutive steps mostly run the same
    requests in the same order. Only the positions are new each step."""

    def __init__(self, device: torch.device, max_entries: int = 4) -> None:
        self.device, self.max_entries = device, max_entries
        self._entries: dict[tuple[SamplingRequest, ...], SamplingTensors] = {}

    def get(
        self,
        requests: list[SamplingRequest],
        position: torch.Tensor,  # [len(requests)] int64 on the device
    ) -> SamplingTensors:
        key = tuple(requests)  # requests compare by identity
        st = self._entries.get(key)
        if st is None:
            st = sampling_tensors(requests, [0] * len(requests), self.device)
            if len(self._entries) >= self.max_entries:
                del self._entries[next(iter(self._entries))]  # the oldest
            self._entries[key] = st
        return dataclasses.replace(st, position=position)
