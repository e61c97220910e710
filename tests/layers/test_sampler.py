"""`blockdraft.layers.sampler`: sampling_probs against a float64 reference, sampled
distributions, greedy argmax, seeded reproducibility whatever the batch, SamplingTensors.

Inputs are fresh every run (the `ctx` fixture); a failing assertion names its replay seed.
Statistical checks use a chi-square test at ALPHA (tests/sampling_checks.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from blockdraft.layers.sampler import SamplingTensors, sample, sampling_probs

from sampling_checks import (
    ALPHA,
    Ctx,
    chi2_pvalue,
    counts_of,
    make_st,
    random_params,
    ref_probs,
    strip_hints,
)

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
