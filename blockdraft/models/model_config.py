"""Decoder-only transformer shape, parsed once from a Hugging Face `config.json` dict (by each
family's parser in its model file, which fixes what the family implies: Qwen3's q/k norms), with
the mixture-of-experts shape of the families that have one."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoEConfig:
    """Which layers are sparse and the shape of their experts."""

    num_experts: int
    top_k: int  # experts per token
    intermediate_size: int  # of each routed expert
    norm_topk_prob: bool  # renormalise the top-k routing weights to sum to one
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here
    shared_expert_intermediate_size: int = 0  # 0: no shared expert

    def __post_init__(self) -> None:
        if self.num_experts < 1 or self.intermediate_size < 1:
            raise ValueError(
                f"an MoE config needs num_experts >= 1 and moe_intermediate_size >= 1, got "
                f"{self.num_experts} and {self.intermediate_size}"
            )
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok {self.top_k} must be between 1 and num_experts "
                f"({self.num_experts})"
            )
        if self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")

    def is_sparse(self, layer: int) -> bool:
        return (layer + 1) % self.decoder_sparse_step == 0 and layer not in self.mlp_only_layers

    @classmethod
    def from_hf(cls, hf: dict) -> MoEConfig:
        """The routed-expert fields of `hf` (transformers 5 writes `num_local_experts` for
        `num_experts`); a ValueError naming a missing or invalid one. A family with a shared
        expert sets `shared_expert_intermediate_size` itself (Qwen3-MoE has none, whatever its
        config.json says)."""
        experts_key = "num_experts" if "num_experts" in hf else "num_local_experts"
        try:
            return cls(
                num_experts=int(hf[experts_key]),
                top_k=int(hf["num_experts_per_tok"]),
                intermediate_size=int(hf["moe_intermediate_size"]),
                # transformers' default when the field is absent
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                decoder_sparse_step=int(hf.get("decoder_sparse_step") or 1),
                mlp_only_layers=tuple(int(i) for i in hf.get("mlp_only_layers") or ()),
            )
        except KeyError as e:
            raise ValueError(f"config.json is missing required MoE field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise ValueError(f"config.json has an invalid MoE value: {e}") from None


@dataclass(frozen=True)
class TransformerConfig:
    architecture: str  # the family's model_type: "qwen3" | "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    moe: MoEConfig | None = None  # None: every layer has the dense MLP

    @classmethod
    def from_hf(
        cls, hf: dict, architecture: str, qk_norm: bool, moe: bool = False
    ) -> TransformerConfig:
        """The shape in `hf`; `architecture`, `qk_norm` and whether it has MoE layers come from
        the family's parser."""
        moe_config = MoEConfig.from_hf(hf) if moe else None
        try:
            hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
            rope_params = hf.get("rope_parameters") or {}
            scaling = hf.get("rope_scaling") or (
                rope_params if rope_params.get("rope_type", "default") != "default" else None
            )
            return cls(
                architecture=architecture,
                vocab_size=int(hf["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(hf["intermediate_size"]),
                num_layers=int(hf["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(hf.get("num_key_value_heads") or heads),
                head_dim=int(hf.get("head_dim") or hidden // heads),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                rope_theta=float(hf.get("rope_theta", rope_params.get("rope_theta", 10000.0))),
                rope_scaling=scaling,
                max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                attention_bias=bool(hf.get("attention_bias", False)),
                qk_norm=qk_norm,
                moe=moe_config,
            )
        except KeyError as e:
            raise ValueError(f"config.json is missing required field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise ValueError(f"config.json has an invalid value: {e}") from None
