"""The Qwen3-MoE family (`Qwen3MoeForCausalLM`, e.g. Qwen3-30B-A3B, Qwen3-Coder-30B-A3B): Qwen3's
attention (q/k norms) and decoder layers, with a sparse mixture-of-experts MLP in every layer
i where `(i + 1) % decoder_sparse_step == 0` and i is not in `mlp_only_layers`, the dense MLP
of `intermediate_size` elsewhere. Checkpoints with one tensor per expert
(`mlp.experts.E.{gate,up,down}_proj.weight`) load into the stacked expert parameters."""

from __future__ import annotations

from torch import nn

from blockdraft.layers.moe import SparseMoE, expert_tensor_slice
from blockdraft.models.llama import DecoderLM, dense_mlp
from blockdraft.models.model_config import TransformerConfig


def qwen3_moe_config(hf: dict) -> TransformerConfig:
    """`Qwen3MoeForCausalLM`'s config.json."""
    return TransformerConfig.from_hf(hf, "qwen3_moe", qk_norm=True, moe=True)


def sparse_or_dense_mlp(cfg: TransformerConfig, layer: int) -> nn.Module:
    moe = cfg.moe
    if moe is None or not moe.is_sparse(layer):
        return dense_mlp(cfg, layer)
    return SparseMoE(
        cfg.hidden_size,
        moe.num_experts,
        moe.top_k,
        moe.intermediate_size,
        moe.norm_topk_prob,
        moe.shared_expert_intermediate_size,
    )


class Qwen3MoeForCausalLM(DecoderLM):
    def __init__(self, cfg: TransformerConfig) -> None:
        if cfg.moe is None:
            raise ValueError("Qwen3MoeForCausalLM needs a config with MoE fields")
        super().__init__(cfg, sparse_or_dense_mlp)

    def checkpoint_slice(self, name: str) -> tuple[str, tuple] | None:
        return expert_tensor_slice(name, self.cfg.moe.intermediate_size)
