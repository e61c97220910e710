"""DFlash2 drafting: the path through each block's top-K candidates, picked position by position
given the token drafted before (greedy: the best-scoring candidate; sampled: a draw from the
softmax of the scores at the request's temperature, whose probabilities are the proposal q the
rejection sampler needs).

Fixed shapes and no host reads, so it runs inside the drafter's CUDA graph. The walk is
sequential, but the random draws are not: position i's uniforms depend on (seed, i) alone, so
the candidate each predecessor would lead to is known up front for every predecessor, a
[K] -> [K] table per position. The path is then the composition of the N tables, done in
log2(N) rounds of gathers instead of N dependent steps.
"""

from __future__ import annotations

import torch

from blockdraft.kernels.select import get_exponential_race_backend
from blockdraft.models.dflash2_drafter import DFlash2Drafter
from blockdraft.spec_decode.rejection_sampler import SALT_DRAFT


def walk_candidates(
    scores: torch.Tensor,  # [R, N, K, K] float32 from CandidateSelector.transition_scores
    temperature: torch.Tensor,  # [R] float32; 0 => greedy
    seed: torch.Tensor,  # [R] int64
    position: torch.Tensor,  # [R] int64, first draft position
) -> tuple[torch.Tensor, torch.Tensor]:  # index [R, N] int64 into the candidates, q [R, N, K]
    """Each position's chosen candidate and the distribution it was drawn from (one-hot for
    greedy rows)."""
    num_reqs, n, k, _ = scores.shape
    greedy = temperature == 0
    temp = torch.where(greedy, torch.ones_like(temperature), temperature)
    probs = torch.softmax(scores / temp[:, None, None, None], dim=-1)
    # One race per (request, position, predecessor); the predecessors of a position share its
    # uniforms, so each row is a draw from that predecessor's distribution.
    rows = num_reqs * n * k
    offsets = torch.arange(n, dtype=torch.int64, device=scores.device)
    row_position = (position[:, None] + offsets).repeat_interleave(k, dim=1).reshape(rows)
    race = get_exponential_race_backend(scores.device)
    sampled = race(probs.view(rows, k), seed.repeat_interleave(n * k), row_position, SALT_DRAFT)
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


def select_drafts(
    drafter: DFlash2Drafter,
    hidden: torch.Tensor,  # [R * (N+1), hidden], the drafter's output over the blocks
    input_ids: torch.Tensor,  # [R * (N+1)] int64, the blocks (anchor first)
    positions: torch.Tensor,  # [R * (N+1)] int64
    temperature: torch.Tensor,  # [R] float32
    seed: torch.Tensor,  # [R] int64
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # tokens [R, N], candidates, q [R, N, K]
    """The drafter's head: logits of rows 1..N, the selector's scores, the path walk."""
    num_reqs = temperature.shape[0]
    q_len = hidden.shape[0] // num_reqs
    blocks = hidden.view(num_reqs, q_len, -1)[:, 1:]
    logits = drafter.compute_logits(blocks.flatten(0, 1)).view(num_reqs, q_len - 1, -1)
    anchors = input_ids.view(num_reqs, q_len)[:, 0]
    candidates, scores = drafter.candidate_selector.transition_scores(blocks, logits, anchors)
    first_draft = positions.view(num_reqs, q_len)[:, 1]
    index, q = walk_candidates(scores, temperature, seed, first_draft)
    return candidates.gather(2, index[:, :, None]).squeeze(2), candidates, q


def dense_draft_probs(
    candidates: torch.Tensor,  # [R, N, K] int64, distinct per position
    q: torch.Tensor,  # [R, N, K] float32
    vocab: int,
) -> torch.Tensor:  # [R, N, V] float32
    """The proposal over the whole vocabulary, zero outside the candidates, as the rejection
    sampler takes draft probabilities."""
    out = torch.zeros(*candidates.shape[:2], vocab, dtype=torch.float32, device=q.device)
    return out.scatter_(2, candidates, q)
