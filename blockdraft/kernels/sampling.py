"""Counter-based random numbers and the exponential race: the specification (pure torch).

`hashed_uniform` is a pure function of (seed[r], position[r], salt, column c), so a seeded
request draws the same numbers no matter which other requests share its batch. It is written
as a handful of eager elementwise torch ops; `blockdraft.kernels.triton_sampling` computes the
same bits in one kernel (and the race in one more), chosen by `blockdraft.kernels.select`.
`blockdraft.layers.sampler` re-exports `hashed_uniform` and builds the sampling on top.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
# Odd multipliers below 2**31: a 32-bit value times one of these stays below 2**63, so
# the int64 products never overflow and the hash is exact on every backend.
_MUL_A = 0x7FEB352D
_MUL_B = 0x5CB15CC5
# Distinct starting constants keep the row stream and the column stream apart.
_ROW_INIT = 0x2545F491
_COL_INIT = 0x6A09E667
_TWO_POW_M23 = 1.0 / (1 << 23)


def _mix32(x: torch.Tensor) -> torch.Tensor:  # x: [...] int64 holding values in [0, 2**32)
    # xorshift-multiply finaliser (murmur3 / lowbias32 shape): a bijection on 32 bits with
    # good avalanche. Masking after each multiply keeps every operand below 2**32.
    x = x ^ (x >> 16)
    x = (x * _MUL_A) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MUL_B) & _MASK32
    return x ^ (x >> 16)


def _absorb(h: torch.Tensor, word: torch.Tensor) -> torch.Tensor:  # both [...] int64
    # Sponge-style chaining: every input word passes through a full mix before the next.
    return _mix32(h ^ (word & _MASK32))


def hashed_uniform(
    seed: torch.Tensor,  # [R] int64
    position: torch.Tensor,  # [R] int64
    salt: int,
    width: int | None = None,
) -> torch.Tensor:  # [R] or [R, width] float32 in (0, 1)
    """Counter-based uniform random numbers, a pure function of their coordinates.

    Value (r, c) depends only on (seed[r], position[r], salt, c); width=None returns
    column 0 as a 1-D tensor. Values are (k + 0.5) / 2**23 for k in [0, 2**23).
    """
    seed = seed.to(torch.int64)
    position = position.to(torch.int64)
    h = torch.full_like(seed, _ROW_INIT)
    h = _absorb(h, torch.full_like(seed, salt & _MASK32))
    h = _absorb(h, torch.full_like(seed, (salt >> 32) & _MASK32))
    h = _absorb(h, seed)
    h = _absorb(h, seed >> 32)
    h = _absorb(h, position)
    h = _absorb(h, position >> 32)

    cols = torch.arange(1 if width is None else width, dtype=torch.int64, device=seed.device)
    col_key = _mix32(_mix32(cols ^ _COL_INIT))
    # The [R, V] part is a single mix of two already well-mixed keys, because this is the
    # only piece whose cost scales with the vocabulary.
    u = _bits_to_uniform(_mix32(h[:, None] ^ col_key[None, :]))
    return u[:, 0] if width is None else u


def _bits_to_uniform(x: torch.Tensor) -> torch.Tensor:  # x: [...] int64 in [0, 2**32)
    # 23 bits, not 24: (k + 0.5) then needs at most 24 significant bits, so every value is
    # exact in float32 and the largest is 1 - 2**-24. With 24 bits the top values round
    # to exactly 1.0, making -log(u) == 0 and 0/0 = NaN win the exponential race.
    return ((x >> 9).to(torch.float32) + 0.5) * _TWO_POW_M23


def salted_row_init(salt: int) -> int:
    """The row hash after absorbing the salt's two 32-bit words, as `hashed_uniform` starts
    every row (plain Python ints: the Triton kernel gets it as an argument)."""

    def mix(x: int) -> int:
        x ^= x >> 16
        x = (x * _MUL_A) & _MASK32
        x ^= x >> 15
        x = (x * _MUL_B) & _MASK32
        return x ^ (x >> 16)

    h = mix(_ROW_INIT ^ (salt & _MASK32))
    return mix(h ^ ((salt >> 32) & _MASK32))


def exponential_race_torch(
    probs: torch.Tensor,  # [R, V] float, non-negative; rows need not sum to 1
    seed: torch.Tensor,  # [R] int64
    position: torch.Tensor,  # [R] int64
    salt: int,
) -> torch.Tensor:  # [R] int64
    """argmax(probs / E) with E = -log(u), u = hashed_uniform(.., width=V): token i w.p.
    probs[i] / sum(probs). Lowest index on ties."""
    u = hashed_uniform(seed, position, salt, width=probs.shape[-1])
    return (probs / -torch.log(u)).argmax(dim=-1)
