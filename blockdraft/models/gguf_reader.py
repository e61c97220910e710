"""The GGUF container: header (metadata and tensor directory), parsed with bounds checks, and
tensor data dequantized to float32.

The header is parsed here rather than with `gguf.GGUFReader`: the reader walks every element of
the 49k-entry vocabulary arrays through numpy views, which costs seconds per load, and any
truncation surfaces from deep inside it. Names, enums and block sizes still come from
`gguf.constants`, and the dequantization itself is `gguf.quants.dequantize`.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

import gguf.quants
import numpy as np
import torch
from gguf.constants import (
    GGML_QUANT_SIZES,
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGMLQuantizationType,
    GGUFValueType,
)


class FormatError(Exception):
    """The bytes do not form a well-formed GGUF file (wrong magic, truncated, inconsistent)."""


class UnsupportedError(Exception):
    """A well-formed GGUF that this loader cannot convert (architecture, tokenizer, tensor type)."""


# magic (4) + version (4) + tensor count (8) + metadata count (8)
HEADER_BYTES = 24
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
class TensorInfo:
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
            raise FormatError(
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
            raise FormatError(f"{what} at offset {self.pos - n} is not UTF-8") from None

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
            raise FormatError(f"{what}[{len(out)}] at offset {pos} is not UTF-8") from None
        self.pos = pos
        if len(out) < count:
            raise FormatError(
                f"truncated or corrupt: {what} stops after {len(out)} of {count} strings "
                f"at offset {pos}, but the file is {size} bytes long"
            )
        return out

    def value(self, vtype: int, what: str) -> Any:
        try:
            vtype = GGUFValueType(vtype)
        except ValueError:
            raise FormatError(f"{what} has unknown value type {vtype}") from None
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


def read_header(buf: mmap.mmap) -> tuple[dict[str, Any], list[TensorInfo], int]:
    """Metadata, tensor directory and the absolute offset of the tensor data section."""
    cur = _Cursor(buf)
    magic = cur.scalar("<I", "magic")
    if magic != GGUF_MAGIC:
        raise FormatError(f"wrong magic bytes {bytes(buf[:4])!r} (expected b'GGUF')")
    version = cur.scalar("<I", "version")
    if version & 0xFFFF == 0 and version != 0:
        raise UnsupportedError("big-endian GGUF files are not supported")
    if version not in _SUPPORTED_VERSIONS:
        raise FormatError(f"unsupported GGUF version {version} (supported: 2, 3)")
    n_tensors = cur.scalar("<Q", "tensor count")
    n_kv = cur.scalar("<Q", "metadata count")

    metadata: dict[str, Any] = {}
    for i in range(n_kv):
        key = cur.string(f"metadata key #{i}")
        vtype = cur.scalar("<I", f"type of metadata {key!r}")
        if key in metadata:
            raise FormatError(f"metadata key {key!r} appears twice")
        metadata[key] = cur.value(vtype, f"metadata {key!r}")

    tensors: list[TensorInfo] = []
    for i in range(n_tensors):
        name = cur.string(f"name of tensor #{i}")
        n_dims = cur.scalar("<I", f"rank of tensor {name!r}")
        if not 1 <= n_dims <= 4:  # GGML_MAX_DIMS
            raise FormatError(f"tensor {name!r} has rank {n_dims}")
        ne = tuple(cur.scalar("<Q", f"shape of tensor {name!r}") for _ in range(n_dims))
        raw_type = cur.scalar("<I", f"type of tensor {name!r}")
        try:
            qtype = GGMLQuantizationType(raw_type)
        except ValueError:
            raise FormatError(f"tensor {name!r} has unknown ggml type {raw_type}") from None
        offset = cur.scalar("<Q", f"data offset of tensor {name!r}")
        tensors.append(TensorInfo(name, ne, qtype, offset))

    alignment = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise FormatError(f"general.alignment {alignment!r} is not a power of two")
    data_start = -(-cur.pos // alignment) * alignment
    return metadata, tensors, data_start


def tensor_extent(info: TensorInfo, data_start: int, file_size: int) -> tuple[int, int, int]:
    """(absolute start, rows, bytes per row) of a tensor's data, checked against the file size.

    Quantization blocks never straddle rows, so each row is a whole number of blocks.
    """
    block_size, type_size = GGML_QUANT_SIZES[info.qtype]
    if info.ne[0] % block_size:
        raise FormatError(
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
        raise FormatError(
            f"truncated: tensor {info.name!r} needs bytes {start}..{end}, "
            f"but the file ends at {file_size}"
        )
    return start, rows, row_bytes


def dequantize(buf: mmap.mmap, info: TensorInfo, data_start: int) -> torch.Tensor:
    """The tensor as float32, in torch dimension order (the reverse of ggml's `ne`)."""
    start, rows, row_bytes = tensor_extent(info, data_start, len(buf))
    raw = np.frombuffer(buf, dtype=np.uint8, count=rows * row_bytes, offset=start)
    raw = raw.reshape(rows, row_bytes)
    try:
        values = gguf.quants.dequantize(raw, info.qtype)
    except NotImplementedError:
        raise UnsupportedError(
            f"tensor {info.name!r} has type {info.qtype.name}, which cannot be dequantized"
        ) from None
    except (ValueError, TypeError, IndexError) as e:
        raise FormatError(f"tensor {info.name!r} could not be dequantized: {e}") from None
    # F32 / F16 come back as views of the read-only mapping; everything else is a fresh array.
    values = np.array(values, dtype=np.float32, copy=not values.flags.writeable)
    # Checked in numpy: single-threaded and cheap, where torch's threaded reduction is not
    # on a busy machine. Garbage scale bytes are the usual sign of a damaged file.
    if not np.isfinite(values).all():
        raise FormatError(f"tensor {info.name!r} holds NaN or infinite values (corrupt data?)")
    return torch.from_numpy(values.reshape(tuple(reversed(info.ne))))


def get_meta(metadata: dict[str, Any], key: str, kind: type | tuple[type, ...], default: Any = ...):
    """`metadata[key]`, checked to be a `kind`; `default` where absent (none: required)."""
    if key not in metadata:
        if default is ...:
            raise FormatError(f"required metadata {key!r} is missing")
        return default
    value = metadata[key]
    # bool is an int subclass; a flag where a count belongs is still a corrupt file.
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _as_tuple(kind)):
        raise FormatError(f"metadata {key!r} has unexpected value {value!r}")
    return value


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def uniform_meta_int(value: Any, key: str) -> int:
    """A positive integer metadata value; a per-layer list must hold one value throughout."""
    # Some converters write a per-layer list; Hugging Face configs only hold one number.
    if isinstance(value, list):
        if not value or len(set(value)) != 1:
            raise UnsupportedError(f"{key} varies per layer ({value}), which is not supported")
        value = value[0]
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise FormatError(f"metadata {key!r} has unexpected value {value!r}")
    return value


def rope_scaling_meta(metadata: dict[str, Any], arch: str) -> dict | None:
    """The Hugging Face `rope_scaling` of `arch`'s metadata (None: no scaling)."""
    kind = get_meta(metadata, f"{arch}.rope.scaling.type", str, "none")
    if kind == "none":
        return None
    factor = float(get_meta(metadata, f"{arch}.rope.scaling.factor", (int, float)))
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
    raise UnsupportedError(f"RoPE scaling type {kind!r} is not supported (linear, yarn)")
