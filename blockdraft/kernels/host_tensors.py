"""Host lists of numbers to device tensors without waiting for the GPU: through one page-locked
host tensor and one non-blocking copy. A `torch.tensor(list, device="cuda")` copies from
pageable memory, which synchronises with the stream: the host waits for every forward queued
before it, and a step built while the previous one runs (async decode) stops overlapping it.
At the bottom of the import graph (beside `forward_context`, whose metadata builders use it)."""

from __future__ import annotations

import itertools

import numpy as np
import torch


def host_int64(values: list, pinned: bool = False) -> torch.Tensor:  # [n] or [rows, cols] int64
    """A host int64 tensor from a (nested) list of ints. Through numpy: `torch.tensor` on a
    list converts element by element, several times slower on the per-step inputs. `pinned`
    (for a CUDA destination): a copy from page-locked memory never waits for the GPU, while
    one from pageable memory may wait for the work queued before it (the step's forwards)."""
    host = torch.from_numpy(np.array(values, dtype=np.int64))
    return host.pin_memory() if pinned else host


def int64_tensors(device: torch.device, *parts: list[int]) -> list[torch.Tensor]:
    """Several int64 vectors built as one host tensor and moved in one copy, returned as views:
    each separate `torch.tensor(..., device=cuda)` would pay its own build and transfer."""
    return host_tensors(device, torch.int64, *parts)


# The host dtype of each device dtype the step inputs use.
NUMPY_DTYPES = {torch.int64: np.int64, torch.float32: np.float32}


def host_tensors(device: torch.device, dtype: torch.dtype, *parts: list) -> list[torch.Tensor]:
    """Several vectors of `dtype` (int64 or float32) built as one host tensor and moved in one
    copy, returned as views. Each view starts 16-byte aligned (parts padded to whole 16 bytes):
    Triton specialises a kernel on its pointers' 16-byte alignment, so a view after an
    odd-length part would compile another variant of every kernel reading it, in the middle of
    serving."""
    per = 16 // dtype.itemsize  # elements in 16 bytes
    sizes = [len(p) for p in parts]
    padded = [-(-n // per) * per for n in sizes]
    values = np.zeros(sum(padded), dtype=NUMPY_DTYPES[dtype])
    for part, first in zip(parts, itertools.accumulate([0, *padded]), strict=False):
        values[first : first + len(part)] = part
    host = torch.from_numpy(values)
    if device.type == "cuda":
        host = host.pin_memory()
    flat = host.to(device, non_blocking=True)
    return [view[:n] for view, n in zip(flat.split(padded), sizes, strict=True)]
