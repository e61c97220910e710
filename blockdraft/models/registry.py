"""Which model family runs a checkpoint: one table from the Hugging Face `architectures` name
(config.json) to the family's model class and config parser, and one from llama.cpp's
`general.architecture` (GGUF) to the Hugging Face name. A family is a file in `models/` composing
`layers/` blocks, plus its lines here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from blockdraft.models.dflash2_drafter import DFlash2Drafter
from blockdraft.models.dflash_drafter import DFlashConfig, DFlashDrafter
from blockdraft.models.llama import DecoderLM, llama_config, qwen3_config
from blockdraft.models.model_config import TransformerConfig
from blockdraft.models.qwen3_5 import Qwen3_5LM, qwen3_5_config
from blockdraft.models.qwen3_5_moe import Qwen3_5MoeLM, qwen3_5_moe_config
from blockdraft.models.qwen3_moe import Qwen3MoeForCausalLM, qwen3_moe_config
from blockdraft.models.qwen3_next import Qwen3NextLM, qwen3_next_config


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
        ModelArchitecture("Qwen3MoeForCausalLM", Qwen3MoeForCausalLM, qwen3_moe_config),
        ModelArchitecture("Qwen3_5ForCausalLM", Qwen3_5LM, qwen3_5_config),
        ModelArchitecture("Qwen3_5ForConditionalGeneration", Qwen3_5LM, qwen3_5_config),
        ModelArchitecture("Qwen3_5MoeForCausalLM", Qwen3_5MoeLM, qwen3_5_moe_config),
        ModelArchitecture("Qwen3_5MoeForConditionalGeneration", Qwen3_5MoeLM, qwen3_5_moe_config),
        ModelArchitecture("Qwen3NextForCausalLM", Qwen3NextLM, qwen3_next_config),
    )
}

# llama.cpp's general.architecture -> the Hugging Face architecture its GGUF converts to.
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}


# Drafters: config.json's `architectures` entry -> the drafter class (its config_class parses).
DRAFTER_ARCHITECTURES: dict[str, type[DFlashDrafter]] = {
    drafter.config_class.architecture: drafter for drafter in (DFlashDrafter, DFlash2Drafter)
}


def resolve_drafter(hf_config: dict) -> tuple[DFlashConfig, type[DFlashDrafter]]:
    """A drafter's parsed config and its class from its config.json; a ValueError naming its
    `architectures` and the supported ones otherwise."""
    archs = hf_config.get("architectures") or []
    for name in archs:
        if name in DRAFTER_ARCHITECTURES:
            drafter_class = DRAFTER_ARCHITECTURES[name]
            return drafter_class.config_class.from_hf(hf_config), drafter_class
    raise ValueError(
        f"drafter config.json architectures is {archs!r}; supported: "
        f"{', '.join(DRAFTER_ARCHITECTURES)}"
    )


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
