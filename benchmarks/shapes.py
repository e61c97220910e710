"""Model shapes the GPU benchmarks run with random weights (`load_format="dummy"`): each one's
config.json (from the published checkpoint), the drafter's depth, and the weight bytes one
decoded token reads (the memory-bandwidth roofline's numerator)."""

from __future__ import annotations

import dataclasses
import json
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import write_dummy_drafter


def _attention_params(cfg: dict) -> int:
    """One layer's q/k/v and output projections."""
    h = cfg["hidden_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    return h * (q + 2 * kv) + q * h


def expected_distinct_experts(num_experts: int, top_k: int, num_tokens: int) -> float:
    """Mean number of distinct experts `num_tokens` tokens choose when each picks `top_k` of
    `num_experts` uniformly at random (random weights route about uniformly)."""
    return num_experts * (1 - (1 - top_k / num_experts) ** num_tokens)


def mixer_bytes(cfg: dict) -> int:
    """bf16 bytes of every layer's token mixer one step reads: attention's projections, or for
    a hybrid (Qwen3.5, `layer_types`) its full-attention layers with the query's output gate and
    its Gated DeltaNet layers' projections and conv taps, plus their float32 recurrent states,
    each read and written once."""
    layer_types = cfg.get("layer_types") or ()
    if "linear_attention" not in layer_types:
        return 2 * cfg["num_hidden_layers"] * _attention_params(cfg)
    h = cfg["hidden_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    key = cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
    heads_v = cfg["linear_num_value_heads"]
    value = heads_v * cfg["linear_value_head_dim"]
    conv = 2 * key + value
    full = h * (2 * q + 2 * kv) + q * h
    linear = h * (conv + value + 2 * heads_v) + value * h + conv * cfg["linear_conv_kernel_dim"]
    state = heads_v * cfg["linear_key_head_dim"] * cfg["linear_value_head_dim"] * 4 * 2
    num_full = layer_types.count("full_attention")
    num_linear = len(layer_types) - num_full
    return 2 * (num_full * full + num_linear * linear) + num_linear * state


def moe_bytes_per_step(cfg: dict, num_tokens: int) -> int:
    """bf16 weight bytes an MoE forward of `num_tokens` tokens of one request reads when each
    expert it routes to is read once: every layer's mixer (`mixer_bytes`), sparse layers'
    router, the distinct experts chosen (`expected_distinct_experts`; rounded down to whole
    bytes) and the gated shared expert where there is one (Qwen3.5-MoE), dense layers' MLP,
    and the LM head."""
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    step, only = cfg.get("decoder_sparse_step") or 1, set(cfg.get("mlp_only_layers") or ())
    sparse = sum((i + 1) % step == 0 and i not in only for i in range(layers))
    experts, top_k = cfg["num_experts"], cfg["num_experts_per_tok"]
    expert = 3 * h * cfg["moe_intermediate_size"]
    routed = experts * h + expected_distinct_experts(experts, top_k, num_tokens) * expert
    shared = cfg.get("shared_expert_intermediate_size") or 0
    if shared:
        routed += 3 * h * shared + h  # the shared expert and its gate
    dense_mlp = 3 * h * cfg.get("intermediate_size", 0)
    params = sparse * routed + (layers - sparse) * dense_mlp
    return mixer_bytes(cfg) + int(2 * (params + cfg["vocab_size"] * h))


def moe_bytes_per_token(cfg: dict) -> int:
    """What one batch-1 decoded token reads: mixers, router, its top-k experts (and the shared
    one), LM head."""
    return moe_bytes_per_step(cfg, 1)


def dense_bytes_per_token(cfg: dict) -> int:
    """bf16 bytes a dense-MLP decoder's batch-1 token reads: its mixers (`mixer_bytes`:
    attention, or a hybrid's gated full attention, Gated DeltaNet and its states), every
    layer's MLP and the LM head; the embedding is gathered (one row per token)."""
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    weights = layers * 3 * h * cfg["intermediate_size"] + cfg["vocab_size"] * h
    return mixer_bytes(cfg) + 2 * weights


# Every width of a bench shape cut to a CPU-sized one (`BenchShape.shrunk`).
CPU_WIDTHS = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_experts": 16,
    "num_attention_heads": 8,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "shared_expert_intermediate_size": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
}


@dataclass(frozen=True)
class BenchShape:
    name: str
    config: dict  # the target's config.json
    bytes_per_token: Callable[[dict], int]  # weight bytes a batch-1 decode step reads
    drafter_layers: int = 5
    drafter_window: int | None = None  # sliding layers' window (all but the last); None: full

    def with_layers(self, num_layers: int) -> BenchShape:
        """The same shape cut to its first `num_layers` layers (a hybrid's `layer_types` cut
        alike): each layer's kernels as in the whole model, for a GPU too small for it."""
        total = self.config["num_hidden_layers"]
        if not 1 <= num_layers <= total:
            raise ValueError(f"{self.name} has {total} layers; cannot keep {num_layers}")
        config = dict(self.config, num_hidden_layers=num_layers)
        if "layer_types" in config:
            config["layer_types"] = config["layer_types"][:num_layers]
        return dataclasses.replace(self, name=f"{self.name}-{num_layers}l", config=config)

    def shrunk(self, num_layers: int = 5) -> BenchShape:
        """The same structure at CPU widths (`CPU_WIDTHS`; the GQA ratio, routing, dense and
        sparse layers, q/k norms and an untied head as published), cut to its first
        `num_layers` layers: for smoke runs of GPU benchmarks and tests of the shapes."""
        cut = self.with_layers(min(num_layers, self.config["num_hidden_layers"]))
        cfg = cut.config
        config = {**cfg, **{k: v for k, v in CPU_WIDTHS.items() if k in cfg}}
        group = cfg["num_attention_heads"] // cfg["num_key_value_heads"]
        config["num_key_value_heads"] = config["num_attention_heads"] // group
        return dataclasses.replace(cut, name=f"{self.name}-shrunk", config=config)

    def dirs(self) -> tuple[Path, Path]:
        """A temporary target directory (config only: `load_format="dummy"`) and a DFlash
        drafter for it (config only too)."""
        tmp = Path(tempfile.mkdtemp())
        target = tmp / self.name
        target.mkdir()
        (target / "config.json").write_text(json.dumps(self.config))
        drafter = write_dummy_drafter(
            tmp / "drafter", self.config, num_layers=self.drafter_layers, with_weights=False,
            sliding_window=self.drafter_window,
        )  # fmt: skip
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

# Qwen/Qwen3-32B's config.json: the dense shape the tensor-parallel runs split (64 query and 8
# KV heads, so up to 8 ranks hold whole KV heads).
QWEN3_32B = {
    **QWEN3_8B,
    "hidden_size": 5120,
    "intermediate_size": 25600,
    "num_hidden_layers": 64,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
}

# Qwen/Qwen3-Coder-30B-A3B-Instruct's config.json (the fields the engine and transformers read).
QWEN3_CODER_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000000.0,
    "max_position_embeddings": 262144,
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

# Qwen/Qwen3.5-35B-A3B's language model (Qwen3.6-35B-A3B shares the shape): the hybrid layers
# (every fourth full attention), each with 256 routed experts (top 8) and a gated shared expert.
QWEN3_5_35B_A3B = {
    "architectures": ["Qwen3_5MoeForCausalLM"],
    "model_type": "qwen3_5_moe_text",
    "vocab_size": 248320,
    "hidden_size": 2048,
    "num_hidden_layers": 40,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "layer_types": [
        "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(40)
    ],
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
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
        BenchShape("qwen3-32b", QWEN3_32B, dense_bytes_per_token),
        # z-lab/Qwen3-Coder-30B-A3B-DFlash: an 8-layer drafter (~0.5B parameters besides the
        # target's embedding and head).
        BenchShape("qwen3-30b-a3b", QWEN3_CODER_30B_A3B, moe_bytes_per_token, drafter_layers=8),
        # z-lab's drafters for hybrid targets window their layers but the last (2048 or 4096).
        BenchShape("qwen3.5-27b", QWEN3_5_27B, dense_bytes_per_token, drafter_window=2048),
        # z-lab/Qwen3.5-35B-A3B-DFlash weighs ~0.9 GB in bf16: about 8 layers at this width.
        BenchShape(
            "qwen3.5-35b-a3b",
            QWEN3_5_35B_A3B,
            moe_bytes_per_token,
            drafter_layers=8,
            drafter_window=2048,
        ),  # fmt: skip
    )
}
