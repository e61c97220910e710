"""`blockdraft.kernels.sampling`: the hashed uniforms are a pure function of (seed, position,
salt, column), strictly inside (0, 1), uniform and independent.

Inputs are fresh every run (the `ctx` fixture); a failing assertion names its replay seed.
Statistical checks use a chi-square test at ALPHA (tests/sampling_checks.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from blockdraft.kernels.sampling import _bits_to_uniform, hashed_uniform
from blockdraft.spec_decode.rejection_sampler import (
    SALT_ACCEPT,
    SALT_RESAMPLE,
)

from sampling_checks import (
    ALPHA,
    MAX_SEED,
    Ctx,
    chi2_pvalue,
    counts_of,
    make_st,
)


def test_hashed_uniform_is_a_pure_function(ctx: Ctx) -> None:
    r, width = 64, 37
    seed = torch.randint(0, MAX_SEED, (r,), generator=ctx.gen)
    pos = torch.randint(0, 1 << 62, (r,), generator=ctx.gen)
    u = hashed_uniform(seed, pos, 3, width)
    assert u.shape == (r, width) and u.dtype == torch.float32
    assert bool(((u > 0) & (u < 1)).all()), ctx.tag
    assert torch.equal(u, hashed_uniform(seed, pos, 3, width))
    # A row depends on its own coordinates only: subsets and permutations agree.
    perm = torch.randperm(r, generator=ctx.gen)
    assert torch.equal(hashed_uniform(seed[perm], pos[perm], 3, width), u[perm]), ctx.tag
    assert torch.equal(hashed_uniform(seed[5:9], pos[5:9], 3, width), u[5:9]), ctx.tag
    # Column c does not depend on width; width=None is column 0.
    assert torch.equal(hashed_uniform(seed, pos, 3, 5), u[:, :5])
    assert torch.equal(hashed_uniform(seed, pos, 3), u[:, 0])
    # Every coordinate matters.
    for other in (
        hashed_uniform(seed, pos, 4, width),
        hashed_uniform(seed ^ 1, pos, 3, width),
        hashed_uniform(seed, pos + 1, 3, width),
        hashed_uniform(seed + (1 << 40), pos, 3, width),
        hashed_uniform(seed, pos + (1 << 40), 3, width),
        hashed_uniform(seed, pos, 3 + (1 << 33), width),
    ):
        assert (other != u).float().mean() > 0.99, ctx.tag


def test_uniform_conversion_extremes() -> None:
    # Regression: the largest hash outputs once rounded to exactly 1.0 in float32, so
    # -log(u) was 0 and 0/0 = NaN let a zero-probability token win the race.
    x = torch.tensor([0, 1, 511, 512, 2**31, 2**32 - 513, 2**32 - 512, 2**32 - 1])
    u = _bits_to_uniform(x)
    assert bool(((u > 0) & (u < 1)).all())
    e = -torch.log(u)
    assert bool(((e > 0) & torch.isfinite(e)).all())
    probs = torch.tensor([[0.0, 0.3, 0.0, 0.7]]).expand(len(x), 4)
    assert bool(((probs / e[:, None]).argmax(-1) % 2 == 1).all())


@pytest.mark.parametrize("scheme", ["random", "consecutive_seeds", "consecutive_positions"])
def test_hashed_uniform_is_uniform_and_independent(ctx: Ctx, scheme: str) -> None:
    m, bins = 20000, 8
    st = make_st(ctx.gen, m, 1.0, seed_scheme=scheme)
    u = hashed_uniform(st.seed, st.position, 11, width=3)
    uniform = np.full(bins, 1 / bins)
    for c in range(3):
        b = (u[:, c] * bins).long()
        assert chi2_pvalue(counts_of(b, bins), uniform) > ALPHA, f"column {c} {ctx.tag}"
    # Pairs that the samplers rely on being independent: neighbouring columns, the same
    # coordinates under different salts (draft vs accept vs resample), and neighbouring
    # positions of one request.
    pairs = {
        "columns": (u[:, 0], u[:, 1]),
        "salts": (
            hashed_uniform(st.seed, st.position, SALT_ACCEPT),
            hashed_uniform(st.seed, st.position, SALT_RESAMPLE),
        ),
        "positions": (u[:, 2], hashed_uniform(st.seed, st.position + 1, 11, width=3)[:, 2]),
    }
    joint_uniform = np.full(bins * bins, 1 / bins**2)
    for name, (a, b) in pairs.items():
        cell = (a * bins).long() * bins + (b * bins).long()
        p = chi2_pvalue(counts_of(cell, bins * bins), joint_uniform)
        assert p > ALPHA, f"{name} not independent (p={p:.2e}) {ctx.tag}"
