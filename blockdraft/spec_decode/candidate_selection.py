"""DFlash2 drafting: the path through each block's top-K candidates, picked position by position
given the token drafted before (greedy: the best-scoring candidate; sampled: a draw from the
softmax of the scores at the request's temperature, whose probabilities are the proposal q the
rejection sampler needs). The top-K, the scores and the walk are `blockdraft.kernels`' (two
pairs of Triton launches on the GPU).

Fixed shapes and no host reads, so it runs inside the drafter's CUDA graph.
"""

from __future__ import annotations

import torch

from blockdraft.kernels.select import get_candidate_walk_backend, get_top_k_backend
from blockdraft.layers.linear import linear
from blockdraft.models.dflash2_drafter import DFlash2Drafter
from blockdraft.spec_decode.rejection_sampler import SALT_DRAFT


def select_drafts(
    drafter: DFlash2Drafter,
    hidden: torch.Tensor,  # [R * (N+1), hidden], the drafter's output over the blocks
    input_ids: torch.Tensor,  # [R * (N+1)] int64, the blocks (anchor first)
    positions: torch.Tensor,  # [R * (N+1)] int64
    temperature: torch.Tensor,  # [R] float32
    seed: torch.Tensor,  # [R] int64
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # tokens [R, N], candidates, q [R, N, K]
    """The drafter's head: logits of rows 1..N, each position's top-K, the selector's walk."""
    num_reqs = temperature.shape[0]
    q_len = hidden.shape[0] // num_reqs
    blocks = hidden.view(num_reqs, q_len, -1)[:, 1:]
    # [R, N, V] in the head's dtype: the top-K returns float32 values of its picks
    logits = drafter.compute_logits(blocks.flatten(0, 1), float32=False)
    logits = logits.view(num_reqs, q_len - 1, -1)
    selector = drafter.candidate_selector
    unary, candidates = get_top_k_backend(hidden.device)(logits, selector.top_k)
    projected = linear(blocks, selector.hidden_projection.weight, None)  # [R, N, r]
    walk = get_candidate_walk_backend(hidden.device)
    tokens, q = walk(
        projected,
        unary,
        candidates,
        input_ids.view(num_reqs, q_len)[:, 0],
        selector.predecessor_codebook.weight,
        selector.successor_codebook.weight,
        temperature,
        seed,
        positions.view(num_reqs, q_len)[:, 1],
        SALT_DRAFT,
    )
    return tokens, candidates, q


def dense_draft_probs(
    candidates: torch.Tensor,  # [R, N, K] int64, distinct per position
    q: torch.Tensor,  # [R, N, K] float32
    vocab: int,
) -> torch.Tensor:  # [R, N, V] float32
    """The proposal over the whole vocabulary, zero outside the candidates, as the rejection
    sampler takes draft probabilities."""
    out = torch.zeros(*candidates.shape[:2], vocab, dtype=torch.float32, device=q.device)
    return out.scatter_(2, candidates, q)
