"""The vocabulary's two ends under tensor parallelism: each rank holds a contiguous slice of
the embedding rows (the LM head's, tied or not, is the same slice).

`embedding` looks up the ids its rank holds, zeroes the others and sums over the ranks (one
all-reduce); the LM head computes its rank's slice of the logits, and `gather_logits` joins the
slices on every rank, for the rows sampled only, so that sampling and rejection sampling see
the full logits on every rank and draw the same tokens there. Vocabularies the ranks do not
divide are padded at the end: the padded rows are zero and cut from the logits. Without a group
(`current_tensor_parallel()` is None) these are torch's `nn.Embedding` and `nn.Linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from blockdraft.distributed.tensor_parallel import (
    Shard,
    TensorParallel,
    current_tensor_parallel,
    tag_shard,
)


class VocabParallelEmbedding(nn.Module):
    def __init__(self, tp: TensorParallel, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.tp = tp
        self.start, self.stop, per = tp.padded_split(vocab_size)
        # Zeros: the padded rows past the vocabulary are never loaded.
        self.weight = nn.Parameter(torch.zeros(per, hidden_size))
        tag_shard(self.weight, Shard(0, self.start, self.stop, vocab_size))

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
    ) -> torch.Tensor:  # [num_tokens, hidden]
        held = (input_ids >= self.start) & (input_ids < self.stop)
        local = torch.where(held, input_ids - self.start, 0)
        x = F.embedding(local, self.weight) * held[:, None].to(self.weight.dtype)
        return self.tp.all_reduce(x)


def embedding(vocab_size: int, hidden_size: int) -> nn.Module:
    """The token embedding: this rank's rows under tensor parallelism, else all of them."""
    tp = current_tensor_parallel()
    if tp is None:
        return nn.Embedding(vocab_size, hidden_size)
    return VocabParallelEmbedding(tp, vocab_size, hidden_size)


def lm_head(hidden_size: int, vocab_size: int) -> nn.Linear:
    """The LM head (no bias): this rank's rows of the vocabulary under tensor parallelism."""
    tp = current_tensor_parallel()
    if tp is None:
        return nn.Linear(hidden_size, vocab_size, bias=False)
    start, stop, per = tp.padded_split(vocab_size)
    head = nn.Linear(hidden_size, per, bias=False)
    with torch.no_grad():
        head.weight.zero_()  # the padded rows give zero logits, cut by gather_logits
    tag_shard(head.weight, Shard(0, start, stop, vocab_size))
    return head


def gather_logits(
    tp: TensorParallel,
    logits: torch.Tensor,  # [rows, per] this rank's slice of the vocabulary
    vocab_size: int,
) -> torch.Tensor:  # [rows, vocab_size] on every rank
    full = tp.all_gather_last(logits)
    return full[:, :vocab_size] if full.shape[-1] != vocab_size else full
