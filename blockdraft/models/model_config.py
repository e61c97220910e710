"""Decoder-only transformer shape, parsed once from a Hugging Face `config.json` dict (by each
family's parser in its model file, which fixes what the family implies: Qwen3's q/k norms)."""

from __future__ import annotations

from dataclasses import dataclass


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

    @classmethod
    def from_hf(cls, hf: dict, architecture: str, qk_norm: bool) -> TransformerConfig:
        """The shape in `hf`; `architecture` and `qk_norm` come from the family's parser."""
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
            )
        except KeyError as e:
            raise ValueError(f"config.json is missing required field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise ValueError(f"config.json has an invalid value: {e}") from None
