"""Batched token sampling: temperature, top-k, top-p, min-p, per-request seeds.

Randomness comes from a counter-based hash of (seed, position, salt, column) rather
than from torch.Generator objects, so a seeded request draws the same token no
matter which other requests share its batch or in which row it sits, and the whole
thing runs with no host synchronisation. The hash and the exponential race over it are
specified in `blockdraft.kernels.sampling`, with Triton twins (`kernels.triton_sampling`, one
launch instead of ~85) chosen per call by `blockdraft.kernels.select`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from blockdraft.kernels.host_tensors import host_tensors, int64_tensors
from blockdraft.kernels.select import get_exponential_race_backend


@dataclass
class SamplingTensors:
    """Sampling parameters, one row per token to sample."""

    temperature: torch.Tensor  # [R] float32; 0 => greedy
    top_k: torch.Tensor  # [R] int64; 0 => off
    top_p: torch.Tensor  # [R] float32; 1.0 => off
    min_p: torch.Tensor  # [R] float32; 0.0 => off
    seed: torch.Tensor  # [R] int64 per-request seed (0 <= seed < 2**63)
    position: torch.Tensor  # [R] int64 sequence position of the token being sampled
    # Host-side hints, known for free when built from Python lists. They only let us
    # skip work (or return None from sample_drafts) without reading tensors back from
    # the device; None means "unknown" and takes the always-correct general path.
    all_greedy: bool | None = None
    any_greedy: bool | None = None
    uses_top_k_top_p: bool | None = None

    @classmethod
    def from_lists(
        cls,
        temperature: Sequence[float],
        top_k: Sequence[int],
        top_p: Sequence[float],
        min_p: Sequence[float],
        seed: Sequence[int],
        position: Sequence[int],
        device: torch.device | str,
    ) -> SamplingTensors:
        n = len(temperature)
        if not all(len(x) == n for x in (top_k, top_p, min_p, seed, position)):
            raise ValueError("all sampling parameter lists must have the same length")
        if any(t < 0 for t in temperature):
            raise ValueError("temperature must be >= 0")
        if any(not 0.0 < p <= 1.0 for p in top_p):
            raise ValueError("top_p must be in (0, 1]")
        if any(not 0.0 <= p <= 1.0 for p in min_p):
            raise ValueError("min_p must be in [0, 1]")
        if any(not 0 <= s < 2**63 for s in seed):
            raise ValueError("seed must be in [0, 2**63)")
        sampled = [t > 0 for t in temperature]
        # One page-locked copy per dtype: a tensor from a list would wait for the GPU.
        device = torch.device(device)
        temperatures, top_ps, min_ps = host_tensors(
            device, torch.float32, temperature, top_p, min_p
        )
        top_ks, seeds, positions = int64_tensors(device, top_k, seed, position)
        return cls(
            temperature=temperatures,
            top_k=top_ks,
            top_p=top_ps,
            min_p=min_ps,
            seed=seeds,
            position=positions,
            all_greedy=not any(sampled),
            any_greedy=not all(sampled),
            uses_top_k_top_p=any(
                s and (k > 0 or p < 1.0) for s, k, p in zip(sampled, top_k, top_p, strict=True)
            ),
        )

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    def repeat_interleave(self, n: int, position_offsets: bool = True) -> SamplingTensors:
        """Each row becomes n consecutive rows; positions advance 0..n-1 when asked."""
        if position_offsets:
            offsets = torch.arange(n, dtype=torch.int64, device=self.position.device)
            position = (self.position[:, None] + offsets).reshape(-1)
        else:
            position = self.position.repeat_interleave(n)
        return SamplingTensors(
            temperature=self.temperature.repeat_interleave(n),
            top_k=self.top_k.repeat_interleave(n),
            top_p=self.top_p.repeat_interleave(n),
            min_p=self.min_p.repeat_interleave(n),
            seed=self.seed.repeat_interleave(n),
            position=position,
            all_greedy=self.all_greedy,
            any_greedy=self.any_greedy,
            uses_top_k_top_p=self.uses_top_k_top_p,
        )


def _one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:  # logits: [R, V]; -> [R, V] f32
    out = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    return out.scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)


def sampling_probs(
    logits: torch.Tensor,  # [R, V] any float dtype
    st: SamplingTensors,
) -> torch.Tensor:  # [R, V] float32
    """Per-row distribution after temperature, top-k, top-p and min-p, renormalised.

    Greedy rows (temperature 0) come back one-hot at argmax (lowest index on ties).
    top-p acts on the top-k-renormalised distribution; min-p compares against the
    largest probability, which is unaffected by renormalisation, so its place in the
    order only matters through which tokens earlier filters already removed.
    """
    if st.all_greedy:
        return _one_hot_argmax(logits)
    num_rows, vocab = logits.shape
    # Greedy rows still flow through the arithmetic (no data-dependent branching), so
    # give them a harmless temperature and overwrite them at the end; where the host knows
    # there are none, both steps are skipped (no value changes).
    if st.any_greedy is False:
        greedy, temp = None, st.temperature
    else:
        greedy = st.temperature == 0
        temp = torch.where(greedy, torch.ones_like(st.temperature), st.temperature)
    probs = torch.softmax(logits.float() / temp[:, None], dim=-1)

    if st.uses_top_k_top_p is False:
        keep = probs >= (st.min_p[:, None] * probs.amax(dim=-1, keepdim=True))
    else:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=logits.device)[None, :]
        k = torch.where(st.top_k <= 0, vocab, st.top_k.clamp(max=vocab))
        keep_sorted = rank < k[:, None]
        topk_p = torch.where(keep_sorted, sorted_p, 0.0)
        topk_p = topk_p / topk_p.sum(dim=-1, keepdim=True)
        # A token survives top-p if the mass strictly ahead of it is still short of
        # top_p, which is exactly the smallest prefix reaching top_p. top_p == 1 is
        # special-cased because float cumsums can creep past 1.0 in the tail.
        mass_before = topk_p.cumsum(dim=-1) - topk_p
        keep_p = (mass_before < st.top_p[:, None]) | (st.top_p[:, None] >= 1.0) | (rank == 0)
        keep_min = sorted_p >= st.min_p[:, None] * sorted_p[:, :1]
        keep_sorted = keep_sorted & keep_p & keep_min
        keep = torch.empty_like(keep_sorted).scatter_(1, order, keep_sorted)

    probs = torch.where(keep, probs, 0.0)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    if greedy is None:
        return probs
    return torch.where(greedy[:, None], _one_hot_argmax(logits), probs)


def sample_from_probs(
    probs: torch.Tensor,  # [R, V] float32, non-negative; rows need not sum to 1
    st: SamplingTensors,
    salt: int,
) -> torch.Tensor:  # [R] int64
    """Exponential race: argmax(probs / E), E ~ Exp(1) i.i.d., picks token i w.p. probs[i].

    Scale invariance means unnormalised weights (e.g. a speculative-decoding residual)
    can be passed directly.
    """
    # hashed_uniform(.., width=V), -log, divide, argmax: one Triton kernel pair on the GPU.
    race = get_exponential_race_backend(probs.device)
    return race(probs, st.seed, st.position, salt)


def sample(
    logits: torch.Tensor,  # [R, V] any float dtype
    st: SamplingTensors,
    salt: int = 0,
) -> torch.Tensor:  # [R] int64
    """One token per row: argmax for greedy rows, seeded sampling for the rest."""
    greedy_tokens = logits.argmax(dim=-1)
    if st.all_greedy:
        return greedy_tokens
    sampled = sample_from_probs(sampling_probs(logits, st), st, salt)
    return torch.where(st.temperature == 0, greedy_tokens, sampled)
