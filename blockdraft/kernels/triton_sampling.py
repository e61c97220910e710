"""The sampler's counter-based uniforms and exponential race as Triton kernels.

`blockdraft.kernels.sampling` is the specification: `hashed_uniform` is ~85 tiny eager kernels
(six absorb rounds of a 32-bit mix on [R] int64 tensors, the column keys, the [R, V] mix, the
float conversion), which for a small model costs as much as the decode step itself.
`triton_hashed_uniform` computes the same bits in one launch: all integer arithmetic is done in
int64 with a 32-bit mask after every multiply exactly as the torch code does (the multipliers
are below 2**31, so no product overflows), and the float conversion is exact, so the output is
bit-identical. The salt's two absorb rounds depend on nothing else and are done on the host.

`triton_exponential_race` fuses `(probs / -log(u)).argmax(-1)` with the uniforms computed in
the kernel: no [R, V] temporaries, one pass over probs plus a tiny per-row reduction of the
block winners. Division rounds like torch's (IEEE); the log is libdevice's logf when compiled
(the one torch's CUDA kernel calls) and numpy's under the interpreter, which can differ from
torch's CPU log by an ulp: only a near-exact tie between the two best scores can then go the
other way. Ties go to the lowest index and NaN beats everything, as in torch.argmax.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from blockdraft.kernels.sampling import (
    _COL_INIT,
    _MASK32,
    _MUL_A,
    _MUL_B,
    _TWO_POW_M23,
    exponential_race_torch,
    hashed_uniform,
    salted_row_init,
)
from blockdraft.kernels.triton_env import triton_interpreting

__all__ = ["hashed_uniform", "triton_exponential_race", "triton_hashed_uniform"]

MASK32: tl.constexpr = tl.constexpr(_MASK32)
MUL_A: tl.constexpr = tl.constexpr(_MUL_A)
MUL_B: tl.constexpr = tl.constexpr(_MUL_B)
COL_INIT: tl.constexpr = tl.constexpr(_COL_INIT)
TWO_POW_M23: tl.constexpr = tl.constexpr(_TWO_POW_M23)
BIG_INDEX: tl.constexpr = tl.constexpr(2**62)


@triton.jit
def _mix32(x):  # int64 holding values in [0, 2**32); same steps as sampling._mix32
    x = x ^ (x >> 16)
    x = (x * MUL_A) & MASK32
    x = x ^ (x >> 15)
    x = (x * MUL_B) & MASK32
    return x ^ (x >> 16)


@triton.jit
def _seed_position_hash(seed, pos, h_salt):  # int64 scalars
    # h_salt: the row init with both salt words absorbed (sampling.salted_row_init)
    h = _mix32(h_salt.to(tl.int64) ^ (seed & MASK32))
    h = _mix32(h ^ ((seed >> 32) & MASK32))  # arithmetic shift; seeds are >= 0
    h = _mix32(h ^ (pos & MASK32))
    return _mix32(h ^ ((pos >> 32) & MASK32))


@triton.jit
def _row_hash(seed_ptr, position_ptr, row, h_salt):
    seed = tl.load(seed_ptr + row).to(tl.int64)
    pos = tl.load(position_ptr + row).to(tl.int64)
    return _seed_position_hash(seed, pos, h_salt)


@triton.jit
def _column_uniforms(h, cols):  # h: int64 scalar, cols: [BLOCK] int64 -> [BLOCK] float32
    col_key = _mix32(_mix32(cols ^ COL_INIT))
    x = _mix32(h ^ col_key)
    # exact: (x >> 9) < 2**23, + 0.5 needs 24 bits, * 2**-23 only shifts the exponent
    return ((x >> 9).to(tl.float32) + 0.5) * TWO_POW_M23


@triton.jit(do_not_specialize=["h_salt"])
def _hashed_uniform_kernel(
    seed_ptr,  # [R] int64
    position_ptr,  # [R] int64
    out_ptr,  # [R, width] float32, contiguous
    h_salt,
    width,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    h = _row_hash(seed_ptr, position_ptr, row, h_salt)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V).to(tl.int64)
    u = _column_uniforms(h, cols)
    tl.store(out_ptr + row * width + cols, u, mask=cols < width)


def _ids(t: torch.Tensor, rows: int, name: str) -> torch.Tensor:  # -> [rows] int64 contiguous
    if t.shape != (rows,):
        raise ValueError(f"{name} must have shape ({rows},), got {tuple(t.shape)}")
    return t.to(torch.int64).contiguous()


def _num_rows(seed: torch.Tensor) -> int:
    if seed.dim() != 1:
        raise ValueError(f"seed must be 1-D, got shape {tuple(seed.shape)}")
    return seed.shape[0]


def triton_hashed_uniform(
    seed: torch.Tensor,  # [R] int64, values in [0, 2**63)
    position: torch.Tensor,  # [R] int64
    salt: int,
    width: int | None = None,
) -> torch.Tensor:  # [R] or [R, width] float32 in (0, 1)
    """`sampling.hashed_uniform`, bit for bit, in one launch."""
    rows = _num_rows(seed)
    seed = _ids(seed, rows, "seed")
    position = _ids(position, rows, "position")
    cols = 1 if width is None else width
    out = torch.empty(rows, cols, dtype=torch.float32, device=seed.device)
    if rows > 0 and cols > 0:
        block = min(1024, triton.next_power_of_2(cols))
        _hashed_uniform_kernel[(rows, triton.cdiv(cols, block))](
            seed,
            position,
            out,
            salted_row_init(salt),
            cols,
            BLOCK_V=block,
            num_warps=max(1, min(4, block // 256)),
        )
    return out.view(rows) if width is None else out


@triton.jit
def _first_argmax(vals, idx):  # [B] float32, [B] int64 -> (best value, its lowest index)
    # torch.argmax order: NaN above everything, then the largest value, lowest index on ties.
    # Padding lanes hold -inf with indices past every real one.
    is_nan = vals != vals
    any_nan = tl.max(is_nan.to(tl.int32), axis=0) > 0
    best = tl.max(tl.where(is_nan, float("-inf"), vals), axis=0)
    hit = tl.where(any_nan, is_nan, vals == best)
    first = tl.min(tl.where(hit, idx, BIG_INDEX), axis=0)
    return tl.where(any_nan, float("nan"), best), first


@triton.jit(do_not_specialize=["h_salt"])
def _exponential_race_kernel(
    probs_ptr,  # [R, V] float, unit column stride
    seed_ptr,  # [R] int64
    position_ptr,  # [R] int64
    best_ptr,  # [R, num_blocks] float32: each column block's best score
    best_idx_ptr,  # [R, num_blocks] int64: its lowest index
    stride_p,
    h_salt,
    vocab,
    num_blocks,
    BLOCK_V: tl.constexpr,
    PRECISE_LOG: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    h = _row_hash(seed_ptr, position_ptr, row, h_salt)
    cols = block.to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V).to(tl.int64)
    ok = cols < vocab
    u = _column_uniforms(h, cols)
    if PRECISE_LOG:
        # tl.log is the fast approximate log on NVIDIA; torch's CUDA kernel uses logf. The
        # interpreter has no libdevice.
        neg_log_u = -libdevice.log(u)
    else:
        neg_log_u = -tl.log(u)
    p = tl.load(probs_ptr + row * stride_p + cols, mask=ok, other=0.0).to(tl.float32)
    score = tl.where(ok, tl.math.div_rn(p, neg_log_u), float("-inf"))
    best, first = _first_argmax(score, tl.where(ok, cols, BIG_INDEX))
    tl.store(best_ptr + row * num_blocks + block, best)
    tl.store(best_idx_ptr + row * num_blocks + block, first)


@triton.jit
def _race_winner_kernel(
    best_ptr,  # [R, num_blocks] float32
    best_idx_ptr,  # [R, num_blocks] int64
    out_ptr,  # [R] int64
    num_blocks,
    BLOCK_B: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_B)
    ok = offs < num_blocks
    vals = tl.load(best_ptr + row * num_blocks + offs, mask=ok, other=float("-inf"))
    idx = tl.load(best_idx_ptr + row * num_blocks + offs, mask=ok, other=BIG_INDEX)
    # Blocks are in column order, so the lowest index among the best blocks is the first.
    _, first = _first_argmax(vals, idx)
    tl.store(out_ptr + row, first)


RACE_BLOCK_V = 2048


def triton_exponential_race(
    probs: torch.Tensor,  # [R, V] float32 (or half), non-negative; rows need not sum to 1
    seed: torch.Tensor,  # [R] int64
    position: torch.Tensor,  # [R] int64
    salt: int,
) -> torch.Tensor:  # [R] int64
    """`sampling.exponential_race_torch` in two launches (up to an ulp of log, see above)."""
    if probs.dim() != 2 or probs.shape[1] == 0 or probs.dtype == torch.float64:
        return exponential_race_torch(probs, seed, position, salt)  # its errors, its precision
    rows, vocab = probs.shape
    seed = _ids(seed, rows, "seed")
    position = _ids(position, rows, "position")
    out = torch.empty(rows, dtype=torch.int64, device=probs.device)
    if rows == 0:
        return out
    if probs.stride(1) != 1:
        probs = probs.contiguous()
    block = min(RACE_BLOCK_V, triton.next_power_of_2(vocab))
    num_blocks = triton.cdiv(vocab, block)
    best = torch.empty(rows, num_blocks, dtype=torch.float32, device=probs.device)
    best_idx = torch.empty(rows, num_blocks, dtype=torch.int64, device=probs.device)
    _exponential_race_kernel[(rows, num_blocks)](
        probs,
        seed,
        position,
        best,
        best_idx,
        probs.stride(0),
        salted_row_init(salt),
        vocab,
        num_blocks,
        BLOCK_V=block,
        PRECISE_LOG=not triton_interpreting(),
        num_warps=max(1, min(8, block // 256)),
    )
    _race_winner_kernel[(rows,)](
        best, best_idx, out, num_blocks, BLOCK_B=triton.next_power_of_2(num_blocks)
    )
    return out
