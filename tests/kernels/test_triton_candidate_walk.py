"""`blockdraft.kernels.triton_candidate_walk` against its torch twin (`kernels.candidate_walk`,
which tests/spec_decode/test_candidate_selection.py and the DFlash2 drafter tests hold to the
reference walk and to z-lab's selector).

Runs on the CPU through Triton's interpreter (TRITON_INTERPRET=1); small shapes."""

import pytest
import torch

from blockdraft.kernels.candidate_walk import candidate_walk_torch
from blockdraft.kernels.triton_candidate_walk import triton_candidate_walk
from blockdraft.spec_decode.rejection_sampler import SALT_DRAFT

from kernel_inputs import DEVICE, needs_triton, randn

pytestmark = needs_triton


def _inputs(rng: torch.Generator, r: int, n: int, k: int, rank: int, vocab: int, dtype):
    """Distinct candidates per position (as top-K gives), codebooks of `dtype`, logits spread
    enough that the walk's picks depend on the pair scores."""
    candidates = torch.stack([torch.randperm(vocab, generator=rng)[:k] for _ in range(r * n)]).view(
        r, n, k
    )
    return dict(
        projected=randn(rng, r, n, rank, dtype=dtype),
        unary=randn(rng, r, n, k) * 2,
        candidates=candidates.to(DEVICE),
        anchors=torch.randint(0, vocab, (r,), generator=rng).to(DEVICE),
        predecessor_codebook=randn(rng, vocab, rank, dtype=dtype),
        successor_codebook=randn(rng, vocab, rank, dtype=dtype),
    )


@pytest.mark.parametrize(
    ("r", "n", "k", "rank"), [(3, 5, 4, 8), (2, 7, 16, 32), (1, 1, 3, 5), (4, 15, 16, 64)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_walk_equals_twin(rng, r: int, n: int, k: int, rank: int, dtype) -> None:
    """Greedy and sampled requests in one batch: the same tokens, and q equal to the twin's
    (one-hot on greedy rows)."""
    args = _inputs(rng, r, n, k, rank, 40, dtype)
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.6])[:r].to(DEVICE)
    seed = torch.randint(0, 2**62, (r,), generator=rng).to(DEVICE)
    position = torch.randint(0, 1 << 30, (r,), generator=rng).to(DEVICE)
    want = candidate_walk_torch(**args, temperature=temperature, seed=seed, position=position,
                                salt=SALT_DRAFT)  # fmt: skip
    got = triton_candidate_walk(**args, temperature=temperature, seed=seed, position=position,
                                salt=SALT_DRAFT)  # fmt: skip
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-4)
    assert torch.equal(got[1][0], torch.nn.functional.one_hot(
        (args["candidates"][0] == got[0][0][:, None]).int().argmax(-1), k).float())  # fmt: skip


def test_requests_draw_alone(rng) -> None:
    """A request's path depends on its own seed and positions, not on its batch mates."""
    r, n, k, rank = 4, 6, 8, 16
    args = _inputs(rng, r, n, k, rank, 50, torch.float32)
    temperature = torch.full((r,), 1.2, device=DEVICE)
    seed = torch.randint(0, 2**62, (r,), generator=rng).to(DEVICE)
    position = torch.randint(0, 1 << 30, (r,), generator=rng).to(DEVICE)
    tokens, q = triton_candidate_walk(**args, temperature=temperature, seed=seed,
                                      position=position, salt=SALT_DRAFT)  # fmt: skip
    for i in range(r):
        one = {name: (t if name.endswith("codebook") else t[i : i + 1]) for name, t in args.items()}
        alone = triton_candidate_walk(**one, temperature=temperature[i : i + 1],
                                      seed=seed[i : i + 1], position=position[i : i + 1],
                                      salt=SALT_DRAFT)  # fmt: skip
        assert torch.equal(alone[0][0], tokens[i]) and torch.equal(alone[1][0], q[i])


def test_mismatched_codebook_is_refused(rng) -> None:
    args = _inputs(rng, 1, 2, 4, 8, 20, torch.float32)
    args["successor_codebook"] = randn(rng, 20, 6)
    zero = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="successor codebook"):
        triton_candidate_walk(**args, temperature=torch.zeros(1, device=DEVICE), seed=zero,
                              position=zero, salt=SALT_DRAFT)  # fmt: skip
