"""`blockdraft.kernels.triton_sampling`: hashed uniforms bit-exact and the exponential race
against the torch code, and sample() / the rejection sampler unchanged on that backend.

Runs on the CPU through Triton's interpreter (TRITON_INTERPRET=1, which tests/conftest.py sets
on a machine without a GPU). With TRITON_INTERPRET=0 on a CUDA machine the same tests run the
compiled kernels on the GPU. Shapes stay small: the interpreter costs about half a millisecond
per program.
"""

import pytest
import torch

from blockdraft.kernels.sampling import exponential_race_torch, hashed_uniform
from blockdraft.kernels.triton_sampling import triton_exponential_race, triton_hashed_uniform
from blockdraft.layers.sampler import SamplingTensors, sample
from blockdraft.spec_decode.rejection_sampler import rejection_sample, sample_drafts

from kernel_inputs import (
    DEVICE,
    needs_triton,
    randn,
)

pytestmark = needs_triton


MAX_SEED = 2**63 - 1


def seeds_and_positions(rng: torch.Generator, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[num_rows] int64 seeds in [0, 2**63) and positions, the extremes first."""
    seed = torch.randint(0, MAX_SEED, (num_rows,), generator=rng)
    pos = torch.randint(0, 1 << 62, (num_rows,), generator=rng)
    special_seeds = [0, MAX_SEED, 2**32, 2**32 - 1, 2**31]
    special_pos = [0, 2**62 + 12345, 1, 2**32, 5]
    k = min(num_rows, len(special_seeds))
    seed[:k] = torch.tensor(special_seeds[:k])
    pos[:k] = torch.tensor(special_pos[:k])
    return seed.to(DEVICE), pos.to(DEVICE)


@pytest.mark.parametrize("num_rows", [0, 1, 5])
@pytest.mark.parametrize("width", [None, 0, 1, 7, 1000, pytest.param(5000, marks=pytest.mark.slow)])
def test_hashed_uniform_bit_exact(rng, num_rows: int, width: int | None) -> None:
    seed, pos = seeds_and_positions(rng, num_rows)
    salts = [0, 1, 0x0ACCE9, 2**40 + 0x5E5A3, 2**64 - 1]
    salts.append(int(torch.randint(0, 2**62, (), generator=rng)) * 3)  # a fresh 64-bit salt
    for salt in salts:
        expected = hashed_uniform(seed, pos, salt, width)
        got = triton_hashed_uniform(seed, pos, salt, width)
        assert got.shape == expected.shape and got.dtype == torch.float32
        assert torch.equal(got, expected), f"salt={salt}"
    # int32 inputs are widened as by the torch code
    small = seed.to(torch.int32), pos.to(torch.int32)
    assert torch.equal(triton_hashed_uniform(*small, 3, width), hashed_uniform(*small, 3, width))


def check_race(
    probs: torch.Tensor, seed: torch.Tensor, pos: torch.Tensor, salt: int
) -> tuple[int, int]:
    """Asserts the kernel's winners against the torch race; returns (rows, exact rows)."""
    expected = exponential_race_torch(probs, seed, pos, salt)
    got = triton_exponential_race(probs, seed, pos, salt)
    assert got.shape == expected.shape and got.dtype == torch.int64
    if probs.shape[0] == 0:
        return 0, 0
    # The kernel's log may differ from torch's by an ulp: a different winner is only allowed
    # when its torch score ties the best one within that.
    u = hashed_uniform(seed, pos, salt, probs.shape[-1])
    scores = probs / -torch.log(u)
    best = scores.gather(1, expected[:, None]).squeeze(1)
    mine = scores.gather(1, got[:, None]).squeeze(1)
    torch.testing.assert_close(mine, best, rtol=1e-6, atol=0)
    return probs.shape[0], int((got == expected).sum())


@pytest.mark.parametrize("num_rows", [0, 1, 6])
# 5000: three blocks, the last partial
@pytest.mark.parametrize("vocab", [1, 7, 2048, pytest.param(5000, marks=pytest.mark.slow)])
def test_exponential_race(rng, num_rows: int, vocab: int) -> None:
    seed, pos = seeds_and_positions(rng, num_rows)
    probs = torch.rand(num_rows, vocab, generator=rng) ** 4
    probs[torch.rand(num_rows, vocab, generator=rng) < 0.3] = 0.0  # zero entries
    if num_rows > 2:
        probs[1] = 0.0
        probs[1, vocab // 2] = 1.0  # one-hot: always that token
        probs[2] = 0.0  # all zero: every score 0, argmax picks index 0
    probs = probs.to(DEVICE)
    rows = exact = 0
    for salt in (0, 2**40 + 7):
        got_rows, got_exact = check_race(probs, seed, pos, salt)
        rows, exact = rows + got_rows, exact + got_exact
        if num_rows > 2:
            winners = triton_exponential_race(probs, seed, pos, salt)
            assert winners[1] == vocab // 2 and winners[2] == 0
    assert exact == rows  # an ulp-tie between the two best scores is this unlikely
    # Strided rows (a slice), half precision, and ties between equal scores (lowest index).
    wide = torch.rand(num_rows, vocab + 3, generator=rng).to(DEVICE)
    check_race(wide[:, 3:], seed, pos, 5)
    check_race(wide[:, 3:].to(torch.bfloat16), seed, pos, 5)
    tied = torch.zeros(num_rows, vocab, device=DEVICE)
    got = triton_exponential_race(tied, seed, pos, 5)
    assert torch.equal(got, torch.zeros(num_rows, dtype=torch.int64, device=DEVICE))


def test_exponential_race_nan_wins_like_torch(rng) -> None:
    seed, pos = seeds_and_positions(rng, 3)
    probs = torch.rand(3, 3000, generator=rng).to(DEVICE)
    probs[0, 2500] = float("nan")
    probs[0, 2600] = float("nan")
    probs[1, 10] = float("inf")
    probs[2, 2999] = float("nan")
    probs[2, 5] = float("inf")
    expected = exponential_race_torch(probs, seed, pos, 9)
    assert expected.tolist() == [2500, 10, 2999]
    assert torch.equal(triton_exponential_race(probs, seed, pos, 9), expected)


def test_sampling_same_with_triton_backend(rng, monkeypatch, set_policy) -> None:
    """sample() and the rejection sampler with the Triton hash/race against the torch ones."""
    num_rows, n, vocab = 4, 3, 300
    seed, pos = seeds_and_positions(rng, num_rows)
    st = SamplingTensors.from_lists(
        temperature=[1.0, 1.0, 0.7, 0.0],
        top_k=[0, 20, 0, 0],
        top_p=[1.0, 1.0, 0.9, 1.0],
        min_p=[0.0, 0.0, 0.0, 0.05],
        seed=seed.tolist(),
        position=pos.tolist(),
        device=DEVICE,
    )
    logits = randn(rng, num_rows, vocab)
    draft_logits = randn(rng, num_rows, n, vocab)
    # Targets close to the drafts, so some drafts get accepted and some rejected.
    target_logits = torch.cat([draft_logits, randn(rng, num_rows, 1, vocab)], dim=1)
    target_logits = target_logits + 0.5 * randn(rng, num_rows, n + 1, vocab)

    def run(backend: str) -> list[torch.Tensor]:
        set_policy(backend=backend)
        drafts, q = sample_drafts(draft_logits, st)
        out, accepted = rejection_sample(target_logits, drafts, q, st)
        one_hot_out, one_hot_accepted = rejection_sample(target_logits, drafts, None, st)
        return [sample(logits, st, salt=3), drafts, out, accepted, one_hot_out, one_hot_accepted]

    expected = run("torch")
    calls = {"hash": 0, "race": 0}

    def counting_hash(*args: object, **kwargs: object) -> torch.Tensor:
        calls["hash"] += 1
        return triton_hashed_uniform(*args, **kwargs)

    def counting_race(*args: object, **kwargs: object) -> torch.Tensor:
        calls["race"] += 1
        return triton_exponential_race(*args, **kwargs)

    monkeypatch.setattr("blockdraft.kernels.triton_sampling.triton_hashed_uniform", counting_hash)
    monkeypatch.setattr("blockdraft.kernels.triton_sampling.triton_exponential_race", counting_race)
    got = run("triton")
    assert calls == {"hash": 2, "race": 4}
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g, e)
