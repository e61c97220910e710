"""Which model family runs a checkpoint: one table from the Hugging Face `architectures` name
(config.json) to the family's model class and config parser, and one from llama.cpp's
`general.architecture` (GGUF) to the Hugging Face name. A family is a file in `models/` composing
`layers/` blocks, plus its lines here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from blockdraft.models.llama import DecoderLM, llama_config, qwen3_config
from blockdraft.models.model_config import TransformerConfig
from blockdraft.models.qwen3_5 import Qwen3_5LM, qwen3_5_config


@dataclass(frozen=True)
class ModelArchitecture:
    name: str  # the Hugging Face `architectures` entry
    model_class: Callable[[TransformerConfig], nn.Module]  # built from the parsed config
    parse_config: Callable[[dict], TransformerConfig]  # config.json dict -> the family's config


ARCHITECTURES: dict[str, ModelArchitecture] = {
    arch.name: arch
    for arch in (
        ModelArchitecture("Qwen3ForCausalLM", DecoderLM, qwen3_config),
        ModelArchitecture("LlamaForCausalLM", DecoderLM, llama_config),
        ModelArchitecture("Qwen3_5ForCausalLM", Qwen3_5LM, qwen3_5_config),
        ModelArchitecture("Qwen3_5ForConditionalGeneration", Qwen3_5LM, qwen3_5_config),
    )
}

# llama.cpp's general.architecture -> the Hugging Face architecture its GGUF converts to.
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def resolve_architecture(hf_config: dict) -> ModelArchitecture:
    """The first supported entry of config.json's `architectures`; a ValueError naming them
    (or the model_type) and the supported ones otherwise."""
    archs = hf_config.get("architectures") or []
    for name in archs:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    raise ValueError(
        f"unsupported architecture {archs or hf_config.get('model_type')!r}; "
        f"supported: {', '.join(ARCHITECTURES)}"
    )
