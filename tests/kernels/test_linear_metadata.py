"""A forward's linear-attention metadata (`build_linear_metadata`): which rows form the step
batch and the packed prefill, and that its device tensors come through one page-locked copy
each (a `torch.tensor(list, device=cuda)` copies from pageable memory and waits for every
forward queued before it, which stops a step launched ahead from overlapping the last)."""

from __future__ import annotations

import torch

from blockdraft.kernels import forward_context
from blockdraft.kernels.forward_context import build_linear_metadata


def random_batch(rng: torch.Generator) -> tuple[list[int], list[bool]]:
    """Query lengths (1: decode, more: prefill chunk or verify block) and verify flags."""
    count = int(torch.randint(3, 9, (), generator=rng))
    lens = torch.randint(1, 7, (count,), generator=rng).tolist()
    verify = [n > 1 and bool(torch.rand((), generator=rng) < 0.5) for n in lens]
    lens[0], verify[0] = 5, False  # one prefill chunk at least
    lens[1], verify[1] = 3, True  # one verify block at least
    return lens, verify


def test_rows_of_steps_and_prefill_chunks(rng) -> None:
    lens, verify = random_batch(rng)
    starts = [sum(lens[:i]) for i in range(len(lens))]
    slots = torch.arange(len(lens))
    meta = build_linear_metadata(slots, slots == 0, lens, verify)
    stepped = [i for i, n in enumerate(lens) if n == 1 or verify[i]]
    prefill = [i for i in range(len(lens)) if i not in stepped]
    assert meta.step.seqs.tolist() == stepped
    assert meta.step.lengths.tolist() == [lens[i] for i in stepped]
    assert meta.step.write.dtype == torch.bool
    assert meta.step.write.tolist() == [not verify[i] for i in stepped]
    assert meta.step.verify.tolist() == [j for j, i in enumerate(stepped) if verify[i]]
    width = max(lens[i] for i in stepped)
    for j, i in enumerate(stepped):  # past a sequence's end: its last row
        want = [starts[i] + min(t, lens[i] - 1) for t in range(width)]
        assert meta.step.rows[j].tolist() == want
    out = meta.step.out_dst.tolist()
    assert sorted(out) == [starts[i] + t for i in stepped for t in range(lens[i])]
    packed = meta.packed
    assert packed.seqs.tolist() == prefill
    assert packed.rows.tolist() == [starts[i] + t for i in prefill for t in range(lens[i])]
    assert packed.cu_seqlens.dtype == torch.int32
    assert packed.cu_seqlens.tolist() == packed.host_cu_seqlens
    assert packed.host_cu_seqlens[-1] == sum(lens[i] for i in prefill)


def test_device_tensors_come_through_one_host_copy_each(rng, monkeypatch) -> None:
    """No `torch.tensor` from a list: the step batch, the packed prefill and its conv windows
    take one `int64_tensors` copy each."""
    calls: list[int] = []
    real = forward_context.int64_tensors

    def counted(device: torch.device, *parts: list[int]) -> list[torch.Tensor]:
        calls.append(len(parts))
        return real(device, *parts)

    def refused(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("torch.tensor from a list: a pageable copy that waits for the GPU")

    lens, verify = random_batch(rng)
    slots = torch.arange(len(lens))
    monkeypatch.setattr(forward_context, "int64_tensors", counted)
    monkeypatch.setattr(torch, "tensor", refused)
    meta = build_linear_metadata(slots, slots == 0, lens, verify)
    window, out, state = meta.packed.conv_windows(3)
    assert calls == [7, 3, 3]
    assert state.shape == (len(meta.prefill), 3) and len(out) == meta.packed.rows.numel()
    assert len(window) == len(out) + 3 * len(meta.prefill)
