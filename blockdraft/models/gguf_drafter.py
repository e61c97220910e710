"""llama.cpp's DFlash drafter GGUF (`general.architecture` "dflash"), read as a z-lab drafter.

Names, as llama.cpp writes and reads them (ggml-org/llama.cpp: `conversion/qwen.py`
`DFlashModel`, PRs #22105 and #25110; `src/models/dflash.cpp` `load_arch_hparams` /
`load_arch_tensors`; `gguf-py/gguf/constants.py`):

- metadata: the Qwen3 body under `dflash.*` (`block_count`, `embedding_length`,
  `feed_forward_length`, `attention.head_count[_kv]`, `attention.key_length`,
  `attention.layer_norm_rms_epsilon`, `rope.freq_base`, `context_length`, optional
  `attention.sliding_window` + `attention.sliding_window_pattern`), `dflash.target_layers`,
  `dflash.block_size`, `dflash.target_hidden_size`, and the mask token as
  `tokenizer.ggml.mask_token_id` (#25110; `dflash.mask_token_id` before it). The converter
  writes `target_layers` as z-lab's `target_layer_ids` + 1, because llama.cpp taps a target
  layer's *input* (the input of layer i + 1 is the output of layer i).
- tensors: `blk.{i}.*` as for qwen3 (q/k rows in Hugging Face order: ggml runs the draft with
  NeoX RoPE, so the converter does not permute them), `fc.weight`, `enc.output_norm.weight`
  (z-lab's `hidden_norm`), `output_norm.weight` (`norm`), and optionally `token_embd.weight`,
  `output.weight` and `d2t` (I64, a reduced draft vocabulary).
- DFlash2 (a file with `selector_hidden.weight`, as `load_arch_tensors` detects it; PR
  #27342): `dflash.conv_kernel_size`, `dflash.conv_group_size`, `dflash.selector_rank`,
  `dflash.selector_top_k` (all required, as is `dflash.block_size`), per layer
  `attn_conv_base` / `ffn_conv_base` (ne [hidden, kernel, 2]: z-lab's `base_kernel`
  [2, kernel, hidden] as is, no `.weight` suffix) and `attn_conv_proj.weight` /
  `ffn_conv_proj.weight`, and the selector's `selector_hidden.weight`,
  `selector_predecessor.weight` and `selector_successor.weight` (ne [rank, vocab]: the
  codebooks' rows).

Variants llama.cpp loads under the same architecture but this engine does not run (DSpark's
Markov head, attention sinks, DeepSeek-V4 backbones) are refused with a ValueError naming what
the file holds.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType

from blockdraft.models.drafter_checkpoint import DrafterCheckpoint
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

ARCH = "dflash"

# llama.cpp tensor name -> z-lab's; `{i}` is the draft layer.
GLOBAL_TENSORS: dict[str, str] = {
    "fc.weight": "fc.weight",
    "enc.output_norm.weight": "hidden_norm.weight",
    "output_norm.weight": "norm.weight",
    "token_embd.weight": "embed_tokens.weight",
    "output.weight": "lm_head.weight",
    "d2t": "d2t",
}
LAYER_TENSORS: dict[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
OPTIONAL_TENSORS = {"token_embd.weight", "output.weight", "d2t"}
# DFlash2's, read only from a file with the selector (the tensor llama.cpp detects it by).
DFLASH2_MARKER = "selector_hidden.weight"
DFLASH2_GLOBAL_TENSORS: dict[str, str] = {
    "selector_hidden.weight": "candidate_selector.hidden_projection.weight",
    "selector_predecessor.weight": "candidate_selector.predecessor_codebook",
    "selector_successor.weight": "candidate_selector.successor_codebook",
}
DFLASH2_LAYER_TENSORS: dict[str, str] = {
    "attn_conv_base": "attention_conv.base_kernel",
    "attn_conv_proj.weight": "attention_conv.kernel_projection.weight",
    "ffn_conv_base": "mlp_conv.base_kernel",
    "ffn_conv_proj.weight": "mlp_conv.kernel_projection.weight",
}
DFLASH2_METADATA = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")

# What a tensor name (its last part) marks that this loader does not run; any other unknown
# tensor is refused as well. Names: src/llama-arch.cpp and src/models/dflash.cpp.
UNSUPPORTED_TENSORS: dict[str, str] = {
    "attn_sinks": "per-head attention sinks (attention_sink_bias)",
    "markov_w1": "a DSpark Markov head",
    "markov_w2": "a DSpark Markov head",
    "conf_proj": "a DSpark confidence head",
    "selector_predecessor": f"a DFlash2 candidate selector without {DFLASH2_MARKER}",
    "selector_successor": f"a DFlash2 candidate selector without {DFLASH2_MARKER}",
    "attn_conv_base": f"DFlash2 convolutions without {DFLASH2_MARKER}",
    "attn_conv_proj": f"DFlash2 convolutions without {DFLASH2_MARKER}",
    "ffn_conv_base": f"DFlash2 convolutions without {DFLASH2_MARKER}",
    "ffn_conv_proj": f"DFlash2 convolutions without {DFLASH2_MARKER}",
}
# Metadata of the same kind; each is refused when set to anything but its neutral value.
UNSUPPORTED_METADATA: dict[str, tuple[object, str]] = {
    "dflash.sample_from_anchor": (False, "drafting at the anchor slot (DSpark)"),
    "dflash.hyper_connection.count": (0, "a DeepSeek-V4 (hyper-connection) backbone"),
    "dflash.logit_scale": (1.0, "scaled drafter logits"),
    "dflash.final_logit_softcapping": (0.0, "soft-capped drafter logits"),
    "dflash.embedding_scale": (1.0, "scaled input embeddings"),
}


def read_gguf_drafter(path: str) -> DrafterCheckpoint:
    """The drafter's config now (from the header) and its tensors when asked."""
    with _mapped(path) as buf:
        metadata, tensor_list, _ = read_header(buf)
        tensors = _directory(tensor_list)
        hf_config = _build_config(metadata, tensors)
    num_layers = hf_config["num_hidden_layers"]
    dflash2 = DFLASH2_MARKER in tensors

    def read_tensors() -> Iterator[tuple[str, torch.Tensor]]:
        with _mapped(path) as buf:
            _, tensor_list, data_start = read_header(buf)
            for info in tensor_list:
                yield _zlab_name(info.name, num_layers, dflash2), _read(buf, info, data_start)

    return DrafterCheckpoint(hf_config, read_tensors)


@contextlib.contextmanager
def _mapped(path: str) -> Iterator[mmap.mmap]:
    """The file mapped read-only; every failure a ValueError naming the file."""
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size < HEADER_BYTES:
                raise FormatError("too short for a GGUF header")
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            try:
                yield buf
            finally:
                with contextlib.suppress(BufferError):  # a view may live in a traceback
                    buf.close()
    except FormatError as e:
        raise ValueError(f"{path} is not a valid GGUF file: {e}") from None
    except UnsupportedError as e:
        raise ValueError(f"{path}: {e}") from None
    except OSError as e:
        raise ValueError(f"cannot read GGUF drafter {path}: {e}") from None


def _directory(tensor_list: list[TensorInfo]) -> dict[str, TensorInfo]:
    tensors: dict[str, TensorInfo] = {}
    for info in tensor_list:
        if info.name in tensors:
            raise FormatError(f"tensor {info.name!r} appears twice")
        tensors[info.name] = info
    return tensors


def _build_config(metadata: dict[str, Any], tensors: dict[str, TensorInfo]) -> dict:
    """z-lab's config.json for the drafter the header describes."""
    arch = metadata.get("general.architecture")
    if arch != ARCH:
        raise UnsupportedError(
            f"general.architecture is {arch!r}; a DFlash drafter GGUF has {ARCH!r}"
        )
    for key, (neutral, what) in UNSUPPORTED_METADATA.items():
        if metadata.get(key, neutral) != neutral:
            raise UnsupportedError(f"metadata {key} = {metadata[key]!r}: {what} is not supported")
    dflash2 = DFLASH2_MARKER in tensors
    for name in tensors:
        kind = name.removesuffix(".weight").removesuffix(".bias").rpartition(".")[2]
        if kind in UNSUPPORTED_TENSORS and not (dflash2 and _is_dflash2_tensor(name)):
            raise UnsupportedError(f"tensor {name!r}: {UNSUPPORTED_TENSORS[kind]} is not supported")

    def meta(key: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
        return get_meta(metadata, f"{ARCH}.{key}", kind, default)

    hidden = uniform_meta_int(meta("embedding_length", int), "embedding_length")
    heads = uniform_meta_int(meta("attention.head_count", (int, list)), "head_count")
    kv_heads = uniform_meta_int(
        meta("attention.head_count_kv", (int, list), heads), "head_count_kv"
    )
    head_dim = meta("attention.key_length", int, hidden // heads)
    if meta("attention.value_length", int, head_dim) != head_dim:
        raise UnsupportedError("attention.value_length differs from attention.key_length")
    if meta("rope.dimension_count", int, head_dim) != head_dim:
        raise UnsupportedError("rope.dimension_count below the head size (partial RoPE)")
    sections = meta("rope.dimension_sections", list, [head_dim // 2, 0, 0, 0])
    if list(sections)[1:] != [0] * (len(sections) - 1):
        # M-RoPE drafts carry degenerate sections [n_rot/2, 0, 0, 0]: plain RoPE on text.
        raise UnsupportedError(f"rope.dimension_sections {sections} (multimodal RoPE)")
    target_hidden = meta("target_hidden_size", int, hidden)
    if target_hidden != hidden:
        raise UnsupportedError(
            f"target_hidden_size {target_hidden} differs from the drafter's {hidden}"
        )
    num_layers = meta("block_count", int)
    config: dict[str, Any] = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "intermediate_size": uniform_meta_int(
            meta("feed_forward_length", (int, list)), "feed_forward"
        ),
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon", float)),
        "rope_theta": float(meta("rope.freq_base", (int, float), 10000.0)),
        "rope_scaling": rope_scaling_meta(metadata, ARCH),
        "max_position_embeddings": meta("context_length", int),
        "vocab_size": _vocab_size(metadata, tensors),
        "tie_word_embeddings": False,
        "attention_bias": False,
        # llama.cpp's speculative decoder falls back to 16 without the key.
        "block_size": meta("block_size", int, 16),
        "dflash_config": {
            "mask_token_id": _mask_token_id(metadata),
            "target_layer_ids": _target_layer_ids(meta("target_layers", list)),
        },
    }
    window = meta("attention.sliding_window", int, 0)
    if window > 0:
        pattern = meta("attention.sliding_window_pattern", list)
        if len(pattern) != num_layers:
            raise FormatError(f"sliding_window_pattern has {len(pattern)} entries")
        config["sliding_window"] = window
        config["layer_types"] = ["sliding_attention" if s else "full_attention" for s in pattern]
    if "d2t" in tensors:
        config["draft_vocab_size"] = tensors["d2t"].ne[0]
    if dflash2:
        # llama.cpp refuses a DFlash2 draft that lacks any of these, block_size included.
        config["architectures"] = ["DFlash2DraftModel"]
        config["block_size"] = meta("block_size", int)
        config["dflash_config"].update({key: meta(key, int) for key in DFLASH2_METADATA})
    return config


def _is_dflash2_tensor(name: str) -> bool:
    return name in DFLASH2_GLOBAL_TENSORS or name.split(".", 2)[-1] in DFLASH2_LAYER_TENSORS


def _vocab_size(metadata: dict[str, Any], tensors: dict[str, TensorInfo]) -> int:
    tokens = metadata.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list) and tokens:
        default = len(tokens)  # the converter copies the target's tokenizer in
    elif "token_embd.weight" in tensors:
        default = tensors["token_embd.weight"].ne[-1]
    else:
        default = ...
    return get_meta(metadata, f"{ARCH}.vocab_size", int, default)


def _mask_token_id(metadata: dict[str, Any]) -> int:
    for key in ("tokenizer.ggml.mask_token_id", f"{ARCH}.mask_token_id"):
        if key in metadata:
            return get_meta(metadata, key, int)
    raise FormatError("no mask token (tokenizer.ggml.mask_token_id)")


def _target_layer_ids(target_layers: list) -> list[int]:
    """z-lab's ids (outputs of layer i) from llama.cpp's (inputs of layer i + 1)."""
    if not target_layers or any(
        not isinstance(i, int) or isinstance(i, bool) or i < 1 for i in target_layers
    ):
        raise FormatError(
            f"dflash.target_layers {target_layers} must be >= 1 (the input of layer 0 is the "
            "embedding output, which no DFlash drafter reads)"
        )
    return [i - 1 for i in target_layers]


def _zlab_name(name: str, num_layers: int, dflash2: bool) -> str:
    global_tensors = GLOBAL_TENSORS | (DFLASH2_GLOBAL_TENSORS if dflash2 else {})
    layer_tensors = LAYER_TENSORS | (DFLASH2_LAYER_TENSORS if dflash2 else {})
    if name in global_tensors:
        return global_tensors[name]
    prefix, layer, rest = (name.split(".", 2) + ["", ""])[:3]
    if prefix == "blk" and layer.isdigit() and int(layer) < num_layers and rest in layer_tensors:
        return f"layers.{layer}.{layer_tensors[rest]}"
    raise UnsupportedError(f"tensor {name!r} is not part of a DFlash drafter")


def _read(buf: mmap.mmap, info: TensorInfo, data_start: int) -> torch.Tensor:
    """The tensor in torch dimension order: float32, or int64 for `d2t`."""
    if info.qtype in (GGMLQuantizationType.I64, GGMLQuantizationType.I32):
        start, rows, row_bytes = tensor_extent(info, data_start, len(buf))
        dtype = np.int64 if info.qtype == GGMLQuantizationType.I64 else np.int32
        count = rows * row_bytes // np.dtype(dtype).itemsize
        values = np.frombuffer(buf, dtype=dtype, count=count, offset=start).astype(np.int64)
        return torch.from_numpy(values.reshape(tuple(reversed(info.ne))))
    return dequantize(buf, info, data_start)
