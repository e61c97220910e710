"""`blockdraft.models.registry`: config.json `architectures` and GGUF `general.architecture`
names resolve to the model family that runs them; anything else is a clear ValueError."""

import pytest
from gguf.constants import MODEL_ARCH_NAMES

from blockdraft.models.llama import DecoderLM
from blockdraft.models.registry import ARCHITECTURES, GGUF_ARCHITECTURES, resolve_architecture

TINY = {
    "vocab_size": 32,
    "hidden_size": 16,
    "intermediate_size": 24,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 8,
}


@pytest.mark.parametrize(
    ("name", "qk_norm"), [("LlamaForCausalLM", False), ("Qwen3ForCausalLM", True)]
)
def test_resolves_llama_and_qwen3(name: str, qk_norm: bool) -> None:
    hf = {**TINY, "architectures": [name]}
    arch = resolve_architecture(hf)
    assert arch.name == name and arch.model_class is DecoderLM
    cfg = arch.parse_config(hf)
    assert cfg.qk_norm == qk_norm and (cfg.num_layers, cfg.num_kv_heads) == (2, 1)
    model = arch.model_class(cfg)
    assert hasattr(model.model.layers[0].self_attn, "q_norm") == qk_norm
    assert len(model.model.layers) == 2


def test_first_supported_entry_wins() -> None:
    hf = {**TINY, "architectures": ["SomethingElse", "Qwen3ForCausalLM", "LlamaForCausalLM"]}
    assert resolve_architecture(hf).name == "Qwen3ForCausalLM"


@pytest.mark.parametrize(
    ("gguf_name", "hf_name"), [("llama", "LlamaForCausalLM"), ("qwen3", "Qwen3ForCausalLM")]
)
def test_gguf_architectures_map_to_registered_ones(gguf_name: str, hf_name: str) -> None:
    assert GGUF_ARCHITECTURES[gguf_name] == hf_name
    assert resolve_architecture({"architectures": [hf_name]}) is ARCHITECTURES[hf_name]


def test_every_gguf_name_is_llama_cpps_and_registered() -> None:
    assert set(GGUF_ARCHITECTURES) <= set(MODEL_ARCH_NAMES.values())
    assert set(GGUF_ARCHITECTURES.values()) <= set(ARCHITECTURES)


@pytest.mark.parametrize(
    ("hf", "named"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "GPT2LMHeadModel"),
        ({"architectures": [], "model_type": "mamba"}, "mamba"),
        ({}, "None"),
    ],
)
def test_unknown_architecture_names_it_and_the_supported_ones(hf: dict, named: str) -> None:
    with pytest.raises(ValueError, match="unsupported architecture") as e:
        resolve_architecture({**TINY, **hf})
    message = str(e.value)
    assert named in message
    assert "supported: Qwen3ForCausalLM, LlamaForCausalLM" in message
