"""A drafter's reduced vocabulary: its head scores D of the target's V tokens.

vLLM's speculators format and llama.cpp's drafter GGUFs store which ones as `d2t`, an offset
per draft row (target id = row + d2t[row]), and speculators also as `t2d`, a [V] mask of the
target tokens that have a row. The drafter's logits go back to target ids with -inf on every
other token: its greedy proposal is the argmax over the draft vocabulary, and its sampling
distribution q is zero outside it, which rejection sampling needs nothing special for (a token
q never proposes is only ever produced by the residual max(p - q, 0), exactly as p requires).
"""

from __future__ import annotations

import json
import os
import pickle

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
    check_in_vocab(ids, vocab_size, "d2t maps draft rows to target ids")
    if torch.unique(ids).numel() != ids.numel():
        raise ValueError("d2t maps two draft rows to the same target token")
    if t2d is not None:
        mask = t2d.reshape(-1) != 0
        if mask.numel() != vocab_size:
            raise ValueError(f"t2d has {mask.numel()} entries for a vocabulary of {vocab_size}")
        if int(mask.sum()) != ids.numel() or not bool(mask[ids].all()):
            raise ValueError("t2d and d2t disagree on which target tokens the drafter scores")
    return ids


def check_in_vocab(ids: torch.Tensor, vocab_size: int, what: str) -> None:  # ids [D] int64
    """Refuses ids outside 0..vocab_size - 1; `what` names them in the message."""
    outside = ids[(ids < 0) | (ids >= vocab_size)]
    if outside.numel():
        raise ValueError(
            f"{what} {outside[:4].tolist()} outside the target's vocabulary of {vocab_size}"
        )


def scatter_draft_logits(
    logits: torch.Tensor,  # [R, D] float32 over the draft vocabulary
    ids: torch.Tensor,  # [D] int64 target ids of the draft rows
    vocab_size: int,  # V
) -> torch.Tensor:  # [R, V] float32, -inf on target tokens without a draft row
    full = logits.new_full((logits.shape[0], vocab_size), float("-inf"))
    return full.index_copy_(1, ids, logits)


# A token map (SGLang's speculative_token_map, after FR-Spec): the target tokens a drafter that
# scores the whole vocabulary may propose. Its head is cut to those rows, so a draft step reads
# a fraction of the vocabulary's weights: the LM head is the largest single weight a drafter
# reads (SmolLM2-135M: 113 MB of fp32, more than its 5 layers; Qwen3-8B: 1.2 GB of bf16). A
# token outside the map is never drafted, which costs acceptance only where the target would
# have produced it; the output stays the target's. The shipped drafter's map is the 16,384
# most frequent tokens of ShareGPT's answers (scripts/build_token_map.py).
TOKEN_MAP_FILE = "token_map.pt"  # the map a drafter directory ships ("auto" uses it)
TOKEN_MAP_SUFFIXES = (".pt", ".json")


def check_token_map_path(token_map: object) -> None:
    """SpeculativeConfig.token_map: None, "auto", or an existing .pt / .json file."""
    if token_map is None or token_map == "auto":
        return
    if not isinstance(token_map, str):
        raise ValueError(f"token_map must be a file path, 'auto' or None, got {token_map!r}")
    if not token_map.endswith(TOKEN_MAP_SUFFIXES):
        raise ValueError(
            f"token_map {token_map!r} must be a .pt (a tensor or list of token ids) or .json "
            "(a list of token ids) file"
        )
    if not os.path.isfile(token_map):
        raise ValueError(f"token_map file {token_map!r} does not exist")


def resolve_token_map(token_map: str | None, drafter_path: str) -> str | None:
    """The token map file a config asks for: "auto" is the drafter directory's TOKEN_MAP_FILE
    when it has one."""
    if token_map != "auto":
        return token_map
    shipped = os.path.join(drafter_path, TOKEN_MAP_FILE)
    return shipped if os.path.isdir(drafter_path) and os.path.isfile(shipped) else None


def read_token_map(path: str, vocab_size: int) -> torch.Tensor:  # [D] int64, ascending
    """The token ids of a map file, checked: a non-empty 1-D list of distinct integers inside
    the target's vocabulary. Ascending, so that the drafter's greedy ties go to the lowest id
    as over the whole vocabulary."""
    try:
        if path.endswith(".json"):
            with open(path, encoding="utf-8") as f:
                value = json.load(f)
        else:
            value = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, ValueError, RuntimeError, pickle.UnpicklingError) as e:
        raise ValueError(f"token_map {path!r} cannot be read: {e}") from None
    if isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        value = torch.tensor(value, dtype=torch.int64)
    if not isinstance(value, torch.Tensor) or value.ndim != 1 or value.is_floating_point():
        raise ValueError(f"token_map {path!r} must hold a 1-D list or tensor of integer token ids")
    if value.dtype == torch.bool or not value.numel():
        raise ValueError(f"token_map {path!r} must hold at least one integer token id")
    ids = value.to(torch.int64)
    check_in_vocab(ids, vocab_size, f"token_map {path!r} lists token ids")
    ids, counts = torch.unique(ids, return_counts=True)  # sorted
    if (counts > 1).any():
        raise ValueError(f"token_map {path!r} lists token {int(ids[counts > 1][0])} twice")
    return ids
