"""Programmatic dependent launch (PDL, Hopper and later) for the decode path's Triton kernels.

A decode step is a chain of small kernels, and between two of them the GPU idles: the next
kernel is launched only once the previous one has drained, and a kernel that streams weights
ramps up over its first microseconds. Attention, RoPE and the norms move almost no bytes, so
HBM also idles while they run. With PDL a kernel may start before its predecessor has
finished: it must call `gdc_wait` before touching anything an earlier kernel writes, but what
it does before that (its launch, its ramp) overlaps the predecessor. The short kernels (RoPE +
KV store, attention and its reduction, the norm and SiLU·mul kernels) call
`gdc_launch_dependents` at their start, which lets their successor launch at once; each of them
is PDL-launched too and waits before its loads. A skinny GEMM lets its successor launch once
each of its programs has read its last weight chunk, so the next kernel's launch overlaps the
GEMM's stores and tail (at the GEMM's start, early successors' waiting programs would take SM
slots: 4.44 vs 4.29 ms a batch-1 8B decode step).

`griddepcontrol.wait` returns at once when a kernel was launched without PDL, so the kernels
stay correct in any order of launches, PDL or not (the CPU interpreter never sees the calls:
they sit behind a constexpr).

Where PDL runs is the active `KernelPolicy`'s (`pdl`, `pdl_max_query_len`): by default on CUDA
devices of compute capability 9.0+ (when this Triton has it), for launches inside a forward
whose every request has one query row, nowhere else. It pays in decode steps and costs in
16-row verify and drafter steps, whose attention and GEMM grids are larger (likely because
early-launched programs waiting in `gdc_wait` hold SM slots that their predecessor's later
programs need; not profiled).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from blockdraft.kernels.forward_context import current_attention_metadata, current_kernel_policy


@functools.cache
def _triton_has_pdl() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra import cuda
    except ImportError:
        return False
    has_option = "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})
    return has_option and hasattr(cuda, "gdc_wait") and hasattr(cuda, "gdc_launch_dependents")


@functools.lru_cache(maxsize=16)
def _device_has_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9 and _triton_has_pdl()


def pdl_enabled(device: torch.device) -> bool:
    """Whether a kernel launched now on `device` uses PDL: the active policy allows it, inside a
    forward of at most its `pdl_max_query_len` query rows a request, on a device that has it."""
    policy = current_kernel_policy()
    meta = current_attention_metadata()
    if not policy.pdl or meta is None or meta.max_query_len > policy.pdl_max_query_len:
        return False
    if device.type != "cuda":
        return False
    return _device_has_pdl(device.index if device.index is not None else 0)


@functools.lru_cache(maxsize=8)
def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 16  # the CPU interpreter: any modest number keeps the heuristics meaningful


def launch_options(pdl: bool) -> dict:
    """Extra launch keywords: `launch_pdl` only when on (older Triton and the interpreter do
    not know it)."""
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """At a short kernel's start: let the next kernel launch, then wait for the previous one."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
