"""Qwen3.5-MoE (`Qwen3_5MoeForCausalLM`, e.g. Qwen3.5-35B-A3B, and the multimodal
`Qwen3_5MoeForConditionalGeneration`, whose language model it loads): the Qwen3.5 hybrid layers
with a sparse mixture-of-experts MLP in every layer: top-k routed experts (the top-k weights
always renormalised) plus a shared expert scaled by a sigmoid gate.

Checkpoints hold the experts stacked (`mlp.experts.gate_up_proj` [E, 2I, H], gate rows then up
rows, and `mlp.experts.down_proj`, as transformers saves them) or one tensor per expert
(`mlp.experts.E.{gate,up,down}_proj.weight`); both load."""

from __future__ import annotations

import dataclasses

from blockdraft.layers.moe import expert_tensor_slice
from blockdraft.models.model_config import MoEConfig
from blockdraft.models.qwen3_5 import HybridConfig, Qwen3_5LM, hybrid_config, text_config
from blockdraft.models.qwen3_moe import sparse_or_dense_mlp


def shared_expert_size(text: dict) -> int:
    try:
        return int(text["shared_expert_intermediate_size"])
    except KeyError:
        raise ValueError(
            "config.json is missing required MoE field 'shared_expert_intermediate_size'"
        ) from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"config.json has an invalid MoE value: {e}") from None


def qwen3_5_moe_config(hf: dict) -> HybridConfig:
    """`Qwen3_5MoeForCausalLM`'s config.json, or the `text_config` of a
    `Qwen3_5MoeForConditionalGeneration` one. Every layer routes, whatever
    `decoder_sparse_step` / `mlp_only_layers` / `norm_topk_prob` say (transformers reads none
    of them for this family)."""
    text = text_config(hf)
    shared = shared_expert_size(text)
    moe = dataclasses.replace(
        MoEConfig.from_hf(text),
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=(),
        shared_expert_intermediate_size=shared,
    )
    # No layer has a dense MLP (config.json has no intermediate_size): the field takes the
    # shared expert's size.
    return hybrid_config({"intermediate_size": shared, **text}, "qwen3_5_moe", moe)


class Qwen3_5MoeLM(Qwen3_5LM):
    def __init__(self, cfg: HybridConfig) -> None:
        if cfg.moe is None:
            raise ValueError(f"{type(self).__name__} needs a config with MoE fields")
        super().__init__(cfg, sparse_or_dense_mlp)

    def checkpoint_slice(self, name: str) -> tuple[str, tuple] | None:
        return expert_tensor_slice(name, self.cfg.moe.intermediate_size)
