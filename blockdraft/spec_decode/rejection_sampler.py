"""Speculative-decoding verification (lossless rejection sampling) and draft sampling.

Every random draw is a hashed uniform keyed by (seed, position, salt), with a separate
salt per role: the draft token, its accept/reject coin and the resampled token at a
given position are independent of each other, which is what losslessness needs.
Positions past the first rejection get their draws reused by the next step; that is
harmless because nothing that reached the output depended on them.
"""

from __future__ import annotations

import dataclasses

import torch

from blockdraft.kernels.select import get_hashed_uniform_backend
from blockdraft.layers.sampler import SamplingTensors, sample_from_probs, sampling_probs

# 0 is the plain decode path's default salt (blockdraft.layers.sampler.sample).
SALT_DRAFT = 0x0D5AF7
SALT_ACCEPT = 0x0ACCE9
SALT_RESAMPLE = 0x05E5A3


def sample_drafts(
    draft_logits: torch.Tensor,  # [R, N, V] drafter logits for N consecutive positions
    st: SamplingTensors,  # one row per request; position = first draft position
) -> tuple[torch.Tensor, torch.Tensor | None]:  # tokens [R, N] int64, probs [R, N, V] f32
    """Draw draft tokens with each request's own filters applied to the drafter.

    probs is None only when st says (host-side) that every row is greedy; then the
    drafts are argmaxes and the verifier treats q as one-hot.
    """
    num_rows, n, vocab = draft_logits.shape
    flat = draft_logits.reshape(num_rows * n, vocab)
    if st.all_greedy:
        return flat.argmax(dim=-1).view(num_rows, n), None
    st_rows = st.repeat_interleave(n)
    probs = sampling_probs(flat, st_rows)
    # Greedy rows come back one-hot from sampling_probs, so the race returns their argmax.
    tokens = sample_from_probs(probs, st_rows, SALT_DRAFT)
    return tokens.view(num_rows, n), probs.view(num_rows, n, vocab)


def rejection_sample(
    target_logits: torch.Tensor,  # [R, N+1, V] target logits at the anchor and each draft
    draft_tokens: torch.Tensor,  # [R, N] int64
    draft_probs: torch.Tensor | None,  # [R, N, V] float32; None => drafts are one-hot
    st: SamplingTensors,  # one row per request; position = first draft position
) -> tuple[torch.Tensor, torch.Tensor]:  # output tokens [R, N+1] int64, num_accepted [R]
    """Verify N drafts per request; output accepted drafts then one corrected/bonus token.

    Rows of output_tokens past num_accepted + 1 are -1. Greedy requests need no special
    case: their target distribution is one-hot at argmax, so acceptance is "draft equals
    argmax" and the corrected token is that argmax.
    """
    num_rows, n_plus_1, vocab = target_logits.shape
    n = n_plus_1 - 1
    device = target_logits.device
    cols = torch.arange(n_plus_1, device=device)[None, :]
    if st.all_greedy:
        # Greedy needs only the argmax: skip the [R, N+1, V] probabilities and the hashing.
        target_argmax = target_logits.argmax(dim=-1)  # [R, N+1]
        matches = draft_tokens.to(torch.int64) == target_argmax[:, :n]
        num_accepted = matches.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [R]
        # Accepted drafts equal the argmax, and the extra token is the argmax at the first
        # mismatch (or the bonus row): the output is the argmax up to there (fewer launches).
        return torch.where(cols <= num_accepted[:, None], target_argmax, -1), num_accepted
    st_rows = st.repeat_interleave(n_plus_1)
    p = sampling_probs(target_logits.reshape(num_rows * n_plus_1, vocab), st_rows)
    p = p.view(num_rows, n_plus_1, vocab)

    draft_tokens = draft_tokens.to(torch.int64)
    p_draft = p[:, :n].gather(2, draft_tokens[..., None]).squeeze(-1)  # [R, N]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.gather(2, draft_tokens[..., None]).squeeze(-1).float()
    st_drafts = st.repeat_interleave(n)
    hashed_uniform = get_hashed_uniform_backend(device)
    u = hashed_uniform(st_drafts.seed, st_drafts.position, SALT_ACCEPT).view(num_rows, n)
    # u < p/q written multiplicatively so q == 0 cannot divide by zero; u < 1 makes the
    # min(1, .) clip implicit.
    accepted = u * q_draft < p_draft
    num_accepted = accepted.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [R]

    # Row at which we sample the extra token: first rejection, or the bonus row N.
    rows = torch.arange(num_rows, device=device)
    p_at = p[rows, num_accepted]  # [R, V]
    rejected = num_accepted < n
    at_draft = num_accepted.clamp(max=max(n - 1, 0))
    if n == 0:
        residual = p_at
    else:
        if draft_probs is None:
            q_at = torch.zeros_like(p_at).scatter_(1, draft_tokens[rows, at_draft][:, None], 1.0)
        else:
            q_at = draft_probs[rows, at_draft].float()
        # Bonus rows have no draft to subtract.
        q_at = torch.where(rejected[:, None], q_at, 0.0)
        residual = (p_at - q_at).clamp(min=0.0)
        # The race is scale invariant, so no renormalisation. An all-zero residual means
        # q == p up to rounding, where a rejection is itself a rounding artefact; fall
        # back to p rather than race over zeros.
        residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p_at)
    st_extra = dataclasses.replace(st, position=st.position + num_accepted)
    extra = sample_from_probs(residual, st_extra, SALT_RESAMPLE)  # [R]

    padded_drafts = torch.cat([draft_tokens, draft_tokens.new_full((num_rows, 1), -1)], dim=1)
    out = torch.where(cols < num_accepted[:, None], padded_drafts, -1)
    out = torch.where(cols == num_accepted[:, None], extra[:, None], out)
    return out, num_accepted
