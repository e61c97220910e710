"""`blockdraft.runtime.host_batch`: host lists packed into aligned int64 views."""

import random

import torch

from blockdraft.kernels.host_tensors import int64_tensors


def test_int64_tensors(py_rng: random.Random) -> None:
    parts = [[py_rng.randrange(-99, 99) for _ in range(py_rng.randrange(6))] for _ in range(5)]
    parts[0] = parts[0][:1] or [7]  # an odd length first, an empty part next
    parts[1] = []
    views = int64_tensors(torch.device("cpu"), *parts)
    assert [v.tolist() for v in views] == parts
    assert all(v.dtype == torch.int64 and v.is_contiguous() for v in views)
    # 16-byte aligned views whatever the lengths before them (odd ones included): Triton
    # specialises kernels on pointer alignment.
    assert all(v.data_ptr() % 16 == 0 for v in views)
