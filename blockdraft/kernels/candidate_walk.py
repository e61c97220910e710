"""DFlash2's candidate selection after the drafter's LM head: the specification (pure torch).

Position i of a block has K candidate tokens (its top-K logits, `unary`). A candidate's score
given the token drafted before it is `unary[k] + <pred[prev] * proj(h_i), succ[cand_k]>`, with
two token codebooks of rank r (`pair_scores`). The path walk picks one candidate per position
given the previous pick (the anchor before position 0): greedy rows take the best score, sampled
rows draw from the softmax of the scores at their temperature, whose probabilities are the
proposal q the rejection sampler needs.

The walk is sequential, but the random draws are not: position i's uniforms depend on (seed, i)
alone, so the candidate each predecessor would lead to is known up front for every predecessor,
a [K] -> [K] table per position. The path is the composition of the N tables, done here in
log2(N) rounds of gathers. `blockdraft.kernels.triton_candidate_walk` does the scores, the
tables and the walk in two launches instead of about thirty.
"""

from __future__ import annotations

import torch

from blockdraft.kernels.sampling import exponential_race_torch


def pair_scores(
    projected: torch.Tensor,  # [..., r], the projection of the drafter's row of each position
    unary: torch.Tensor,  # [..., K] float32, the candidates' logits
    successor_rows: torch.Tensor,  # [..., K, r], the candidates' successor codebook rows
    predecessor_rows: torch.Tensor,  # [..., P, r], the predecessors' codebook rows
) -> torch.Tensor:  # [..., P, K] float32
    """scores[..., p, k]: candidate k after predecessor p (inference and training)."""
    successor = successor_rows.float() * projected.float()[..., None, :]
    return unary[..., None, :] + predecessor_rows.float() @ successor.transpose(-1, -2)


def transition_scores(
    projected: torch.Tensor,  # [R, N, r], the selector's projection of the drafter's rows
    unary: torch.Tensor,  # [R, N, K] float32, each position's top-K logits
    candidates: torch.Tensor,  # [R, N, K] int64, their tokens
    anchors: torch.Tensor,  # [R] int64, each block's anchor token
    predecessor_codebook: torch.Tensor,  # [V, r]
    successor_codebook: torch.Tensor,  # [V, r]
) -> torch.Tensor:  # [R, N, K, K] float32
    """scores[r, i, j, k]: candidate k of position i after candidate j of position i - 1.
    Position 0 follows the anchor: its K rows are equal."""
    num_reqs, _, top_k = candidates.shape
    predecessors = torch.cat(
        [anchors[:, None, None].expand(num_reqs, 1, top_k), candidates[:, :-1]], dim=1
    )  # [R, N, K]: row j of position i is candidate j of position i - 1
    return pair_scores(
        projected, unary, successor_codebook[candidates], predecessor_codebook[predecessors]
    )


def walk_candidates(
    scores: torch.Tensor,  # [R, N, K, K] float32: [r, i, j, k] candidate k after candidate j
    temperature: torch.Tensor,  # [R] float32; 0 => greedy
    seed: torch.Tensor,  # [R] int64
    position: torch.Tensor,  # [R] int64, first draft position
    salt: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # index [R, N] int64 into the candidates, q [R, N, K]
    """Each position's chosen candidate and the distribution it was drawn from (one-hot for
    greedy rows). Position 0 follows the anchor: its K rows are equal and row 0 is used."""
    num_reqs, n, k, _ = scores.shape
    greedy = temperature == 0
    temp = torch.where(greedy, torch.ones_like(temperature), temperature)
    probs = torch.softmax(scores / temp[:, None, None, None], dim=-1)
    # One race per (request, position, predecessor); the predecessors of a position share its
    # uniforms, so each row is a draw from that predecessor's distribution.
    rows = num_reqs * n * k
    offsets = torch.arange(n, dtype=torch.int64, device=scores.device)
    row_position = (position[:, None] + offsets).repeat_interleave(k, dim=1).reshape(rows)
    sampled = exponential_race_torch(
        probs.view(rows, k), seed.repeat_interleave(n * k), row_position, salt
    )
    choice = torch.where(greedy[:, None, None], scores.argmax(-1), sampled.view(num_reqs, n, k))
    # choice[r, i, j]: the candidate of position i after candidate j of position i - 1. After
    # the rounds, table i maps candidate j of position -1 to position i's pick; position 0
    # follows the anchor whatever j is.
    table, span = choice, 1
    while span < n:
        table = torch.cat([table[:, :span], table[:, span:].gather(2, table[:, :-span])], dim=1)
        span *= 2
    index = table[:, :, 0]  # [R, N]
    previous = torch.cat([torch.zeros_like(index[:, :1]), index[:, :-1]], dim=1)
    q = probs.gather(2, previous[:, :, None, None].expand(num_reqs, n, 1, k)).squeeze(2)
    one_hot = torch.zeros_like(q).scatter_(2, index[:, :, None], 1.0)
    return index, torch.where(greedy[:, None, None], one_hot, q)


def candidate_walk_torch(
    projected: torch.Tensor,  # [R, N, r], the selector's projection of the drafter's rows
    unary: torch.Tensor,  # [R, N, K] float32, each position's top-K logits
    candidates: torch.Tensor,  # [R, N, K] int64, their tokens
    anchors: torch.Tensor,  # [R] int64, each block's anchor token
    predecessor_codebook: torch.Tensor,  # [V, r]
    successor_codebook: torch.Tensor,  # [V, r]
    temperature: torch.Tensor,  # [R] float32; 0 => greedy
    seed: torch.Tensor,  # [R] int64
    position: torch.Tensor,  # [R] int64, first draft position
    salt: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # tokens [R, N] int64, q [R, N, K] float32
    """The drafted tokens and the proposal distribution over each position's candidates."""
    scores = transition_scores(
        projected, unary, candidates, anchors, predecessor_codebook, successor_codebook
    )
    index, q = walk_candidates(scores, temperature, seed, position, salt)
    return candidates.gather(2, index[:, :, None]).squeeze(2), q
