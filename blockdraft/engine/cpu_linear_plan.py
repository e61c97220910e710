"""Which CPU linears run as `weight @ x.T` (`KernelPolicy.cpu_weight_left_min_rows`), measured
on this machine's BLAS when a CPU engine starts.

A few-row linear on the CPU reads its whole weight from memory, and how fast depends on the
path the BLAS takes: F.linear's one-row GEMV, its small-M GEMM, or `weight @ x.T` (the weight
as the left operand, as stored). Hosts disagree: on one, F.linear was 2-4x faster at two rows;
on an AMD EPYC (torch 2.13's CPU wheel, two threads, SmolLM2-135M's weights read from memory)
its GEMV took 622 us for the MLP's gate_up where `weight @ x.T` of two rows took 213, and
three rows 1,237 against 272. So the engine times both over its own largest weights, each pass
reading more than a last-level cache holds, and takes the smallest row count from which
`weight @ x.T` wins at every larger count timed.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch
import torch.nn.functional as F
from torch import nn

from blockdraft.kernels.policy import KernelPolicy
from blockdraft.layers.linear import weight_left_linear

logger = logging.getLogger(__name__)

PLAN_MIN_BYTES = 64 * 1024**2  # models with less in their linears keep the policy's default
SAMPLE_BYTES = 128 * 1024**2  # weights a timed pass reads: past a CPU's last-level cache
ROWS = (1, 2, 3, 4, 8, 16)  # the row counts timed (CPU_WEIGHT_LEFT_MIN_ROWS is 16)
REPEATS = 2  # passes per (rows, path); the fastest counts


def linear_weights(*models: nn.Module | None) -> list[torch.Tensor]:
    """The 2-D weights of the models' linears, largest first (each matrix once)."""
    seen, weights = set(), []
    for model in models:
        if model is None:  # no drafter
            continue
        for module in model.modules():
            weight = getattr(module, "weight", None)
            if not isinstance(module, nn.Linear) or weight is None or weight.dim() != 2:
                continue
            if weight.data_ptr() not in seen:
                seen.add(weight.data_ptr())
                weights.append(weight.detach())
    return sorted(weights, key=lambda w: -w.numel() * w.element_size())


def _pass_seconds(
    weights: list[torch.Tensor], inputs: dict[int, torch.Tensor], left: bool
) -> float:  # one pass over `weights`, each with the input of its width
    fn = weight_left_linear if left else F.linear
    start = time.perf_counter()
    for w in weights:
        fn(inputs[w.shape[1]], w)
    return time.perf_counter() - start


@torch.inference_mode()
def weight_left_min_rows(weights: list[torch.Tensor], rows: tuple[int, ...] = ROWS) -> int:
    """The smallest of `rows` from which `weight @ x.T` beat F.linear at every larger count,
    timed over the largest `weights` (about SAMPLE_BYTES of them); the last of `rows` when it
    lost there too (counts past it are not timed: the default's)."""
    sample, size = [], 0
    for w in weights:
        if size >= SAMPLE_BYTES:
            break
        sample.append(w)
        size += w.numel() * w.element_size()
    best = rows[-1]
    for m in sorted(rows, reverse=True):
        inputs = {k: torch.randn(m, k, dtype=sample[0].dtype) for k in {w.shape[1] for w in sample}}
        plain = min(_pass_seconds(sample, inputs, False) for _ in range(REPEATS))
        left = min(_pass_seconds(sample, inputs, True) for _ in range(REPEATS))
        if left >= plain:
            break
        best = m
    return best


def cpu_linear_policy(policy: KernelPolicy, *models: nn.Module | None) -> KernelPolicy:
    """`policy` with `cpu_weight_left_min_rows` measured on the models' linears when it is None
    and they hold at least PLAN_MIN_BYTES (else `policy` as it is)."""
    if policy.cpu_weight_left_min_rows is not None:  # set by the caller
        return policy
    weights = linear_weights(*models)
    total = sum(w.numel() * w.element_size() for w in weights)
    if total < PLAN_MIN_BYTES:
        return policy
    start = time.perf_counter()
    min_rows = weight_left_min_rows(weights)
    logger.info(
        "CPU linears of %d rows or more as weight @ x.T (measured in %.2f s)",
        min_rows,
        time.perf_counter() - start,
    )
    return dataclasses.replace(policy, cpu_weight_left_min_rows=min_rows)
