import os

import pytest
import torch

# Tests check numerics in float32 on the CPU; a couple of threads keep CI (2 cores) steady.
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture
def rng() -> torch.Generator:
    """Fresh randomness per run; the seed is printed so a failure can be replayed."""
    seed = int(os.environ.get("BLOCKDRAFT_TEST_SEED", torch.seed() % 2**31))
    print(f"test seed: {seed} (set BLOCKDRAFT_TEST_SEED to replay)")
    return torch.Generator().manual_seed(seed)
