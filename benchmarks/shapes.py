"""Model shapes the GPU benchmarks run with random weights (`load_format="dummy"`): each one's
config.json (from the published checkpoint), the drafter's depth, and the weight bytes one
decoded token reads (the memory-bandwidth roofline's numerator)."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import write_dummy_drafter


def dense_bytes_per_token(cfg: dict) -> int:
    """bf16 bytes of a dense decoder's weights one token reads: every layer's attention and MLP
    projections and the LM head; the embedding is gathered (one row per token)."""
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * inter
    return 2 * (layers * per_layer + cfg["vocab_size"] * h)


def hybrid_bytes_per_token(cfg: dict) -> int:
    """`dense_bytes_per_token` for a hybrid (Qwen3.5) decoder: full-attention layers with the
    query's output gate, Gated DeltaNet layers' projections and conv taps, and their float32
    recurrent states, each read and written once per decoded token."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    key = cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
    heads_v = cfg["linear_num_value_heads"]
    value = heads_v * cfg["linear_value_head_dim"]
    conv = 2 * key + value
    mlp = 3 * h * inter
    full = h * (2 * q + 2 * kv) + q * h + mlp
    linear = h * (conv + value + 2 * heads_v) + value * h + conv * cfg["linear_conv_kernel_dim"]
    state = heads_v * cfg["linear_key_head_dim"] * cfg["linear_value_head_dim"] * 4 * 2
    num_full = cfg["layer_types"].count("full_attention")
    num_linear = len(cfg["layer_types"]) - num_full
    weights = num_full * full + num_linear * (linear + mlp) + cfg["vocab_size"] * h
    return 2 * weights + num_linear * state


@dataclass(frozen=True)
class BenchShape:
    name: str
    config: dict  # the target's config.json
    bytes_per_token: Callable[[dict], int]  # weight bytes a batch-1 decode step reads
    drafter_layers: int = 5

    def dirs(self) -> tuple[Path, Path]:
        """A temporary target directory (config only: `load_format="dummy"`) and a DFlash
        drafter for it (config only too)."""
        tmp = Path(tempfile.mkdtemp())
        target = tmp / self.name
        target.mkdir()
        (target / "config.json").write_text(json.dumps(self.config))
        drafter = write_dummy_drafter(
            tmp / "drafter", self.config, num_layers=self.drafter_layers, with_weights=False
        )
        return target, drafter


QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "torch_dtype": "bfloat16",
}

# Qwen3.5-27B's language model (Qwen3.6-27B and Qwen3.8-27B share the shape): every fourth
# layer full attention.
QWEN3_5_27B = {
    "architectures": ["Qwen3_5ForCausalLM"],
    "model_type": "qwen3_5_text",
    "vocab_size": 248320,
    "hidden_size": 5120,
    "intermediate_size": 17408,
    "num_hidden_layers": 64,
    "num_attention_heads": 24,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 48,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "layer_types": [
        "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(64)
    ],
    "rms_norm_eps": 1e-6,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000000.0,
        "partial_rotary_factor": 0.25,
    },
    "max_position_embeddings": 262144,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "torch_dtype": "bfloat16",
}

SHAPES: dict[str, BenchShape] = {
    shape.name: shape
    for shape in (
        BenchShape("qwen3-8b", QWEN3_8B, dense_bytes_per_token),
        BenchShape("qwen3.5-27b", QWEN3_5_27B, hybrid_bytes_per_token),
    )
}
