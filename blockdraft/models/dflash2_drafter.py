"""The DFlash2 drafter: the DFlash drafter with a grouped dynamic causal convolution around each
layer's attention and MLP, and a candidate selector that drafts a path through the top-K tokens
of each block position instead of taking each position's argmax on its own.

Convolutions run over the query block only (the anchor and its masks, rows of one request's
block), never over the context: the context rows enter as keys and values exactly as in DFlash.

The selector re-scores position i's top-K candidates given the token drafted at i - 1 (the
anchor for i = 0): `score[k] = logit[k] + <pred[prev] * proj(h_i), succ[cand_k]>` with two
token codebooks of rank r and a projection of the drafter's hidden state. `transition_scores`
gives the scores for every candidate predecessor at once; the path walk that picks one
candidate per position (greedy, or sampled with its own proposal probabilities) is
`blockdraft.kernels.candidate_walk`'s, called from `blockdraft.spec_decode.candidate_selection`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
from torch import nn

from blockdraft.kernels.candidate_walk import pair_scores, transition_scores
from blockdraft.kernels.forward_context import get_attention_metadata
from blockdraft.layers.dynamic_conv import GroupedDynamicCausalConv
from blockdraft.layers.linear import linear
from blockdraft.layers.norm import input_norm
from blockdraft.layers.rotary import RotaryEmbedding
from blockdraft.models.dflash_drafter import DFlashConfig, DFlashDrafter
from blockdraft.models.llama import DecoderLayer, DecoderLM
from blockdraft.models.model_config import TransformerConfig


@dataclass(frozen=True)
class DFlash2Config(DFlashConfig):
    architecture: ClassVar[str] = "DFlash2DraftModel"

    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0

    @classmethod
    def _extra_fields(cls, value, body: TransformerConfig) -> dict:
        fields = {}
        for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            if value(name) is None:
                raise ValueError(f"DFlash2 drafter config has no {name}")
            fields[name] = int(value(name))
            if fields[name] < 1:
                raise ValueError(f"DFlash2 drafter config sets {name}={fields[name]}; need >= 1")
        if body.hidden_size % fields["conv_group_size"]:
            raise ValueError(
                f"conv_group_size {fields['conv_group_size']} does not divide hidden_size "
                f"{body.hidden_size}"
            )
        if fields["selector_top_k"] > body.vocab_size:
            raise ValueError(
                f"selector_top_k {fields['selector_top_k']} exceeds vocab_size {body.vocab_size}"
            )
        return fields


class DFlash2DecoderLayer(DecoderLayer):
    def __init__(
        self,
        cfg: TransformerConfig,
        rotary: RotaryEmbedding,
        causal: bool,
        window: int | None,
        kernel_size: int,
        group_size: int,
    ) -> None:
        super().__init__(cfg, rotary, causal, window)
        self.attention_conv = GroupedDynamicCausalConv(cfg.hidden_size, kernel_size, group_size)
        self.mlp_conv = GroupedDynamicCausalConv(cfg.hidden_size, kernel_size, group_size)

    def forward(
        self,
        x: torch.Tensor,  # [rows, hidden], blocks of block_len rows; the stream (first layer)
        positions: torch.Tensor,  # [rows] int64
        residual: torch.Tensor | None,  # [rows, hidden]; None: x is the stream
        block_len: int,
        before: PendingConv | None = None,  # the previous layer's MLP output, unconvolved
    ) -> tuple[PendingConv, torch.Tensor]:  # (MLP output before its convolution, stream)
        """A layer whose closing convolutions run with the norm after them: the attention's
        with the post-attention norm here, the MLP's with the next layer's input norm (or the
        final norm), passed on as a `PendingConv`."""
        if before is not None:
            h, residual = before.finish_norm(self.input_layernorm, residual, block_len)
        else:
            h, residual = input_norm(self.input_layernorm, x, residual)
        h, kernel = self.attention_conv.prepare(h, block_len)
        h, residual = self.attention_conv.finish_norm(
            self.self_attn(h, positions), kernel, block_len, self.post_attention_layernorm, residual
        )
        h, kernel = self.mlp_conv.prepare(h, block_len)
        return PendingConv(self.mlp_conv, self.mlp(h), kernel), residual


class PendingConv(NamedTuple):
    """A sub-block's output whose closing convolution runs with the norm that follows it."""

    conv: GroupedDynamicCausalConv
    x: torch.Tensor  # [rows, hidden]
    dynamic: torch.Tensor  # [rows, kernel_size, groups]

    def finish_norm(
        self, norm: nn.Module, residual: torch.Tensor, block_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:  # norm(conv(x) + residual), the new stream
        return self.conv.finish_norm(self.x, self.dynamic, block_len, norm, residual)


class CandidateSelector(nn.Module):
    def __init__(self, cfg: DFlash2Config) -> None:
        super().__init__()
        vocab, rank = cfg.body.vocab_size, cfg.selector_rank
        self.top_k = cfg.selector_top_k
        self.predecessor_codebook = nn.Embedding(vocab, rank)
        self.successor_codebook = nn.Embedding(vocab, rank)
        self.hidden_projection = nn.Linear(cfg.body.hidden_size, rank, bias=False)

    def top_candidates(
        self,
        logits: torch.Tensor,  # [..., V] float32, the drafter's logits
    ) -> tuple[torch.Tensor, torch.Tensor]:  # unary [..., K] float32, candidates [..., K] int64
        """Each position's top-K tokens and their logits (in no particular order)."""
        return torch.topk(logits, self.top_k, dim=-1, sorted=False)

    def pair_scores(
        self,
        hidden: torch.Tensor,  # [..., hidden], the drafter's row of each position
        unary: torch.Tensor,  # [..., K] float32, the candidates' logits
        candidates: torch.Tensor,  # [..., K] int64
        predecessors: torch.Tensor,  # [..., P] int64, tokens the position may follow
    ) -> torch.Tensor:  # [..., P, K] float32
        """scores[..., p, k]: candidate k after predecessor p, `unary[k] + <pred[p] * proj(h),
        succ[candidate k]>`. Inference and training both score through here."""
        projected = linear(hidden, self.hidden_projection.weight, None)  # [..., r]
        return pair_scores(
            projected,
            unary,
            self.successor_codebook(candidates),
            self.predecessor_codebook(predecessors),
        )

    def transition_scores(
        self,
        hidden: torch.Tensor,  # [R, N, hidden], the drafter's rows 1..N of each block
        logits: torch.Tensor,  # [R, N, V] float32, the drafter's logits there
        anchors: torch.Tensor,  # [R] int64, each block's anchor token
    ) -> tuple[torch.Tensor, torch.Tensor]:  # candidates [R, N, K] int64, scores [R, N, K, K]
        """scores[r, i, j, k]: candidate k of position i after candidate j of position i - 1
        (float32), as the drafting path scores them (`kernels.candidate_walk`). Position 0
        follows the anchor: its K rows are equal."""
        unary, candidates = self.top_candidates(logits)
        projected = linear(hidden, self.hidden_projection.weight, None)
        scores = transition_scores(
            projected,
            unary,
            candidates,
            anchors,
            self.predecessor_codebook.weight,
            self.successor_codebook.weight,
        )
        return candidates, scores


class DFlash2Drafter(DFlashDrafter):
    config_class: ClassVar[type[DFlashConfig]] = DFlash2Config
    cfg: DFlash2Config

    def __init__(self, cfg: DFlash2Config, target: DecoderLM, max_positions: int) -> None:
        super().__init__(cfg, target, max_positions)
        self.candidate_selector = CandidateSelector(cfg)

    def make_layer(
        self, body: TransformerConfig, rotary: RotaryEmbedding, causal: bool, window: int | None
    ) -> nn.Module:
        cfg = self.cfg
        return DFlash2DecoderLayer(
            body, rotary, causal, window, cfg.conv_kernel_size, cfg.conv_group_size
        )

    @staticmethod
    def checkpoint_name(name: str) -> str:
        # Published checkpoints store the codebooks as bare tensors, without `.weight`.
        name = DFlashDrafter.checkpoint_name(name)
        if name.endswith("_codebook"):
            return name + ".weight"
        return name

    @staticmethod
    def saved_name(name: str) -> str:
        # As published (z-lab's loader maps the bare names back to `.weight`).
        return name.removesuffix(".weight") if name.endswith("_codebook.weight") else name

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64, blocks [anchor, MASK x N]
        positions: torch.Tensor,  # [num_tokens] int64
    ) -> torch.Tensor:  # [num_tokens, hidden]
        meta = get_attention_metadata()
        if not meta.uniform_query_len:
            raise ValueError("DFlash2 drafter blocks must all have the same length")
        block_len = meta.max_query_len  # the convolutions run within each block
        x = self.embed_tokens(input_ids)
        if self.cfg.input_embedding_scale != 1.0:
            x = x * self.cfg.input_embedding_scale
        residual, pending = None, None
        for layer in self.layers:
            pending, residual = layer(x, positions, residual, block_len, pending)
        return pending.finish_norm(self.norm, residual, block_len)[0]
