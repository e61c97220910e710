"""Host lists packed into aligned device views (`blockdraft.kernels.host_tensors`), and a step's KV
slots from its block tables (`blockdraft.runtime.host_batch`)."""

import random

import torch

from blockdraft.kernels.host_tensors import host_tensors, int64_tensors
from blockdraft.runtime.host_batch import decode_slots, flat_slots


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


def test_float32_tensors_are_aligned_views_of_one_copy(py_rng: random.Random) -> None:
    """Float32 parts of any length (1-3 elements leave a view unaligned unless padded): each
    view 16-byte aligned, values as float32 rounds them, all views of one buffer."""
    parts = [[py_rng.uniform(-2, 2) for _ in range(py_rng.randrange(1, 6))] for _ in range(4)]
    parts[1] = parts[1][:1]
    views = host_tensors(torch.device("cpu"), torch.float32, *parts)
    want = [torch.tensor(p, dtype=torch.float32) for p in parts]
    assert all(torch.equal(v, w) for v, w in zip(views, want, strict=True))
    assert all(v.dtype == torch.float32 and v.data_ptr() % 16 == 0 for v in views)
    base = views[0].untyped_storage().data_ptr()
    assert all(v.untyped_storage().data_ptr() == base for v in views)


def test_decode_slots_are_flat_slots_of_one_row_a_request(py_rng: random.Random) -> None:
    """The one-row-a-request fast path gives the general walk's slots."""
    block_size = py_rng.choice([1, 4, 16])
    tables = [py_rng.sample(range(100), py_rng.randrange(1, 6)) for _ in range(5)]
    positions = [py_rng.randrange(len(t) * block_size) for t in tables]
    got = decode_slots(tables, positions, block_size)
    assert got == flat_slots(tables, positions, [1] * len(tables), block_size)
