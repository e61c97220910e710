"""A drafter's reduced vocabulary: its head scores D of the target's V tokens.

vLLM's speculators format and llama.cpp's drafter GGUFs store which ones as `d2t`, an offset
per draft row (target id = row + d2t[row]), and speculators also as `t2d`, a [V] mask of the
target tokens that have a row. The drafter's logits go back to target ids with -inf on every
other token: its greedy proposal is the argmax over the draft vocabulary, and its sampling
distribution q is zero outside it, which rejection sampling needs nothing special for (a token
q never proposes is only ever produced by the residual max(p - q, 0), exactly as p requires).
"""

from __future__ import annotations

import torch


def draft_token_ids(
    d2t: torch.Tensor,  # [D] integer offsets, target id = row + d2t[row]
    t2d: torch.Tensor | None,  # [V] bool (or 0/1), True where a target token has a draft row
    vocab_size: int,  # V, the target's
) -> torch.Tensor:  # [D] int64, the target id of each draft row
    """The target ids of the draft rows, checked: distinct, inside the target's vocabulary, and
    the same set `t2d` marks when the checkpoint has one."""
    if d2t.ndim != 1 or d2t.is_floating_point() and not torch.equal(d2t, d2t.round()):
        raise ValueError(f"d2t must be a 1-D tensor of integer offsets, got {tuple(d2t.shape)}")
    ids = torch.arange(d2t.shape[0], dtype=torch.int64) + d2t.to(torch.int64)
    outside = ids[(ids < 0) | (ids >= vocab_size)]
    if outside.numel():
        raise ValueError(
            f"d2t maps draft rows to target ids {outside[:4].tolist()} outside the target's "
            f"vocabulary of {vocab_size}"
        )
    if torch.unique(ids).numel() != ids.numel():
        raise ValueError("d2t maps two draft rows to the same target token")
    if t2d is not None:
        mask = t2d.reshape(-1) != 0
        if mask.numel() != vocab_size:
            raise ValueError(f"t2d has {mask.numel()} entries for a vocabulary of {vocab_size}")
        if int(mask.sum()) != ids.numel() or not bool(mask[ids].all()):
            raise ValueError("t2d and d2t disagree on which target tokens the drafter scores")
    return ids


def scatter_draft_logits(
    logits: torch.Tensor,  # [R, D] float32 over the draft vocabulary
    ids: torch.Tensor,  # [D] int64 target ids of the draft rows
    vocab_size: int,  # V
) -> torch.Tensor:  # [R, V] float32, -inf on target tokens without a draft row
    full = logits.new_full((logits.shape[0], vocab_size), float("-inf"))
    return full.index_copy_(1, ids, logits)
