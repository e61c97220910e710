"""Training blocks: random anchors, the packed batch layout, and its attention mask.

One drafter forward trains many draft steps at once. For every sampled anchor position `a`
of a sequence, the block `[token_a, MASK x (B-1)]` sits at positions `a .. a+B-1`, exactly
as at inference, where `a` is the bonus token the target just produced. All blocks of all
sequences of a batch are packed into one flat list of query rows; the keys are the context
rows (every token of every sequence, from the target's features) followed by the query rows
themselves. The mask keeps each block inside its own draft step:

* context row `j` of sequence `s` is visible to a block of `s` iff `pos(j) < a` (at inference
  the context holds exactly the committed tokens before the anchor);
* block rows see their own block only: all of it, or causally on causal (sliding) layers;
* a window `W` keeps keys with `q_pos - k_pos < W` (and `k_pos - q_pos < W` when non-causal),
  as the engine's paged attention does.

`mask_mod` is written with tensor ops only, so the same function gives the dense CPU mask
(`build_block_mask`) and FlexAttention's `BlockMask` on the GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

IGNORE_INDEX = -100
PAD_CONTEXT_SEQ = -2  # sequence id of padded context rows: matches no query


def sample_anchors(
    seq_len: int,
    loss_start: int,
    num_anchors: int,
    generator: torch.Generator,
) -> torch.Tensor:  # [n] int64, sorted, distinct
    """Draws up to `num_anchors` distinct anchors `a` with `a` and `a + 1` in the response.

    The response is `[loss_start, seq_len)`. The first anchor the drafter meets at inference
    is the target's first response token, so the prompt's last token is never an anchor.
    Anchors come sorted so that a FlexAttention tile of neighbouring blocks needs a short
    prefix of the context.
    """
    first, last = loss_start, seq_len - 2  # a + 1 <= seq_len - 1
    count = last - first + 1
    if count <= 0 or num_anchors <= 0:
        return torch.empty(0, dtype=torch.int64)
    n = min(num_anchors, count)
    picked = torch.randperm(count, generator=generator)[:n] + first
    return picked.sort().values


@dataclass
class BlockLayout:
    """A packed batch. Context rows: the sequences' tokens back to back (C rows). Query rows:
    the blocks, B rows each, sequence by sequence (Q rows). Keys = context rows + query rows."""

    input_ids: torch.Tensor  # [C] int64, tokens of the sequences (the target's input)
    ctx_pos: torch.Tensor  # [C] int64, position of each context row in its sequence
    ctx_seq: torch.Tensor  # [C] int64, sequence index of each context row
    seq_lens: list[int]
    block_ids: torch.Tensor  # [Q] int64, [anchor token, MASK x (B-1)] per block
    q_pos: torch.Tensor  # [Q] int64, anchor + offset
    q_seq: torch.Tensor  # [Q] int64
    q_block: torch.Tensor  # [Q] int64, global block index
    q_anchor: torch.Tensor  # [Q] int64, anchor position of the row's block
    offsets: torch.Tensor  # [Q] int64, 0 .. B-1
    labels: torch.Tensor  # [Q] int64, token at anchor+offset, IGNORE_INDEX at offset 0 / past end
    block_size: int

    @property
    def num_context(self) -> int:
        return self.ctx_pos.shape[0]

    @property
    def num_queries(self) -> int:
        return self.q_pos.shape[0]

    @property
    def num_blocks(self) -> int:
        return self.num_queries // self.block_size

    def to(self, device: torch.device) -> BlockLayout:
        return BlockLayout(**{name: to_device(v, device) for name, v in self.__dict__.items()})


def to_device(value: object, device: torch.device) -> object:
    if not isinstance(value, torch.Tensor):
        return value
    if device.type == "cuda" and value.device.type == "cpu":
        # From pinned memory and without blocking: a copy from pageable memory makes the host
        # wait until the GPU has finished all queued work, so it could never run ahead.
        return value.pin_memory().to(device, non_blocking=True)
    return value.to(device)


def pack_blocks(
    sequences: Sequence[Sequence[int]],
    anchors: Sequence[torch.Tensor],  # per sequence: [n_i] int64 anchor positions
    block_size: int,
    mask_token_id: int,
) -> BlockLayout:
    """Lays out the blocks of `anchors` over `sequences` (see `BlockLayout`)."""
    b = block_size
    offsets = torch.arange(b)
    ids, ctx_pos, ctx_seq = [], [], []
    q_pos, q_seq, q_anchor, labels, block_ids = [], [], [], [], []
    for s, (tokens, anchor) in enumerate(zip(sequences, anchors, strict=True)):
        tokens_t = torch.as_tensor(list(tokens), dtype=torch.int64)
        n = tokens_t.shape[0]
        ids.append(tokens_t)
        ctx_pos.append(torch.arange(n))
        ctx_seq.append(torch.full((n,), s))
        pos = (anchor[:, None] + offsets[None, :]).flatten()  # [n_i * B]
        q_pos.append(pos)
        q_seq.append(torch.full_like(pos, s))
        q_anchor.append(anchor.repeat_interleave(b))
        label = torch.where(pos < n, tokens_t[pos.clamp(max=n - 1)], IGNORE_INDEX)
        label = label.view(-1, b)
        label[:, 0] = IGNORE_INDEX  # the anchor row is given, not predicted
        labels.append(label.flatten())
        block = torch.full((anchor.shape[0], b), mask_token_id, dtype=torch.int64)
        block[:, 0] = tokens_t[anchor]
        block_ids.append(block.flatten())
    q_pos_t = torch.cat(q_pos)
    num_q = q_pos_t.shape[0]
    return BlockLayout(
        input_ids=torch.cat(ids),
        ctx_pos=torch.cat(ctx_pos),
        ctx_seq=torch.cat(ctx_seq),
        seq_lens=[len(t) for t in sequences],
        block_ids=torch.cat(block_ids),
        q_pos=q_pos_t,
        q_seq=torch.cat(q_seq),
        q_block=torch.arange(num_q) // b,
        q_anchor=torch.cat(q_anchor),
        offsets=offsets.repeat(num_q // b),
        labels=torch.cat(labels),
        block_size=b,
    )


MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class MaskTensors:
    """Per-row metadata read by `mask_mod`, possibly padded to fixed lengths (for a compiled
    FlexAttention kernel that should not recompile when the batch changes)."""

    ctx_pos: torch.Tensor  # [C'] int64
    ctx_seq: torch.Tensor  # [C'] int64, PAD_CONTEXT_SEQ on padding
    q_pos: torch.Tensor  # [Q'] int64
    q_seq: torch.Tensor  # [Q'] int64, -1 on padding
    q_block: torch.Tensor  # [Q'] int64, unique negative ids on padding (rows see only themselves)
    q_anchor: torch.Tensor  # [Q'] int64

    @classmethod
    def from_layout(
        cls, layout: BlockLayout, num_context: int | None = None, num_queries: int | None = None
    ) -> MaskTensors:
        c, q = layout.num_context, layout.num_queries
        c_pad, q_pad = num_context or c, num_queries or q
        if c_pad < c or q_pad < q:
            raise ValueError(f"padding ({c_pad}, {q_pad}) is smaller than the batch ({c}, {q})")
        device = layout.q_pos.device

        def pad(x: torch.Tensor, n: int, fill: torch.Tensor | int) -> torch.Tensor:
            if x.shape[0] == n:
                return x
            tail = torch.full((n - x.shape[0],), 0, dtype=x.dtype, device=device) + fill
            return torch.cat([x, tail])

        # A padded query row must see some key (no all-masked rows) but cost nothing: it sees
        # its own key only, via a block id no other row has.
        pad_blocks = -torch.arange(1, q_pad - q + 1, device=device)
        return cls(
            ctx_pos=pad(layout.ctx_pos, c_pad, 0),
            ctx_seq=pad(layout.ctx_seq, c_pad, PAD_CONTEXT_SEQ),
            q_pos=pad(layout.q_pos, q_pad, 0),
            q_seq=pad(layout.q_seq, q_pad, -1),
            q_block=pad(layout.q_block, q_pad, pad_blocks),
            q_anchor=pad(layout.q_anchor, q_pad, 0),
        )

    @property
    def num_context(self) -> int:
        return self.ctx_pos.shape[0]

    @property
    def num_queries(self) -> int:
        return self.q_pos.shape[0]


def make_mask_mod(t: MaskTensors, causal: bool, window: int | None) -> MaskMod:
    """FlexAttention-style `mask_mod(b, h, q_idx, kv_idx) -> bool` over keys = context rows
    (kv_idx < C) then query rows. Branch-free so that it also broadcasts over index grids."""
    c, q = t.num_context, t.num_queries
    # Plain tensors in the closure (not attribute reads of `t`): torch.compile then treats
    # them as inputs of one cached graph instead of specialising on the object.
    ctx_pos, ctx_seq, q_pos, q_seq, q_block, q_anchor = (
        t.ctx_pos,
        t.ctx_seq,
        t.q_pos,
        t.q_seq,
        t.q_block,
        t.q_anchor,
    )

    def mask_mod(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        is_ctx = kv_idx < c
        ci = kv_idx.clamp(max=c - 1)
        ki = (kv_idx - c).clamp(min=0, max=q - 1)
        qp = q_pos[q_idx]
        ctx_ok = (ctx_seq[ci] == q_seq[q_idx]) & (ctx_pos[ci] < q_anchor[q_idx])
        block_ok = q_block[ki] == q_block[q_idx]
        kp = torch.where(is_ctx, ctx_pos[ci], q_pos[ki])
        if causal:
            block_ok = block_ok & (q_pos[ki] <= qp)
        ok = torch.where(is_ctx, ctx_ok, block_ok)
        if window is not None:
            ok = ok & (qp - kp < window)
            if not causal:
                ok = ok & (kp - qp < window)
        return ok

    return mask_mod


def build_block_mask(
    layout: BlockLayout, causal: bool = False, window: int | None = None
) -> torch.Tensor:  # [Q, C + Q] bool, True = may attend
    """The dense mask of a packed batch (CPU training and tests)."""
    t = MaskTensors.from_layout(layout)
    device = layout.q_pos.device
    q_idx = torch.arange(t.num_queries, device=device)[:, None]
    kv_idx = torch.arange(t.num_context + t.num_queries, device=device)[None, :]
    zero = torch.zeros((), dtype=torch.int64, device=device)
    return make_mask_mod(t, causal, window)(zero, zero, q_idx, kv_idx)


def build_flex_block_mask(
    t: MaskTensors, causal: bool, window: int | None, compile_mask: bool = False
) -> object:  # torch.nn.attention.flex_attention.BlockMask
    """FlexAttention's sparse BlockMask for the same rule. `compile_mask` evaluates mask_mod in
    a compiled kernel tile by tile instead of materialising the dense [Q, C+Q] mask first (a
    must at GPU batch sizes, where the dense mask would take tens of GB)."""
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(
        make_mask_mod(t, causal, window),
        None,
        None,
        t.num_queries,
        t.num_context + t.num_queries,
        device=t.q_pos.device,
        _compile=compile_mask,
    )
