"""`blockdraft.spec_decode.rejection_sampler`: greedy verification exact, sampled verification
lossless (the output distribution is the target's), with or without draft probabilities.

Inputs are fresh every run (the `ctx` fixture); a failing assertion names its replay seed.
Statistical checks use a chi-square test at ALPHA (tests/sampling_checks.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from blockdraft.kernels.sampling import hashed_uniform
from blockdraft.layers.sampler import SamplingTensors, sample, sample_from_probs, sampling_probs
from blockdraft.spec_decode.rejection_sampler import (
    SALT_ACCEPT,
    SALT_RESAMPLE,
    rejection_sample,
    sample_drafts,
)

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
