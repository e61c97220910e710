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

SHAPES: dict[str, BenchShape] = {
    shape.name: shape for shape in (BenchShape("qwen3-8b", QWEN3_8B, dense_bytes_per_token),)
}
