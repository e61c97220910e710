"""Tests for blockdraft.layers.sampler and blockdraft.spec_decode.rejection_sampler.

Inputs are fresh every run. The base seed is printed (pytest shows it for failing
tests) and included in assertion messages; export BLOCKDRAFT_TEST_SEED=<value> to
replay a run. Statistical checks use a chi-square test at ALPHA, small enough that a
correct implementation essentially never trips it, while the sample sizes make the
plausible bugs fail by dozens of orders of magnitude (see the power checks below).
"""

from __future__ import annotations

import os
import secrets
import zlib
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from blockdraft.kernels.sampling import _bits_to_uniform, hashed_uniform
from blockdraft.layers.sampler import (
    SamplingTensors,
    sample,
    sample_from_probs,
    sampling_probs,
)
from blockdraft.spec_decode.rejection_sampler import (
    SALT_ACCEPT,
    SALT_RESAMPLE,
    rejection_sample,
    sample_drafts,
)

_ENV_SEED = os.environ.get("BLOCKDRAFT_TEST_SEED")
BASE_SEED = int(_ENV_SEED) if _ENV_SEED else secrets.randbits(48)
ALPHA = 1e-5
MAX_SEED = 2**63 - 1


@dataclass
class Ctx:
    gen: torch.Generator
    tag: str  # appended to assertion messages so a failure names its replay seed


@pytest.fixture
def ctx(request: pytest.FixtureRequest) -> Ctx:
    # Mixing in the test id gives each (parametrised) test its own inputs while one
    # environment variable still replays the whole run.
    seed = BASE_SEED ^ zlib.crc32(request.node.nodeid.encode())
    print(f"BLOCKDRAFT_TEST_SEED={BASE_SEED}")
    return Ctx(torch.Generator().manual_seed(seed), f"[BLOCKDRAFT_TEST_SEED={BASE_SEED}]")


# ----------------------------------------------------------------------------- helpers


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson goodness of fit of integer counts [V] to probs [V] (zero-prob bins skipped)."""
    counts = np.asarray(counts, dtype=np.float64)
    probs = np.asarray(probs, dtype=np.float64)
    support = probs > 0
    obs, exp = counts[support], probs[support] / probs[support].sum() * counts.sum()
    # Pool sparse bins so the chi-square approximation holds.
    small = exp < 5
    if small.any():
        pooled_obs, pooled_exp = obs[small].sum(), exp[small].sum()
        obs, exp = obs[~small], exp[~small]
        if pooled_exp >= 5 or len(exp) == 0:
            obs, exp = np.append(obs, pooled_obs), np.append(exp, pooled_exp)
        else:
            j = int(np.argmin(exp))
            obs[j] += pooled_obs
            exp[j] += pooled_exp
    df = len(exp) - 1
    if df < 1:
        return 1.0
    stat = float(((obs - exp) ** 2 / exp).sum())
    p = torch.special.gammaincc(
        torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)
    )
    return float(p)


def counts_of(tokens: torch.Tensor, vocab: int) -> np.ndarray:  # tokens: [M] int64
    return torch.bincount(tokens, minlength=vocab).numpy()


def ref_probs(logits: np.ndarray, t: float, k: int, top_p: float, min_p: float) -> np.ndarray:
    """Straightforward float64 reference for one row; deliberately loop-based."""
    vocab = logits.shape[0]
    if t == 0:
        out = np.zeros(vocab)
        out[int(np.argmax(logits))] = 1.0
        return out
    z = logits.astype(np.float64) / t
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.zeros(vocab, dtype=bool)
    keep[order[: vocab if k <= 0 else min(k, vocab)]] = True
    pk = np.where(keep, p, 0.0)
    pk /= pk.sum()
    if top_p < 1.0:
        keep_p = np.zeros(vocab, dtype=bool)
        cum = 0.0
        for idx in order:
            if not keep[idx]:
                break
            keep_p[idx] = True
            cum += pk[idx]
            if cum >= top_p:
                break
        keep &= keep_p
    keep &= p >= min_p * p.max()
    out = np.where(keep, p, 0.0)
    return out / out.sum()


def make_st(
    gen: torch.Generator,
    m: int,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    seed_scheme: str = "random",
) -> SamplingTensors:
    """m rows sharing sampling params; each row is an independent draw via its seed/position."""
    if seed_scheme == "random":
        seeds = torch.randint(0, MAX_SEED, (m,), generator=gen).tolist()
        positions = torch.randint(0, 1 << 40, (m,), generator=gen).tolist()
    elif seed_scheme == "consecutive_seeds":  # users often pick seeds 0, 1, 2, ...
        seeds = list(range(m))
        positions = [int(torch.randint(0, 4096, (1,), generator=gen))] * m
    elif seed_scheme == "consecutive_positions":  # one request decoding m tokens
        seeds = [int(torch.randint(0, MAX_SEED, (1,), generator=gen))] * m
        positions = list(range(m))
    else:
        raise ValueError(seed_scheme)
    return SamplingTensors.from_lists(
        [temperature] * m, [top_k] * m, [top_p] * m, [min_p] * m, seeds, positions, "cpu"
    )


def random_params(gen: torch.Generator, r: int) -> dict[str, list]:
    def pick(options: list) -> list:
        idx = torch.randint(0, len(options), (r,), generator=gen).tolist()
        return [options[i] for i in idx]

    return {
        "temperature": pick([0.0, 0.3, 0.7, 1.0, 1.6]),
        "top_k": pick([0, 0, 1, 3, 10]),
        "top_p": pick([1.0, 1.0, 0.5, 0.9, 0.97]),
        "min_p": pick([0.0, 0.0, 0.05, 0.2]),
        "seed": torch.randint(0, MAX_SEED, (r,), generator=gen).tolist(),
        "position": torch.randint(0, 1 << 20, (r,), generator=gen).tolist(),
    }


def strip_hints(st: SamplingTensors) -> SamplingTensors:
    return SamplingTensors(st.temperature, st.top_k, st.top_p, st.min_p, st.seed, st.position)


# ------------------------------------------------------------------------ hashed uniform


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


# ------------------------------------------------------------------------ sampling_probs


@pytest.mark.parametrize("vocab", [16, 1000])
def test_sampling_probs_matches_reference(ctx: Ctx, vocab: int) -> None:
    r = 96
    params = random_params(ctx.gen, r)
    logits = torch.randn(r, vocab, generator=ctx.gen) * 2.0
    st = SamplingTensors.from_lists(**params, device="cpu")
    expected = np.stack(
        [
            ref_probs(
                logits[i].numpy(),
                params["temperature"][i],
                params["top_k"][i],
                params["top_p"][i],
                params["min_p"][i],
            )
            for i in range(r)
        ]
    )
    for s in (st, strip_hints(st)):
        got = sampling_probs(logits, s)
        assert got.dtype == torch.float32 and got.shape == (r, vocab)
        np.testing.assert_allclose(got.numpy(), expected, atol=2e-6, err_msg=ctx.tag)


def test_sampling_probs_fast_paths_agree(ctx: Ctx) -> None:
    # Batches whose hints select the no-sort and all-greedy shortcuts.
    r, vocab = 40, 64
    logits = torch.randn(r, vocab, generator=ctx.gen) * 2.0
    params = random_params(ctx.gen, r)
    params["top_k"] = [0] * r
    params["top_p"] = [1.0] * r
    st = SamplingTensors.from_lists(**params, device="cpu")
    assert st.uses_top_k_top_p is False
    assert torch.allclose(sampling_probs(logits, st), sampling_probs(logits, strip_hints(st)))
    params["temperature"] = [0.0] * r
    st = SamplingTensors.from_lists(**params, device="cpu")
    assert st.all_greedy is True
    onehot = torch.nn.functional.one_hot(logits.argmax(-1), vocab).float()
    assert torch.equal(sampling_probs(logits, st), onehot)
    assert torch.equal(sampling_probs(logits, strip_hints(st)), onehot)


@pytest.mark.parametrize("filters", [False, True])
def test_sampling_probs_without_greedy_rows_is_bit_identical(ctx: Ctx, filters: bool) -> None:
    """The any_greedy=False hint skips masking greedy rows: the same bits as the general path,
    with and without top-k/top-p; a batch with one greedy row keeps the general path."""
    r, vocab = 33, 257
    logits = torch.randn(r, vocab, generator=ctx.gen) * 3.0
    params = random_params(ctx.gen, r)
    params["temperature"] = (torch.rand(r, generator=ctx.gen) * 1.5 + 0.05).tolist()
    if not filters:
        params["top_k"], params["top_p"] = [0] * r, [1.0] * r
    st = SamplingTensors.from_lists(**params, device="cpu")
    assert st.any_greedy is False and st.all_greedy is False
    assert torch.equal(sampling_probs(logits, st), sampling_probs(logits, strip_hints(st))), ctx.tag
    params["temperature"][int(torch.randint(0, r, (1,), generator=ctx.gen))] = 0.0
    mixed = SamplingTensors.from_lists(**params, device="cpu")
    assert mixed.any_greedy is True
    probs = sampling_probs(logits, mixed)
    assert torch.equal(probs, sampling_probs(logits, strip_hints(mixed))), ctx.tag
    row = params["temperature"].index(0.0)
    assert probs[row].argmax() == logits[row].argmax() and probs[row].max() == 1  # one-hot


# --------------------------------------------------------------- sampled distributions

DIST_CASES = {
    "temperature": dict(temperature=0.7),
    "high_temperature": dict(temperature=1.8),
    "top_k": dict(temperature=1.0, top_k=4),
    "top_p": dict(temperature=1.0, top_p=0.75),
    "min_p": dict(temperature=1.0, min_p=0.12),
    "combined": dict(temperature=0.8, top_k=7, top_p=0.9, min_p=0.04),
}


@pytest.mark.parametrize(
    "case,scheme",
    [(c, "random") for c in DIST_CASES]
    + [("combined", "consecutive_seeds"), ("temperature", "consecutive_positions")],
)
def test_sample_distribution(ctx: Ctx, case: str, scheme: str) -> None:
    m, vocab = 20000, 12
    params = DIST_CASES[case]
    ref_args = [params.get(k, d) for k, d in (("top_k", 0), ("top_p", 1.0), ("min_p", 0.0))]
    # Redraw until the filtered distribution has a few tokens, so the test has teeth.
    for _ in range(100):
        row = torch.randn(vocab, generator=ctx.gen) * 1.5
        expected = ref_probs(row.numpy(), params["temperature"], *ref_args)
        if (expected > 0).sum() >= 3:
            break
    st = make_st(ctx.gen, m, seed_scheme=scheme, **params)
    logits = row.expand(m, vocab)
    tokens = sample(logits, st)
    counts = counts_of(tokens, vocab)
    assert counts[expected == 0].sum() == 0, f"filtered-out token sampled {ctx.tag}"
    p = chi2_pvalue(counts, expected)
    assert p > ALPHA, f"{case}/{scheme}: p={p:.2e} counts={counts} expected={expected} {ctx.tag}"


def test_chi_square_has_power(ctx: Ctx) -> None:
    # The same statistic must reject the near-miss distributions plausible bugs produce.
    m, vocab = 20000, 12
    row = torch.randn(vocab, generator=ctx.gen) * 1.5
    st = make_st(ctx.gen, m, 0.7)
    counts = counts_of(sample(row.expand(m, vocab), st), vocab)
    assert chi2_pvalue(counts, ref_probs(row.numpy(), 0.7, 0, 1.0, 0.0)) > ALPHA, ctx.tag
    for wrong_t in (0.6, 0.8, 1.0, 1 / 0.7):  # e.g. scaling by T instead of 1/T
        p = chi2_pvalue(counts, ref_probs(row.numpy(), wrong_t, 0, 1.0, 0.0))
        assert p < ALPHA, f"temperature {wrong_t} not rejected (p={p:.2e}) {ctx.tag}"


def test_greedy_is_argmax_with_ties(ctx: Ctx) -> None:
    r, vocab = 64, 50
    params = random_params(ctx.gen, r)
    logits = torch.randn(r, vocab, generator=ctx.gen)
    # Ties at the maximum in half the rows: greedy must pick the lowest index.
    for i in range(0, r, 2):
        a, b = sorted(torch.randperm(vocab, generator=ctx.gen)[:2].tolist())
        logits[i, a] = logits[i, b] = logits[i].max() + 1.0
    st = SamplingTensors.from_lists(**params, device="cpu")
    greedy = torch.tensor(params["temperature"]) == 0
    assert greedy.any()
    want = logits.argmax(-1)
    for s in (st, strip_hints(st)):
        tokens = sample(logits, s)
        assert tokens.dtype == torch.int64 and tokens.shape == (r,)
        assert torch.equal(tokens[greedy], want[greedy]), ctx.tag
    all_greedy = SamplingTensors.from_lists(
        [0.0] * r,
        params["top_k"],
        params["top_p"],
        params["min_p"],
        params["seed"],
        params["position"],
        "cpu",
    )
    for s in (all_greedy, strip_hints(all_greedy)):
        assert torch.equal(sample(logits, s), want), ctx.tag


# -------------------------------------------------------------------- reproducibility


def test_seeded_sampling_ignores_batch_mates_and_order(ctx: Ctx) -> None:
    r, extra, vocab = 32, 40, 50
    params = random_params(ctx.gen, r)
    params["temperature"] = [1.5] * r  # high temperature: tokens genuinely vary
    logits = torch.randn(r, vocab, generator=ctx.gen)
    tokens = sample(logits, SamplingTensors.from_lists(**params, device="cpu"), salt=7)

    mates = random_params(ctx.gen, extra)
    merged = {k: params[k] + mates[k] for k in params}
    big_logits = torch.cat([logits, torch.randn(extra, vocab, generator=ctx.gen)])
    perm = torch.randperm(r + extra, generator=ctx.gen)
    shuffled = {k: [v[i] for i in perm.tolist()] for k, v in merged.items()}
    st_big = SamplingTensors.from_lists(**shuffled, device="cpu")
    out = sample(big_logits[perm], st_big, salt=7)
    inv = torch.argsort(perm)
    assert torch.equal(out[inv][:r], tokens), ctx.tag
    assert torch.equal(sample(big_logits[perm], st_big, salt=7), out)

    # Same (seed, position, logits) in several rows => the same token in each.
    dup = SamplingTensors.from_lists(**{k: v[:1] * 4 for k, v in params.items()}, device="cpu")
    assert bool((sample(logits[:1].expand(4, vocab), dup, salt=7) == tokens[0]).all()), ctx.tag

    # Changing the position or the salt re-draws (many rows differ, not all).
    moved = SamplingTensors.from_lists(
        **{**params, "position": [p + 1 for p in params["position"]]}, device="cpu"
    )
    st = SamplingTensors.from_lists(**params, device="cpu")
    for other in (sample(logits, moved, salt=7), sample(logits, st, salt=8)):
        assert (other != tokens).sum() >= 8, ctx.tag


def test_repeat_interleave(ctx: Ctx) -> None:
    params = random_params(ctx.gen, 3)
    st = SamplingTensors.from_lists(**params, device="cpu")
    rep = st.repeat_interleave(4)
    assert rep.num_rows == 12
    assert rep.seed.tolist() == [s for s in params["seed"] for _ in range(4)]
    assert rep.top_p.tolist() == torch.tensor(params["top_p"]).repeat_interleave(4).tolist()
    assert rep.position.tolist() == [p + j for p in params["position"] for j in range(4)]
    flat = st.repeat_interleave(4, position_offsets=False)
    assert flat.position.tolist() == [p for p in params["position"] for _ in range(4)]
    assert rep.all_greedy == st.all_greedy and rep.uses_top_k_top_p == st.uses_top_k_top_p


def test_from_lists_validates() -> None:
    ok = dict(temperature=[1.0], top_k=[0], top_p=[1.0], min_p=[0.0], seed=[0], position=[0])
    SamplingTensors.from_lists(**ok, device="cpu")
    for key, bad in [
        ("temperature", [-0.1]),
        ("top_p", [0.0]),
        ("top_p", [1.5]),
        ("min_p", [2.0]),
        ("seed", [-1]),
        ("seed", [2**63]),
        ("top_k", [0, 0]),
    ]:
        with pytest.raises(ValueError):
            SamplingTensors.from_lists(**{**ok, key: bad}, device="cpu")


# ----------------------------------------------------------- greedy rejection sampling


def _greedy_case(vocab: int = 5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hand-built target argmaxes and drafts with known verification outcomes."""
    target_argmax = torch.tensor(
        [[1, 2, 3, 4], [0, 1, 2, 3], [4, 4, 0, 1], [2, 0, 1, 3], [3, 3, 3, 3]]
    )
    drafts = torch.tensor(
        [
            [1, 2, 3],  # all accepted -> bonus from row 3
            [2, 1, 2],  # first rejected; later matches must not count
            [4, 4, 2],  # last rejected
            [2, 1, 1],  # second rejected; third would have matched
            [3, 3, 3],  # all accepted again
        ]
    )
    logits = torch.randn(5, 4, vocab) * 0.1
    logits.scatter_(2, target_argmax[..., None], 5.0)
    want_na = torch.tensor([3, 0, 2, 1, 3])
    want_out = torch.tensor(
        [[1, 2, 3, 4], [0, -1, -1, -1], [4, 4, 0, -1], [2, 0, -1, -1], [3, 3, 3, 3]]
    )
    return logits, drafts, want_out, want_na


def test_rejection_greedy_exact(ctx: Ctx) -> None:
    logits, drafts, want_out, want_na = _greedy_case()
    r, n, vocab = drafts.shape[0], drafts.shape[1], logits.shape[-1]
    params = random_params(ctx.gen, r)
    params["temperature"] = [0.0] * r
    st = SamplingTensors.from_lists(**params, device="cpu")
    toks, probs = sample_drafts(torch.randn(r, n, vocab, generator=ctx.gen), st)
    assert probs is None and toks.shape == (r, n)
    soft_q = torch.softmax(torch.randn(r, n, vocab, generator=ctx.gen), -1)
    onehot_q = torch.nn.functional.one_hot(drafts, vocab).float()
    for s in (st, strip_hints(st)):
        for q in (None, onehot_q, soft_q):
            out, na = rejection_sample(logits, drafts, q, s)
            assert out.dtype == torch.int64 and na.dtype == torch.int64
            assert torch.equal(na, want_na), f"q={'none' if q is None else 'given'} {ctx.tag}"
            assert torch.equal(out, want_out), ctx.tag


def test_rejection_greedy_rows_unaffected_by_sampled_batch_mates(ctx: Ctx) -> None:
    logits, drafts, want_out, want_na = _greedy_case()
    r, n, vocab = drafts.shape[0], drafts.shape[1], logits.shape[-1]
    # Ties in the target: argmax (lowest index) is 0, so a draft of 3 is rejected.
    tie = torch.zeros(1, n + 1, vocab)
    tie[0, :, 0] = tie[0, :, 3] = 1.0
    logits = torch.cat([logits, tie])
    drafts = torch.cat([drafts, torch.tensor([[0, 3, 0]])])
    want_out = torch.cat([want_out, torch.tensor([[0, 0, -1, -1]])])
    want_na = torch.cat([want_na, torch.tensor([1])])

    m = 7  # sampled batch mates
    mate_params = random_params(ctx.gen, m)
    mate_params["temperature"] = [1.0] * m
    greedy_params = random_params(ctx.gen, r + 1)
    greedy_params["temperature"] = [0.0] * (r + 1)
    merged = {k: greedy_params[k] + mate_params[k] for k in greedy_params}
    st = SamplingTensors.from_lists(**merged, device="cpu")
    all_logits = torch.cat([logits, torch.randn(m, n + 1, vocab, generator=ctx.gen)])
    mate_drafts, q = sample_drafts(torch.randn(r + 1 + m, n, vocab, generator=ctx.gen), st)
    assert q is not None
    all_drafts = torch.cat([drafts, mate_drafts[r + 1 :]])
    # Greedy rows' q from sample_drafts is one-hot at the drafter argmax, not at our
    # hand-made drafts, so give them one-hot q at the drafts actually verified.
    q[: r + 1] = torch.nn.functional.one_hot(drafts, vocab).float()
    out, na = rejection_sample(all_logits, all_drafts, q, st)
    assert torch.equal(na[: r + 1], want_na), ctx.tag
    assert torch.equal(out[: r + 1], want_out), ctx.tag


def test_rejection_output_layout_and_reproducibility(ctx: Ctx) -> None:
    r, n, vocab = 24, 4, 30
    params = random_params(ctx.gen, r)
    st = SamplingTensors.from_lists(**params, device="cpu")
    target = torch.randn(r, n + 1, vocab, generator=ctx.gen)
    drafts, q = sample_drafts(target[:, :n] + 0.5 * torch.randn(r, n, vocab, generator=ctx.gen), st)
    out, na = rejection_sample(target, drafts, q, st)
    cols = torch.arange(n + 1)[None, :]
    assert torch.equal(
        torch.where(cols < na[:, None], out, -1)[:, :n],
        torch.where(cols[:, :n] < na[:, None], drafts, -1),
    ), ctx.tag
    assert bool((out.gather(1, na[:, None]) >= 0).all())
    assert bool((out[cols > na[:, None]] == -1).all())
    # Same requests in another order and batch => identical per-request results.
    perm = torch.randperm(r, generator=ctx.gen)
    st_p = SamplingTensors.from_lists(
        **{k: [v[i] for i in perm.tolist()] for k, v in params.items()}, device="cpu"
    )
    out_p, na_p = rejection_sample(target[perm], drafts[perm], q[perm], st_p)
    assert torch.equal(out_p, out[perm]) and torch.equal(na_p, na[perm]), ctx.tag
    # The extra token is pinned to its own stream: (seed, first position + num_accepted,
    # resample salt), drawn from max(p - q, 0) at a rejection and from p at the bonus row.
    rows = torch.arange(r)
    p_at = sampling_probs(target[rows, na], st)
    q_at = torch.where((na < n)[:, None], q[rows, na.clamp(max=n - 1)], 0.0)
    at = SamplingTensors(st.temperature, st.top_k, st.top_p, st.min_p, st.seed, st.position + na)
    extra = sample_from_probs((p_at - q_at).clamp(min=0), at, SALT_RESAMPLE)
    assert torch.equal(out.gather(1, na[:, None]).squeeze(1), extra), ctx.tag
    # No drafts at all: a plain sample from p with the resample salt.
    out0, na0 = rejection_sample(target[:, :1], drafts[:, :0], q[:, :0], st)
    assert out0.shape == (r, 1) and bool((na0 == 0).all())
    assert torch.equal(out0[:, 0], sample(target[:, 0], st, salt=SALT_RESAMPLE)), ctx.tag


# ------------------------------------------------------------ lossless rejection sampling


def _distinct_pair(gen: torch.Generator, vocab: int, sampling: dict) -> tuple:
    """Target/draft logits whose (filtered) distributions differ enough to give bugs teeth."""
    args = (
        sampling["temperature"],
        sampling.get("top_k", 0),
        sampling.get("top_p", 1.0),
        sampling.get("min_p", 0.0),
    )
    for _ in range(200):
        target = torch.randn(3, vocab, generator=gen) * 1.2
        draft = torch.randn(2, vocab, generator=gen) * 1.2
        p = [ref_probs(t.numpy(), *args) for t in target]
        q = [ref_probs(d.numpy(), *args) for d in draft]
        acc = np.minimum(p[0], q[0]).sum()
        resid = np.maximum(p[0] - q[0], 0)
        resid /= resid.sum()
        # Output distribution of the "resample from p" bug, and of "accept w.p. p(d)".
        bug_a = np.minimum(p[0], q[0]) + (1 - acc) * p[0]
        bug_b = q[0] * p[0] + (1 - (q[0] * p[0]).sum()) * resid
        tv = lambda a, b: 0.5 * np.abs(a - b).sum()  # noqa: E731
        if min(tv(p[0], q[0]), tv(bug_a, p[0]) * 4, tv(bug_b, p[0]) * 4) > 0.2 and all(
            (x > 0).sum() >= 3 for x in p
        ):
            break
    return target, draft, p, q


@pytest.mark.parametrize(
    "sampling",
    [dict(temperature=1.0), dict(temperature=0.8, top_k=5, top_p=0.95, min_p=0.02)],
    ids=["plain", "filtered"],
)
def test_rejection_sampling_is_lossless(ctx: Ctx, sampling: dict) -> None:
    m, n, vocab = 30000, 2, 6
    target, draft, p, q = _distinct_pair(ctx.gen, vocab, sampling)
    st = make_st(ctx.gen, m, **sampling)
    # Target rows do not depend on the prefix, so the ideal output is i.i.d. p0, p1, p2.
    target_logits = target.expand(m, n + 1, vocab)
    drafts, draft_probs = sample_drafts(draft.expand(m, n, vocab), st)
    assert draft_probs is not None
    np.testing.assert_allclose(draft_probs[0].numpy(), np.stack(q), atol=2e-6)
    for i in range(n):
        pv = chi2_pvalue(counts_of(drafts[:, i], vocab), q[i])
        assert pv > ALPHA, f"draft {i} not ~ q (p={pv:.2e}) {ctx.tag}"

    out, na = rejection_sample(target_logits, drafts, draft_probs, st)
    first = out[:, 0]
    pv = chi2_pvalue(counts_of(first, vocab), p[0])
    assert pv > ALPHA, f"first token not ~ p0 (p={pv:.2e}) {ctx.tag}"
    # Acceptance rate of the first draft is sum(min(p0, q0)).
    acc = float(np.minimum(p[0], q[0]).sum())
    z = ((na >= 1).sum().item() - m * acc) / np.sqrt(m * acc * (1 - acc))
    assert abs(z) < 5, f"first-draft acceptance off (z={z:.1f}) {ctx.tag}"
    # Rejected-first rows draw from the normalised residual.
    resid = np.maximum(p[0] - q[0], 0)
    pv = chi2_pvalue(counts_of(first[na == 0], vocab), resid)
    assert pv > ALPHA, f"residual sample off (p={pv:.2e}) {ctx.tag}"
    assert counts_of(first[na == 0], vocab)[resid == 0].sum() == 0, ctx.tag
    # Given the first draft was accepted, the second output is ~ p1; the bonus is ~ p2.
    pv = chi2_pvalue(counts_of(out[na >= 1, 1], vocab), p[1])
    assert pv > ALPHA, f"second token not ~ p1 (p={pv:.2e}) {ctx.tag}"
    pv = chi2_pvalue(counts_of(out[na == 2, 2], vocab), p[2])
    assert pv > ALPHA, f"bonus token not ~ p2 (p={pv:.2e}) {ctx.tag}"

    # Power: the same statistic, on the same random draws, rejects two classic bugs.
    p0 = torch.tensor(p[0], dtype=torch.float32).expand(m, vocab)
    q0 = draft_probs[:, 0]
    d0 = drafts[:, 0]
    u = hashed_uniform(st.seed, st.position, SALT_ACCEPT)
    p_d = p0.gather(1, d0[:, None]).squeeze(1)
    q_d = q0.gather(1, d0[:, None]).squeeze(1)

    def first_token(accept: torch.Tensor, resample_from: torch.Tensor) -> torch.Tensor:
        return torch.where(accept, d0, sample_from_probs(resample_from, st, SALT_RESAMPLE))

    good = first_token(u * q_d < p_d, (p0 - q0).clamp(min=0))
    assert torch.equal(good, first), "local reference disagrees with rejection_sample"
    bugs = {
        "resample from p instead of the residual": first_token(u * q_d < p_d, p0),
        "accept with p(d) ignoring q(d)": first_token(u < p_d, (p0 - q0).clamp(min=0)),
    }
    for name, tokens in bugs.items():
        pv = chi2_pvalue(counts_of(tokens, vocab), p[0])
        assert pv < ALPHA, f"bug '{name}' not detected (p={pv:.2e}) {ctx.tag}"


def test_rejection_sampling_lossless_with_one_hot_drafts(ctx: Ctx) -> None:
    # draft_probs=None: drafts are deterministic (q one-hot), the target is sampled.
    m, n, vocab = 30000, 2, 6
    target, _, p, _ = _distinct_pair(ctx.gen, vocab, dict(temperature=1.0))
    st = make_st(ctx.gen, m, 1.0)
    # Drafts vary across rows but independently of the sampler's randomness.
    drafts = torch.randint(0, vocab, (m, n), generator=ctx.gen)
    out, na = rejection_sample(target.expand(m, n + 1, vocab), drafts, None, st)
    pv = chi2_pvalue(counts_of(out[:, 0], vocab), p[0])
    assert pv > ALPHA, f"first token not ~ p0 (p={pv:.2e}) {ctx.tag}"
    pv = chi2_pvalue(counts_of(out[na >= 1, 1], vocab), p[1])
    assert pv > ALPHA, f"second token not ~ p1 (p={pv:.2e}) {ctx.tag}"
    # Acceptance is exactly p(d): check in aggregate.
    acc = float(np.mean(p[0][drafts[:, 0].numpy()]))
    z = ((na >= 1).sum().item() - m * acc) / np.sqrt(m * acc * (1 - acc))
    assert abs(z) < 5, f"acceptance with one-hot q off (z={z:.1f}) {ctx.tag}"
    # A rejected one-hot draft can never be re-emitted.
    rejected = na == 0
    assert bool((out[rejected, 0] != drafts[rejected, 0]).all()), ctx.tag


def test_greedy_rejection_fast_path_equals_general_path(ctx: Ctx) -> None:
    r, n, vocab = 24, 5, 12
    logits = torch.randn(r, n + 1, vocab, generator=ctx.gen)
    argmax = logits.argmax(-1)
    # Drafts that follow the target's argmax for a random number of steps, then deviate.
    drafts = argmax[:, :n].clone()
    cut = torch.randint(0, n + 1, (r,), generator=ctx.gen)
    for i, c in enumerate(cut.tolist()):
        if c < n:
            drafts[i, c] = (drafts[i, c] + 1) % vocab
    st = SamplingTensors.from_lists(
        [0.0] * r, [0] * r, [1.0] * r, [0.0] * r, list(range(r)), [7] * r, "cpu"
    )
    fast = rejection_sample(logits, drafts, None, st)
    general = rejection_sample(logits, drafts, None, strip_hints(st))
    assert torch.equal(fast[1], cut) and torch.equal(general[1], cut), ctx.tag
    assert torch.equal(fast[0], general[0]), ctx.tag
