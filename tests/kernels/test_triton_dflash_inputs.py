"""`blockdraft.kernels.triton_dflash_inputs`: the drafter's inputs built on the device against
the torch twin, and the twin against a host-side construction from lists.

Runs on the CPU through Triton's interpreter (TRITON_INTERPRET=1, which tests/conftest.py sets
on a machine without a GPU). With TRITON_INTERPRET=0 on a CUDA machine the same tests run the
compiled kernels on the GPU. Shapes stay small: the interpreter costs about half a millisecond
per program.
"""

import dataclasses

import pytest
import torch

from blockdraft.kernels.dflash_inputs import DFlashInputs, prepare_dflash_inputs_torch
from blockdraft.kernels.forward_context import PAD_SLOT_ID
from blockdraft.kernels.triton_dflash_inputs import prepare_dflash_inputs
from blockdraft.runtime.host_batch import build_attention_metadata, slots_for_positions

from kernel_inputs import (
    DEVICE,
    needs_triton,
)

pytestmark = needs_triton


def dflash_case(
    rng: torch.Generator,
    num_reqs: int,
    num_spec: int,
    block_size: int,
    drafts: torch.Tensor | None = None,  # [num_reqs] bool: which requests draft; random if None
) -> tuple[dict, list[list[int]]]:
    """Requests laid out as a verify/prefill batch: each has its committed rows followed by
    a few rejected ones. A random subset drafts (their block tables cover the block [anchor,
    MASK x N]); the others are mid-prefill chunks whose tables end at their last committed
    row, so a query block for them would fall past their table."""
    num_ctx = torch.randint(0, 6, (num_reqs,), generator=rng)
    num_ctx[:1] = 1  # a decode-like request with one committed row
    rejected = torch.randint(0, 3, (num_reqs,), generator=rng)
    rows = num_ctx + rejected
    starts = torch.cumsum(rows, 0) - rows
    anchor_positions = num_ctx + torch.randint(0, 20, (num_reqs,), generator=rng)
    if drafts is None:
        drafts = torch.rand(num_reqs, generator=rng) < 0.7
    tables = [
        torch.randperm(200, generator=rng)[
            : (int(p) + num_spec) // block_size + 1 if d else max(-(-int(p) // block_size), 1)
        ].tolist()
        for p, d in zip(anchor_positions, drafts, strict=True)
    ]
    args = dict(
        anchor_tokens=torch.randint(0, 50, (num_reqs,), generator=rng).to(DEVICE),
        anchor_positions=anchor_positions.to(DEVICE),
        ctx_row_start=starts.to(DEVICE),
        num_ctx=num_ctx.to(DEVICE),
        proposers=torch.nonzero(drafts).flatten().to(DEVICE),
        block_size=block_size,
        num_spec=num_spec,
        mask_token_id=99,
    )
    return args, tables


def padded_tables(tables: list[list[int]], num_rows: int) -> torch.Tensor:
    width = max([len(t) for t in tables] + [1])
    rows = [t + [0] * (width - len(t)) for t in tables] + [[0] * width] * (num_rows - len(tables))
    return torch.tensor(rows, dtype=torch.int64, device=DEVICE).view(-1, width)


def poisoned(num_reqs_padded: int, num_spec: int, num_ctx_rows: int) -> DFlashInputs:
    out = DFlashInputs.empty(num_reqs_padded, num_spec, num_ctx_rows, DEVICE)
    for f in dataclasses.fields(out):
        getattr(out, f.name).fill_(-7777)
    return out


@pytest.mark.parametrize(
    "num_reqs,num_reqs_padded,num_spec,block_size",
    [(3, 5, 4, 4), (1, 1, 1, 16), (0, 2, 3, 4), (21, 32, 7, 4), (40, 24, 3, 4)],
)
def test_prepare_dflash_inputs(
    rng, num_reqs: int, num_reqs_padded: int, num_spec: int, block_size: int
) -> None:
    args, tables = dflash_case(rng, num_reqs, num_spec, block_size)
    args["proposers"] = args["proposers"][:num_reqs_padded]
    num_ctx_rows = int((args["ctx_row_start"][-1:] + args["num_ctx"][-1:]).sum()) + 300
    block_tables = padded_tables(tables, num_reqs)
    sizes = dict(num_reqs_padded=num_reqs_padded, num_ctx_rows=num_ctx_rows)
    expected = prepare_dflash_inputs_torch(**args, block_tables=block_tables, **sizes)
    got = prepare_dflash_inputs(
        **args,
        block_tables=block_tables,
        **sizes,
        out=poisoned(num_reqs_padded, num_spec, num_ctx_rows),
    )
    for f in dataclasses.fields(expected):
        assert torch.equal(getattr(got, f.name), getattr(expected, f.name)), f.name


def test_prepare_dflash_inputs_spec(rng) -> None:
    """The twin agrees with a host-side construction from lists (the engine's metadata for
    the drafter's blocks, and slots of the committed rows), pads with inert rows, and gives
    requests that do not draft no query block."""
    num_reqs, num_reqs_padded, n, block_size = 6, 8, 3, 4
    q = n + 1
    drafts = torch.tensor([True, False, True, True, False, True])
    args, tables = dflash_case(rng, num_reqs, n, block_size, drafts)
    num_ctx_rows = 40
    got = prepare_dflash_inputs_torch(
        **args,
        block_tables=padded_tables(tables, num_reqs),
        num_reqs_padded=num_reqs_padded,
        num_ctx_rows=num_ctx_rows,
    )
    props = args["proposers"].tolist()
    num_props = len(props)
    anchors = [args["anchor_tokens"].tolist()[c] for c in props]
    positions = [args["anchor_positions"].tolist()[c] for c in props]
    prop_tables = [tables[c] for c in props]
    meta = build_attention_metadata(prop_tables, positions, [q] * num_props, block_size, DEVICE)
    real = num_props * q
    assert got.input_ids[:real].tolist() == [t for a in anchors for t in [a] + [99] * n]
    assert got.positions[:real].tolist() == [p + i for p in positions for i in range(q)]
    assert torch.equal(got.slot_mapping[:real], meta.slot_mapping)
    assert torch.equal(got.query_start_loc[: num_props + 1], meta.query_start_loc)
    assert torch.equal(got.seq_lens[:num_props], meta.seq_lens)
    # Padded requests: inert dummy blocks.
    assert got.input_ids[real:].eq(99).all()
    assert got.slot_mapping[real:].eq(PAD_SLOT_ID).all()
    assert got.seq_lens[num_props:].eq(q).all()
    assert got.query_start_loc.tolist() == [r * q for r in range(num_reqs_padded + 1)]
    # Context, of every request: committed rows get the positions right before their anchor
    # and those slots.
    expected_pos = [0] * num_ctx_rows
    expected_slot = [PAD_SLOT_ID] * num_ctx_rows
    all_positions = args["anchor_positions"].tolist()
    for r in range(num_reqs):
        start, count = int(args["ctx_row_start"][r]), int(args["num_ctx"][r])
        ctx = range(all_positions[r] - count, all_positions[r])
        expected_pos[start : start + count] = list(ctx)
        expected_slot[start : start + count] = slots_for_positions(tables[r], ctx, block_size)
    assert got.context_positions.tolist() == expected_pos
    assert got.context_slot_mapping.tolist() == expected_slot
