"""Which CPU linears run as `weight @ x.T` (`KernelPolicy.cpu_weight_left_rows`), measured on
this machine's BLAS when a CPU engine starts.

A few-row linear on the CPU reads its whole weight from memory, and how fast depends on the
path the BLAS takes: F.linear's one-row GEMV, its small-M GEMM, or `weight @ x.T` (the weight
as the left operand, as stored). Hosts disagree: on one, F.linear was 2-4x faster at two rows;
on an AMD EPYC (torch 2.13's CPU wheel, two threads, SmolLM2-135M's weights read from memory)
its GEMV took 622 us for the MLP's gate_up where `weight @ x.T` of two rows took 213, and
three rows 1,237 against 272; on one thread there, F.linear's 16-row GEMM won instead. So the
engine times both paths at each row count of CPU_ROW_COUNTS over its own largest weights, each
pass reading more than a last-level cache holds, and keeps the counts where `weight @ x.T` won.
Each count is decided on its own: a rule of "from the smallest count that wins at every larger
one" left a one-thread engine on the slow GEMV at every count below 16 (half AR's speed) once
the 16-row GEMM won.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch
import torch.nn.functional as F
from torch import nn

from blockdraft.kernels.policy import CPU_ROW_COUNTS, KernelPolicy
from blockdraft.layers.linear import weight_left_linear

logger = logging.getLogger(__name__)

PLAN_MIN_BYTES = 64 * 1024**2  # models with less in their linears keep the policy's default
SAMPLE_BYTES = 128 * 1024**2  # weights a timed pass reads: past a CPU's last-level cache
REPEATS = 2  # passes per (rows, path), the two paths taking turns; the fastest counts


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
def weight_left_rows(
    weights: list[torch.Tensor], rows: tuple[int, ...] = CPU_ROW_COUNTS
) -> tuple[int, ...]:
    """The counts of `rows` at which `weight @ x.T` beat F.linear, timed over the largest
    `weights` (about SAMPLE_BYTES of them)."""
    sample, size = [], 0
    for w in weights:
        if size >= SAMPLE_BYTES:
            break
        sample.append(w)
        size += w.numel() * w.element_size()
    wins = []
    for m in rows:
        inputs = {k: torch.randn(m, k, dtype=sample[0].dtype) for k in {w.shape[1] for w in sample}}
        plain = left = float("inf")
        for _ in range(REPEATS):
            plain = min(plain, _pass_seconds(sample, inputs, False))
            left = min(left, _pass_seconds(sample, inputs, True))
        if left < plain:
            wins.append(m)
    return tuple(wins)


def cpu_linear_policy(policy: KernelPolicy, *models: nn.Module | None) -> KernelPolicy:
    """`policy` with `cpu_weight_left_rows` measured on the models' linears when it is None and
    they hold at least PLAN_MIN_BYTES (else `policy` as it is)."""
    if policy.cpu_weight_left_rows is not None:  # set by the caller
        return policy
    weights = linear_weights(*models)
    total = sum(w.numel() * w.element_size() for w in weights)
    if total < PLAN_MIN_BYTES:
        return policy
    start = time.perf_counter()
    counts = weight_left_rows(weights)
    logger.info(
        "CPU linears as weight @ x.T at row counts %s of %s (measured in %.2f s)",
        list(counts),
        list(CPU_ROW_COUNTS),
        time.perf_counter() - start,
    )
    return dataclasses.replace(policy, cpu_weight_left_rows=counts)
