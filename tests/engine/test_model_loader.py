"""Model building in engine/model_loader.py: a target whose weights do not fit the device's free
memory is refused before anything is allocated, with both sizes named; weights are made in the
engine's dtype (no float32 copy of a bf16 model first)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks.shapes import QWEN3_CODER_30B_A3B
from blockdraft.config import EngineConfig
from blockdraft.engine.model_loader import check_weights_fit, load_models, weight_bytes
from blockdraft.models.qwen3_moe import Qwen3MoeForCausalLM, qwen3_moe_config


def published_params(hf: dict) -> int:
    """Qwen3-MoE parameters counted from the config: embedding and head, and per layer the
    attention (with q/k norms), two norms, the router and every expert."""
    h, layers, vocab = hf["hidden_size"], hf["num_hidden_layers"], hf["vocab_size"]
    q = hf["num_attention_heads"] * hf["head_dim"]
    kv = hf["num_key_value_heads"] * hf["head_dim"]
    attention = h * (q + 2 * kv) + q * h + 2 * hf["head_dim"]
    experts = hf["num_experts"] * (h + 3 * h * hf["moe_intermediate_size"])
    return 2 * vocab * h + h + layers * (attention + 2 * h + experts)


def test_weight_bytes_of_qwen3_30b_a3b_on_meta() -> None:
    """The 30B-A3B shape, sized without allocating it: 30.5B parameters, 61 GB in bf16, plus
    the RoPE tables."""
    hf = {**QWEN3_CODER_30B_A3B, "max_position_embeddings": 4096}
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(qwen3_moe_config(hf)).to(torch.bfloat16)
    params = published_params(hf)
    assert 30.4e9 < params < 30.6e9
    rope = 2 * 4096 * hf["head_dim"] // 2 * 2  # cos and sin tables, bf16
    assert weight_bytes(model) == 2 * params + rope


def test_weights_that_do_not_fit_name_both_sizes() -> None:
    check_weights_fit(10 * 2**30, None, torch.device("cpu"))  # no limit known
    check_weights_fit(10 * 2**30, 11 * 2**30, torch.device("cuda"))
    with pytest.raises(ValueError, match="need 10.00 GiB but only 4.50 GiB of cuda:1 is free"):
        check_weights_fit(10 * 2**30, int(4.5 * 2**30), torch.device("cuda:1"))


def test_load_models_checks_the_fit_before_allocating(tmp_path: Path, monkeypatch) -> None:
    """On a CUDA device with too little free memory the 30B shape fails with the sizes, before
    any tensor is made on the device (this CPU-only test could not make one)."""
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(QWEN3_CODER_30B_A3B))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (8 * 2**30, 141 * 2**30))
    config = EngineConfig(
        model=str(target), load_format="dummy", device="cpu", dtype="bfloat16",
        speculative_config=None, max_model_len=1024,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"need 56\.\d\d GiB but only 8\.00 GiB of cuda is free"):
        load_models(config, torch.device("cuda"))


def test_parameters_are_made_in_the_engine_dtype(tmp_path: Path, monkeypatch) -> None:
    """No float32 parameter exists while a bf16 model is built (a float32 copy of a 30B model
    would need twice its memory)."""
    hf = {
        **QWEN3_CODER_30B_A3B,
        "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "num_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 16, "max_position_embeddings": 128,
    }  # fmt: skip
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(hf))
    made: list[torch.dtype] = []
    original = torch.nn.Parameter.__new__

    def recording(cls, data=None, requires_grad=True):
        if data is not None and data.device.type != "meta":
            made.append(data.dtype)
        return original(cls, data, requires_grad)

    monkeypatch.setattr(torch.nn.Parameter, "__new__", recording)
    config = EngineConfig(
        model=str(target), load_format="dummy", device="cpu", dtype="bfloat16",
        speculative_config=None,
    )  # fmt: skip
    loaded = load_models(config, torch.device("cpu"))
    assert made and set(made) == {torch.bfloat16}
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32


def test_modules_built_without_random_init_keep_their_memory_as_allocated() -> None:
    """Inside, torch's random initialisers leave tensors as they are (a load fills them);
    after, even when the build fails, they draw again."""
    from torch import nn

    from blockdraft.models.loader import without_random_init

    weight = torch.full((4, 4), 7.0)
    with without_random_init():
        nn.init.normal_(weight)
        nn.init.kaiming_uniform_(weight)
        assert (weight == 7.0).all()
    with pytest.raises(RuntimeError), without_random_init():
        raise RuntimeError("a failing build")
    nn.init.normal_(weight)
    assert (weight != 7.0).any()
