"""Checkpoint loading: a Hugging Face directory (safetensors, single or sharded) or a GGUF file.

Every failure a user can cause (missing or corrupt files, unknown architecture, tensors of the
wrong shape) becomes a ValueError naming the file and the problem.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from blockdraft.distributed.tensor_parallel import Shard, param_shard
from blockdraft.tokenizer import Tokenizer


@dataclass
class Checkpoint:
    """What a model path yields before any module is built."""

    hf_config: dict
    tokenizer: Tokenizer | None
    eos_token_ids: list[int] = field(default_factory=list)
    generation_defaults: dict = field(default_factory=dict)
    state_dict: dict[str, torch.Tensor] | None = None  # preloaded (GGUF); else read lazily
    weight_files: list[Path] = field(default_factory=list)


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"missing file: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(read_json(index).get("weight_map", {}).values()))
        files = [path / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"shards listed in {index} are missing: {', '.join(missing)}")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(path.glob("*.safetensors"))
    if found:
        return found
    raise ValueError(f"no weights in {path}: expected model.safetensors or a sharded index")


def _eos_ids(value: object) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def read_checkpoint(model: str, load_format: str = "auto") -> Checkpoint:
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        from blockdraft.models.gguf_loader import load_gguf

        g = load_gguf(str(path))
        tokenizer = Tokenizer(g.tokenizer_json, g.tokenizer_config)
        return Checkpoint(g.hf_config, tokenizer, list(g.eos_token_ids), {}, g.state_dict)
    if not path.is_dir():
        raise ValueError(f"model path {model!r} is neither a directory nor a .gguf file")
    hf_config = read_json(path / "config.json")
    gen_file = path / "generation_config.json"
    gen = read_json(gen_file) if gen_file.is_file() else {}
    tokenizer = Tokenizer.from_dir(path) if (path / "tokenizer.json").is_file() else None
    eos = _eos_ids(gen.get("eos_token_id", hf_config.get("eos_token_id")))
    if not eos and tokenizer is not None and tokenizer.eos_token_id is not None:
        eos = [tokenizer.eos_token_id]
    defaults = {k: gen[k] for k in ("temperature", "top_p", "top_k", "min_p") if k in gen}
    files = [] if load_format == "dummy" else _weight_files(path)
    return Checkpoint(hf_config, tokenizer, eos, defaults, None, files)


def param_shards(params: dict[str, nn.Parameter]) -> dict[str, Shard]:
    """The parameters that hold a tensor-parallel shard of their checkpoint tensor."""
    return {name: s for name, p in params.items() if (s := param_shard(p)) is not None}


def _check_full(name: str, shape: list[int] | torch.Size, shard: Shard, source: object) -> None:
    if len(shape) <= shard.dim or shape[shard.dim] != shard.full:
        raise ValueError(
            f"{source}: tensor {name!r} has shape {tuple(shape)}, expected {shard.full} "
            f"entries along dim {shard.dim}"
        )


def checkpoint_tensor_names(ckpt: Checkpoint) -> list[str]:
    """The tensors a checkpoint holds, without reading them."""
    if ckpt.state_dict is not None:
        return list(ckpt.state_dict)
    names = []
    for file in ckpt.weight_files:
        try:
            with safe_open(str(file), framework="pt") as f:
                names += f.keys()
        except (SafetensorError, OSError) as e:
            raise ValueError(f"corrupt or unreadable weight file {file}: {e}") from None
    return names


def checkpoint_tensor_shapes(ckpt: Checkpoint) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor a checkpoint holds, without reading them."""
    if ckpt.state_dict is not None:
        return {name: tuple(t.shape) for name, t in ckpt.state_dict.items()}
    shapes = {}
    for file in ckpt.weight_files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    shapes[name] = tuple(f.get_slice(name).get_shape())
        except (SafetensorError, OSError) as e:
            raise ValueError(f"corrupt or unreadable weight file {file}: {e}") from None
    return shapes


def shard_tensors(tensors, shards: dict[str, Shard], source: object):
    """(name, tensor) pairs of tensors held whole, each cut to its slice where `shards` names
    it (a tensor-parallel rank's part)."""
    for name, tensor in tensors:
        shard = shards.get(name)
        if shard is not None:
            _check_full(name, tensor.shape, shard, source)
            tensor = shard.take(tensor)
        yield name, tensor


def iter_checkpoint_tensors(
    ckpt: Checkpoint,
    shards: dict[str, Shard] | None = None,
    skip=lambda name: False,  # name -> True for a tensor this rank does not hold
):
    """(name, tensor) of every checkpoint tensor but those `skip` names (never read); for a
    name in `shards`, only that slice, read alone from safetensors (`get_slice`), so that a
    tensor-parallel rank never holds the tensors whole (GGUF checkpoints are dequantized whole
    at open, then sliced)."""
    shards = shards or {}
    if ckpt.state_dict is not None:
        kept = ((n, t) for n, t in ckpt.state_dict.items() if not skip(n))
        yield from shard_tensors(kept, shards, "checkpoint")
        return
    for file in ckpt.weight_files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    if skip(name):
                        continue
                    shard = shards.get(name)
                    if shard is None:
                        yield name, f.get_tensor(name)
                        continue
                    part = f.get_slice(name)
                    _check_full(name, part.get_shape(), shard, file)
                    yield name, shard.take(part)
        except (SafetensorError, OSError) as e:
            raise ValueError(f"corrupt or unreadable weight file {file}: {e}") from None


def _shard_entry(params: dict[str, nn.Parameter], where: tuple[str, tuple]) -> Shard | None:
    """The shard of the parameter `where` (parameter name, index) places a tensor in, where
    the index picks one entry of the sharded dim (an expert of experts split over the ranks)."""
    target, index = where
    shard = param_shard(params[target]) if target in params else None
    if shard is None or not isinstance(index[shard.dim], int):
        return None
    return shard


def other_ranks_tensors(params: dict[str, nn.Parameter], locate):
    """For `iter_checkpoint_tensors`' skip: whether `locate` places a tensor in an entry of a
    sharded dim that another tensor-parallel rank holds (so this rank never reads it)."""

    def skip(name: str) -> bool:
        where = locate(name)
        shard = None if where is None else _shard_entry(params, where)
        return shard is not None and not shard.start <= where[1][shard.dim] < shard.stop

    return skip


def load_weights(
    params: dict[str, nn.Parameter],
    tensors,  # iterable of (name, tensor)
    source: str,
    ignore=lambda name: False,
    locate=lambda name: None,  # name -> (parameter name, index) for a tensor filling a slice
) -> None:
    """Copy checkpoint tensors into `params`; every parameter must be filled, either by a
    tensor of its own name or by the slices `locate` places (per-expert tensors stacked into
    one parameter; its index is into the whole parameter). A parameter that holds a
    tensor-parallel shard takes its slice (read so by `iter_checkpoint_tensors`) at its start;
    a padded tail stays as it is; a slice `locate` places at one entry of its sharded dim goes
    to the rank holding that entry (the others pass it over: see `other_ranks_tensors`)."""
    views = {name: _loaded_part(p) for name, p in params.items()}
    filled = dict.fromkeys(params, 0)  # elements written so far
    for name, tensor in tensors:
        where = locate(name)
        target, index = (name, ...) if where is None else where
        shard = None if where is None else _shard_entry(params, where)
        if shard is not None:
            entry = index[shard.dim]
            if not shard.start <= entry < shard.stop:
                continue  # another rank's
            index = (*index[: shard.dim], entry - shard.start, *index[shard.dim + 1 :])
        if target not in params:
            if ignore(name):
                continue
            raise ValueError(f"{source}: unexpected tensor {name!r}")
        param = views[target]
        shape = tuple(param[index].shape)
        if tuple(tensor.shape) != shape:
            raise ValueError(
                f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {shape}"
            )
        with torch.no_grad():
            param[index].copy_(tensor)
        filled[target] += tensor.numel()
    missing = [name for name, count in filled.items() if count < views[name].numel()]
    if missing:
        raise ValueError(f"{source}: missing tensors {sorted(missing)[:8]}")


def _loaded_part(param: nn.Parameter) -> torch.Tensor:
    """The part of `param` its checkpoint tensor fills: a tensor-parallel shard's leading rows
    (a padded vocabulary's tail is not in the checkpoint), else all of it."""
    shard = param_shard(param)
    if shard is None:
        return param
    return param.narrow(shard.dim, 0, shard.length)


# torch.nn.init's random initialisers, which module constructors call.
_RANDOM_INITS = (
    "uniform_", "normal_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_",
    "xavier_uniform_", "xavier_normal_", "orthogonal_",
)  # fmt: skip


@contextlib.contextmanager
def without_random_init() -> Iterator[None]:
    """Modules built inside keep their parameters as allocated: every one is then loaded (or
    made by `init_dummy_weights`). The random init that a load overwrites took half of
    `blockdraft generate`'s start-up on one CPU thread (on the meta device it also imports
    torch._dynamo)."""
    saved = {name: getattr(nn.init, name) for name in _RANDOM_INITS}
    try:
        for name in _RANDOM_INITS:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def init_dummy_weights(module: nn.Module, std: float = 0.02) -> None:
    """Random weights made where the module lives (for benchmarks without a checkpoint)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, std)
