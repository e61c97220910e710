"""`blockdraft.kernels.triton_gated_delta_rule` against its torch twin: outputs and the states it
leaves in the pool's slots, for sequences that take different numbers of tokens, start fresh or
from their slot, keep or drop what they reach (verify blocks), and value heads sharing key heads.

Runs under Triton's interpreter on the CPU (TRITON_INTERPRET=1, set by tests/conftest.py)."""

import pytest
import torch

from blockdraft.kernels.triton_gated_delta_rule import (
    recurrent_gated_delta_rule_pool_torch,
    triton_recurrent_gated_delta_rule,
)

from kernel_inputs import ATOL, DEVICE, needs_triton, randn

pytestmark = needs_triton


@pytest.mark.parametrize("t", [1, 5])
@pytest.mark.parametrize("heads, dims", [((2, 4), (8, 8)), ((1, 1), (12, 40))])
def test_recurrence_matches_twin(rng, t: int, heads: tuple, dims: tuple) -> None:
    (hk, hv), (dk, dv) = heads, dims
    s, num_slots = 4, 6
    q, k = randn(rng, s, t, hk, dk), randn(rng, s, t, hk, dk)
    v = randn(rng, s, t, hv, dv)
    g = -torch.rand(s, t, hv, generator=rng).to(DEVICE)
    beta = torch.rand(s, t, hv, generator=rng).to(DEVICE)
    pool = randn(rng, num_slots, hv, dk, dv)
    slots = torch.tensor([3, 0, -1, 4], device=DEVICE)
    fresh = torch.tensor([False, True, False, False], device=DEVICE)
    lengths = torch.tensor([t, min(2, t), 0, t], device=DEVICE)
    write = torch.tensor([True, True, True, False], device=DEVICE)
    want_pool, got_pool = pool.clone(), pool.clone()
    args = (q, k, v, g, beta)
    want = recurrent_gated_delta_rule_pool_torch(*args, want_pool, slots, fresh, lengths, write)
    got = triton_recurrent_gated_delta_rule(*args, got_pool, slots, fresh, lengths, write)
    assert torch.allclose(got, want, atol=ATOL, rtol=1e-4)
    assert torch.allclose(got_pool, want_pool, atol=ATOL, rtol=1e-4)
    assert torch.equal(got_pool[[1, 2, 4]], pool[[1, 2, 4]])  # untouched, or not written
