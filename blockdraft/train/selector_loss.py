"""The DFlash2 candidate selector's training loss.

The DFlash2 release (z-lab's `dflash==0.1.0` and the published drafters) ships inference code
only; vLLM's speculators says as much ("The public DFlash2 implementation specifies inference
but does not publish its training objective",
https://docs.vllm.ai/projects/speculators/en/latest/user_guide/algorithms/dflash2/). This is
the objective NVIDIA NeMo AutoModel trains DFlash2 drafters with (its `dflash2_core`,
https://docs.nvidia.com/nemo/automodel/nemo-automodel/nemo_automodel/components/speculative/dflash/dflash2_core):

    loss = block_loss + selector_loss_weight * selector_loss

* `block_loss` is DFlash's decay-weighted block cross-entropy over the whole vocabulary
  (`drafter.block_loss`); the convolutions are part of the drafter's forward and are trained
  by it, with no loss of their own.
* `selector_loss` is a cross-entropy over each drafted position's top `selector_top_k`
  candidates, scored by the selector as at inference (`CandidateSelector.pair_scores`, the
  code the engine's path walk scores with) after the *true* predecessor (the anchor for the
  first position): the token the walk would have drafted there had every earlier position been
  right, the only case whose choice the verifier can accept. Its label is the true token's
  index among the candidates; positions whose true token is not among them have nothing to
  select and are left out. The same block-offset decay weights as the block loss weigh it, and
  it is their weighted mean over the positions left in (zero, with zero gradients, when none
  is). SpecForge (sgl-project/SpecForge#772) instead inserts the missing true token among the
  candidates; the engine never drafts a token outside them, so this loss does not.

Two details the NeMo page leaves open are chosen here: the weighted mean above, and the
candidates and their logits (the unary scores) come from the drafter's logits without
gradient: the block loss trains the logits, and the selector learns to re-rank them. That
spares a second backward through the LM head over the vocabulary; the selector's gradient
reaches its codebooks, its hidden projection and, through it, the drafter's layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from blockdraft.models.dflash2_drafter import DFlash2Drafter


def true_predecessors(
    block_ids: torch.Tensor,  # [Q] int64, blocks [anchor, MASK x (B-1)]
    labels: torch.Tensor,  # [Q] int64, the true token of each row (IGNORE_INDEX where none)
    offsets: torch.Tensor,  # [Q] int64, each row's offset in its block
    rows: torch.Tensor,  # [R] int64, rows with a label (offset >= 1)
) -> torch.Tensor:  # [R] int64
    """The true token before each labelled row: the anchor for offset 1, else the label of the
    row before (labelled too: a block's labels stop only at its sequence's end)."""
    before = rows - 1
    return torch.where(offsets[rows] == 1, block_ids[before], labels[before])


def selector_loss(
    drafter: DFlash2Drafter,
    hidden: torch.Tensor,  # [R, hidden], the drafter's rows with a label
    predecessors: torch.Tensor,  # [R] int64, the true token before each row
    labels: torch.Tensor,  # [R] int64
    weights: torch.Tensor,  # [R] float32
    chunk_rows: int = 8192,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the selector loss: the weighted mean cross-entropy over the rows whose label is a
    candidate, zero when none is; [R] bool label among the candidates; [R] bool the selector's
    pick is the label). Chunks of `chunk_rows` rows: their logits ([r, V] floats) are never all
    kept, and each chunk's [r, K, rank] codebook rows are recomputed in backward."""
    selector = drafter.candidate_selector
    unary, candidates = [], []
    with torch.no_grad():
        for s in range(0, hidden.shape[0], chunk_rows):
            u, c = selector.top_candidates(drafter.compute_logits(hidden[s : s + chunk_rows]))
            unary.append(u)
            candidates.append(c)

    def chunk(
        h: torch.Tensor,  # [r, hidden]
        prev: torch.Tensor,  # [r]
        y: torch.Tensor,  # [r]
        w: torch.Tensor,  # [r]
        u: torch.Tensor,  # [r, K]
        c: torch.Tensor,  # [r, K]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        scores = selector.pair_scores(h, u, c, prev[:, None])[:, 0]  # [r, K] float32
        match = c == y[:, None]
        hit = match.any(-1)
        target = match.int().argmax(-1)  # 0 where missing: masked below
        ce = F.cross_entropy(scores, target, reduction="none")
        # where, not a product: a masked row contributes nothing, not even 0 * inf.
        loss = torch.where(hit, ce * w, torch.zeros_like(ce)).sum()
        return loss, hit, hit & (scores.argmax(-1) == target)

    total = hidden.new_zeros((), dtype=torch.float32)
    hits, correct = [], []
    for i, s in enumerate(range(0, hidden.shape[0], chunk_rows)):
        part = slice(s, s + chunk_rows)
        args = (hidden[part], predecessors[part], labels[part], weights[part])
        args += (unary[i], candidates[i])
        if hidden.shape[0] <= chunk_rows:
            loss, hit, ok = chunk(*args)
        else:
            loss, hit, ok = torch.utils.checkpoint.checkpoint(chunk, *args, use_reentrant=False)
        total = total + loss
        hits.append(hit)
        correct.append(ok)
    hit = torch.cat(hits)
    # No label among the candidates: 0 / tiny, zero with zero gradients, not 0 / 0.
    return total / (weights * hit).sum().clamp(min=1e-6), hit, torch.cat(correct)
