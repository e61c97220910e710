"""Pure-torch chunked linear + weighted cross-entropy: the drafter's training loss.

The specification of the fused Triton path in `triton_cross_entropy` and what
`blockdraft.train.drafter.block_loss` runs off it (on the CPU, or when the drafter's logits are
not a plain linear). It lives apart from the kernel because importing triton early would fix
TRITON_INTERPRET before `select` reads it (and triton may not be installed at all).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

# logits_fn(hidden [r, H]) -> logits [r, V] float32
LogitsFn = Callable[[torch.Tensor], torch.Tensor]


def chunked_cross_entropy(
    logits_fn: LogitsFn,
    hidden: torch.Tensor,  # [R, H], rows with a label
    labels: torch.Tensor,  # [R] int64
    weights: torch.Tensor,  # [R] float32
    chunk_rows: int = 8192,
) -> tuple[torch.Tensor, torch.Tensor]:  # (sum of weighted CE, [R] bool correct)
    """Weighted cross-entropy of `logits_fn(hidden)`, `chunk_rows` rows at a time. Each chunk's
    logits are recomputed in backward instead of kept: at GPU batch sizes they would be
    rows x vocab floats (tens of GB)."""

    def chunk(h: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logits = logits_fn(h)  # [r, V] float32
        ce = F.cross_entropy(logits, y, reduction="none")
        return (ce * w).sum(), logits.argmax(-1) == y

    if hidden.shape[0] <= chunk_rows:
        return chunk(hidden, labels, weights)
    total = hidden.new_zeros((), dtype=torch.float32)
    correct = []
    for s in range(0, hidden.shape[0], chunk_rows):
        part = slice(s, s + chunk_rows)
        loss, ok = torch.utils.checkpoint.checkpoint(
            chunk, hidden[part], labels[part], weights[part], use_reentrant=False
        )
        total = total + loss
        correct.append(ok)
    return total, torch.cat(correct)


def linear_cross_entropy_torch(
    hidden: torch.Tensor,  # [R, H]
    weight: torch.Tensor,  # [V, H] the LM head (no bias)
    labels: torch.Tensor,  # [R] int64
    weights: torch.Tensor,  # [R] float32
    chunk_rows: int = 8192,
) -> tuple[torch.Tensor, torch.Tensor]:  # (sum of weighted CE fp32, [R] bool correct)
    """`sum(weights * CE(hidden @ weight.T, labels))` and `argmax == labels`: the logits in the
    compute dtype (bf16 under autocast) copied to float32, as `DFlashDrafter.compute_logits`
    does for a plain linear head."""
    return chunked_cross_entropy(
        lambda h: F.linear(h, weight).float(), hidden, labels, weights, chunk_rows
    )
