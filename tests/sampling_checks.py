"""Helpers for the sampler tests (tests/kernels/test_sampling.py, tests/layers/test_sampler.py,
tests/spec_decode/test_rejection_sampler.py).

Inputs are fresh every run. The base seed is printed (pytest shows it for failing
tests) and included in assertion messages; export BLOCKDRAFT_TEST_SEED=<value> to
replay a run. Statistical checks use a chi-square test at ALPHA, small enough that a
correct implementation essentially never trips it, while the sample sizes make the
plausible bugs fail by dozens of orders of magnitude (see the power checks in
tests/layers/test_sampler.py).
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass

import numpy as np
import torch

from blockdraft.layers.sampler import SamplingTensors

_ENV_SEED = os.environ.get("BLOCKDRAFT_TEST_SEED")
BASE_SEED = int(_ENV_SEED) if _ENV_SEED else secrets.randbits(48)
ALPHA = 1e-5
MAX_SEED = 2**63 - 1


@dataclass
class Ctx:
    gen: torch.Generator
    tag: str  # appended to assertion messages so a failure names its replay seed


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


def seeded_samples(
    llm: object, prompt: list[int], num: int, top_k: int, max_tokens: int = 3
) -> list[list[int]]:
    """The tokens of `num` requests for `prompt` at T = 1 (top_k), seeded 0..num-1: for
    comparing the law of speculative decoding's tokens with plain decoding's."""
    from blockdraft import SamplingParams

    params = [
        SamplingParams(temperature=1.0, top_k=top_k, max_tokens=max_tokens, ignore_eos=True, seed=s)
        for s in range(num)
    ]
    outs = llm.generate([prompt] * num, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def two_sample_pvalue(a: list[int], b: list[int]) -> float:
    """Chi-square test that two samples of small integers share one law (bins with fewer than
    5 draws in both samples together are pooled)."""
    from scipy.stats import chi2_contingency

    values = sorted(set(a) | set(b))
    table = [[a.count(v) for v in values], [b.count(v) for v in values]]
    big = [i for i in range(len(values)) if table[0][i] + table[1][i] >= 5]
    small = [i for i in range(len(values)) if i not in big]
    table = [[row[i] for i in big] + [sum(row[i] for i in small)] for row in table]
    table = [row if small else row[:-1] for row in table]
    return chi2_contingency(table).pvalue


def assert_same_token_law(
    plain: list[list[int]], speculative: list[list[int]], positions: tuple[int, ...]
) -> None:
    """At each position, the tokens of the two runs (seeded_samples) share one law."""
    for position in positions:
        a = [tokens[position] for tokens in plain]
        s = [tokens[position] for tokens in speculative]
        assert two_sample_pvalue(a, s) > ALPHA, (
            position, sorted(set(a)), sorted(set(s)), f"BLOCKDRAFT_TEST_SEED={BASE_SEED}"
        )  # fmt: skip
