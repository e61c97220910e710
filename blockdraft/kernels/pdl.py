"""Programmatic dependent launch (PDL, Hopper and later) for the decode path's Triton kernels.

A decode step is a chain of small kernels, and between two of them the GPU idles: the next
kernel is launched only once the previous one has drained, and a kernel that streams weights
ramps up over its first microseconds. Attention, RoPE and the norms move almost no bytes, so
HBM also idles while they run. With PDL a kernel may start before its predecessor has
finished: it must call `gdc_wait` before touching anything an earlier kernel writes, but what
it does before that (its launch, its ramp) overlaps the predecessor. The skinny GEMM can use
this window to prefetch its weight slice into L2 (weights are never written by the step; off
by default, see below). The short kernels (RoPE + KV store, attention and its reduction, the
norm and SiLU·mul kernels) call `gdc_launch_dependents` at their start, which lets their
successor launch at once; each of them is PDL-launched too and waits before its loads. A GEMM
lets its successor launch once each of its programs has read its last weight chunk
(GEMM_TRIGGER), so the next kernel's launch overlaps the GEMM's stores and tail.

`griddepcontrol.wait` returns at once when a kernel was launched without PDL, so the kernels
stay correct in any order of launches, PDL or not (the CPU interpreter never sees the calls:
they sit behind a constexpr).

When it is on, measured on an H200 (BENCHMARKS.md, run XI): PDL pays in decode steps (one query
row per request) and costs in 16-row verify and drafter steps, whose attention and GEMM grids
are larger (likely because early-launched programs waiting in `gdc_wait` hold SM slots that
their predecessor's later programs need; not profiled). Qwen3-8B shapes, batch 1: decode
4.45 -> 4.34 ms, DFlash step 6.19 -> 6.42 ms; SmolLM2-135M decode 0.77 -> 0.65 ms. The L2
prefetch costs more than it saves at every shape measured (8B decode 5.67 ms with it), so its
budget is 0 unless asked for. Hence the policy under "auto" (BLOCKDRAFT_PDL unset): PDL on
CUDA devices of compute capability 9.0+ (when this Triton has it) for launches inside a forward
whose every request has one query row, nowhere else. BLOCKDRAFT_PDL=1 puts it on every launch,
=0 off; BLOCKDRAFT_PDL_PREFETCH_MIB sets the prefetch budget (A/B runs).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from blockdraft.kernels.forward_context import current_attention_metadata

ENV_VAR = "BLOCKDRAFT_PDL"
PREFETCH_ENV_VAR = "BLOCKDRAFT_PDL_PREFETCH_MIB"
TRIGGER_ENV_VAR = "BLOCKDRAFT_PDL_GEMM_TRIGGER"
# Under "auto" (BLOCKDRAFT_PDL unset), on devices that have it: PDL in forwards whose requests
# have at most PDL_MAX_QUERY_LEN query rows each. 1, decode forwards only: at 16 (verify and
# drafter blocks too) the H200's DFlash N = 15 step read 6.08 / 6.07 ms against 6.02 / 6.01
# (gpu_bench --ablate, row "pdl16", BENCHMARKS.md run XVII; the same with the attention
# letting its successor launch at its start, or after its key walk in a reverted variant).
PDL_ON_HOPPER = True
PDL_MAX_QUERY_LEN = 1
# L2 bytes the first wave of a skinny GEMM may prefetch (BLOCKDRAFT_PDL_PREFETCH_MIB): off, as
# measured; a budget should stay inside the H100/H200's 50 MB, so that prefetched lines are
# still there when the main loop reads them.
L2_PREFETCH_BUDGET = 0
# Where a PDL-launched skinny GEMM lets its successor launch (`gemm_trigger`): 0 never (the
# successor launches as the GEMM's last program exits), 1 at each program's start, 2 once a
# program has read its last W chunk (BLOCKDRAFT_PDL_GEMM_TRIGGER = off / start / end).
# Measured on an H200 (gpu_bench --ablate, Qwen3-8B shapes, batch-1 decode step, two runs):
# 4.34 / 4.35 ms on exit, 4.30 / 4.28 after the loads, 4.44 at the start (early successors'
# waiting programs take SM slots). In 16-row forwards with PDL on every launch neither paid
# (DFlash step 6.02 / 6.03 ms without PDL there; 6.03 / 6.86 at the start, 6.26 / 6.12 after
# the loads), so the policy keeps PDL to decode forwards.
GEMM_TRIGGER = 2
_TRIGGER_CHOICES = {"off": 0, "0": 0, "start": 1, "end": 2}


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
    """Whether a kernel launched now on `device` uses PDL (the policy in the module doc)."""
    choice = os.environ.get(ENV_VAR, "").strip().lower()
    if choice in ("", "auto"):
        meta = current_attention_metadata()
        wanted = PDL_ON_HOPPER and meta is not None and meta.max_query_len <= PDL_MAX_QUERY_LEN
    else:
        wanted = choice not in ("0", "off", "false")
    if device.type != "cuda" or not wanted:
        return False
    return _device_has_pdl(device.index if device.index is not None else 0)


def l2_prefetch_budget() -> int:
    """Bytes the first wave of a PDL-launched skinny GEMM may prefetch into L2:
    L2_PREFETCH_BUDGET unless BLOCKDRAFT_PDL_PREFETCH_MIB says otherwise."""
    value = os.environ.get(PREFETCH_ENV_VAR, "").strip()
    if not value:
        return L2_PREFETCH_BUDGET
    try:
        mib = float(value)
    except ValueError:
        mib = -1.0
    if not mib >= 0:  # also rejects nan
        raise ValueError(f"{PREFETCH_ENV_VAR} must be a number of MiB >= 0, got {value!r}")
    return int(mib * 1024**2)


def gemm_trigger() -> int:
    """Where a PDL-launched skinny GEMM calls `gdc_launch_dependents`: GEMM_TRIGGER unless
    BLOCKDRAFT_PDL_GEMM_TRIGGER says otherwise (0 never, 1 at the start, 2 after the loads)."""
    value = os.environ.get(TRIGGER_ENV_VAR, "").strip().lower()
    if not value:
        return GEMM_TRIGGER
    if value not in _TRIGGER_CHOICES:
        raise ValueError(f"{TRIGGER_ENV_VAR} must be one of off, start, end; got {value!r}")
    return _TRIGGER_CHOICES[value]


@functools.lru_cache(maxsize=8)
def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 16  # the CPU interpreter: any modest number keeps the heuristics meaningful


def launch_options(pdl: bool) -> dict:
    """Extra launch keywords: `launch_pdl` only when on (older Triton and the interpreter do
    not know it)."""
    return {"launch_pdl": True} if pdl else {}


def prefetch_chunks(block_n: int, num_warps: int, nbytes: int) -> int:
    """Pieces per row for `prefetch_rows_l2`: enough that the program's threads each issue one
    (power of two), none under 1 KB."""
    chunks = 1
    while block_n * chunks * 2 <= 32 * num_warps and nbytes // (chunks * 2) >= 1024:
        chunks *= 2
    return chunks


def prefetch_bytes_per_row(
    num_programs: int,
    block_n: int,
    row_bytes: int,
    num_sms: int,
    aligned: bool,
    budget: int | None = None,
) -> int:
    """Bytes of its W rows (from the split's start) each program prefetches before waiting: the
    programs of the first wave (two per SM) share `budget` (default: `l2_prefetch_budget()`);
    16-byte multiples (the bulk prefetch's unit), 0 when the rows are not 16-byte aligned or the
    share is under 1 KB."""
    if budget is None:
        budget = l2_prefetch_budget()
    if not aligned or num_programs <= 0 or block_n <= 0:
        return 0
    resident = min(num_programs, 2 * num_sms)
    share = min(row_bytes, budget // (resident * block_n))
    share -= share % 16
    return share if share >= 1024 else 0


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """At a short kernel's start: let the next kernel launch, then wait for the previous one."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


@triton.jit
def prefetch_rows_l2(
    base_ptr,  # W's element at (row 0, this split's first column)
    row0,  # first row of this program
    num_rows,  # N: rows past it are clamped to the last
    stride_row,  # W's row stride, in elements
    nbytes,  # int32, a multiple of 16: bytes from each row's start
    ROWS: tl.constexpr,  # rows of this program (BLOCK_N)
    CHUNKS: tl.constexpr,  # pieces per row, so that ROWS * CHUNKS lanes share the work
):
    """Bulk L2 prefetches (sm_90 `cp.async.bulk.prefetch.L2`) of `nbytes` from the start of each
    of the program's rows, one instruction per (row, piece): a 1-D tensor of ROWS * CHUNKS
    elements, one per thread when that is the thread count (a tensor smaller than the program's
    threads would be replicated across them, and every copy issues its prefetch). No data moves
    to registers, so the kernel may go on (or wait) at once."""
    lane = tl.arange(0, ROWS * CHUNKS)
    piece = lane % CHUNKS
    row = tl.minimum(row0 + lane // CHUNKS, num_rows - 1).to(tl.int64)
    chunk = nbytes // CHUNKS // 16 * 16
    start = piece * chunk
    size = tl.where(piece == CHUNKS - 1, nbytes - start, chunk)
    elem_bytes: tl.constexpr = base_ptr.dtype.element_ty.primitive_bitwidth // 8
    addr = base_ptr.to(tl.pointer_type(tl.int8)) + row * stride_row * elem_bytes + start
    tl.inline_asm_elementwise(
        "cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;",
        "=r,l,r",
        [addr, size],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )
