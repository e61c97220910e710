"""Builds an engine's models from its config: the target (checkpoint or dummy weights) and, when
speculating, the DFlash drafter on top of it, with the lengths and draft counts they imply. A
drafter that does not fit the target, or a target whose weights do not fit the device's free
memory, fails before any weights load."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from blockdraft.config import EngineConfig, SpeculativeConfig, check_tensor_parallel_shape
from blockdraft.distributed.tensor_parallel import (
    Shard,
    TensorParallel,
    building_tensor_parallel,
)
from blockdraft.layers.linear import fuse_projections
from blockdraft.models.dflash_drafter import DFlashDrafter, load_drafter
from blockdraft.models.draft_vocab import read_token_map, resolve_token_map
from blockdraft.models.drafter_checkpoint import read_drafter_checkpoint
from blockdraft.models.llama import DecoderLM
from blockdraft.models.loader import (
    Checkpoint,
    checkpoint_tensor_shapes,
    init_dummy_weights,
    iter_checkpoint_tensors,
    load_weights,
    other_ranks_tensors,
    param_shards,
    read_checkpoint,
    read_json,
    without_random_init,
)
from blockdraft.models.registry import resolve_architecture, resolve_drafter
from blockdraft.spec_decode.draft_schedule import DraftSchedule, default_num_drafts
from blockdraft.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_LEN = 4096


@dataclass
class LoadedModels:
    model: DecoderLM
    drafter: DFlashDrafter | None  # None: no speculation
    tokenizer: Tokenizer | None
    eos_token_ids: list[int]
    generation_defaults: dict
    max_model_len: int
    num_spec: int  # most drafts a step verifies (0: no speculation)
    draft_schedule: DraftSchedule | None

    @property
    def lookahead(self) -> int:
        return lookahead_rows(self.num_spec)


def lookahead_rows(num_spec: int) -> int:
    """Rows past the committed tokens a step may write (anchor + N masks), for any N the draft
    schedule picks (all are <= num_spec)."""
    return num_spec + 1 if num_spec else 0


def check_tensor_parallel(config: EngineConfig) -> None:
    """`load_models`' tensor-parallel shape checks from the config files alone, for the driver
    to run before it starts workers (a GGUF target is checked when it loads)."""
    size = config.tensor_parallel_size
    if config.model is not None and Path(config.model).is_dir():
        hf = read_json(Path(config.model) / "config.json")
        check_tensor_parallel_shape(size, "the target", resolve_architecture(hf).parse_config(hf))
    spec = config.speculative_config
    if spec is not None:
        draft_cfg, _ = resolve_drafter(read_drafter_checkpoint(spec.model).hf_config)
        check_tensor_parallel_shape(size, "the drafter", draft_cfg.body)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of a model's parameters and buffers (shared ones once), as built: on the "meta"
    device this sizes a model without allocating it."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def check_weights_fit(need: int, free: int | None, device: torch.device) -> None:
    """A ValueError naming both sizes when `need` bytes of weights exceed the `free` bytes of
    `device` (None: no limit known, as on the CPU)."""
    if free is not None and need > free:
        raise ValueError(
            f"the target model's weights need {need / 2**30:.2f} GiB but only "
            f"{free / 2**30:.2f} GiB of {device} is free: use a smaller model or dtype, or free "
            "the device (LLM.shutdown() an engine no longer used)"
        )


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Parameters made inside are made in `dtype`: a bf16 model never exists in float32 first
    (which would need twice its memory). Buffers computed in explicit float32 (RoPE tables)
    stay so until the model's `.to(dtype)`, as before."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def rank_checkpoint_tensors(
    ckpt: Checkpoint, model: nn.Module, params: dict[str, nn.Parameter]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors under the model's names (a family may rename, regroup or drop
    some: `checkpoint_tensors`, e.g. a multimodal checkpoint's language model), each tensor of
    a tensor-parallel shard as its slice: read alone where the family only renames the tensor,
    else cut from the tensor it makes; other ranks' experts are not read."""
    shards = param_shards(params)
    skip = other_ranks_tensors(params, model.checkpoint_slice)
    rename = getattr(model, "checkpoint_tensors", None)
    if rename is None:
        return iter_checkpoint_tensors(ckpt, shards, skip)
    if not shards:
        return rename(iter_checkpoint_tensors(ckpt, None, skip))
    # Shape-only stand-ins go through the renaming: a tensor it passes on as it is keeps its
    # identity, which maps the model's name back to the checkpoint's.
    stand_ins = {
        name: torch.empty(shape, device="meta")
        for name, shape in checkpoint_tensor_shapes(ckpt).items()
    }
    origin = {id(t): name for name, t in stand_ins.items()}
    model_name = {origin[id(t)]: new for new, t in rename(stand_ins.items()) if id(t) in origin}
    read_shards = {old: shards[new] for old, new in model_name.items() if new in shards}
    tensors = iter_checkpoint_tensors(
        ckpt, read_shards, lambda name: name in model_name and skip(model_name[name])
    )
    return _cut_whole(rename(tensors), shards)


def _cut_whole(tensors, shards: dict[str, Shard]) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors, a sharded parameter's cut to its slice where it comes whole (made by the
    family's renaming from tensors read whole)."""
    for name, tensor in tensors:
        shard = shards.get(name)
        if shard is not None and tensor.shape[shard.dim] == shard.full:
            tensor = shard.take(tensor)
        yield name, tensor


def load_rank_models(
    config: EngineConfig, device: torch.device, tp: TensorParallel | None
) -> LoadedModels:
    """`load_models` for this process's tensor-parallel rank (`tp` None: unsharded). Ranks seed
    alike first: every rank draws the same random numbers (dummy weights of replicated layers,
    and later the synthetic acceptance's coins)."""
    if tp is not None:
        torch.manual_seed(config.seed)
    with building_tensor_parallel(tp):
        return load_models(config, device)


def load_models(config: EngineConfig, device: torch.device) -> LoadedModels:
    model_path = config.model
    if model_path is None:
        from blockdraft.models.gguf_loader import default_model_path

        model_path = default_model_path()
    ckpt = read_checkpoint(model_path, config.load_format)
    architecture = resolve_architecture(ckpt.hf_config)
    target_cfg = architecture.parse_config(ckpt.hf_config)
    check_tensor_parallel_shape(config.tensor_parallel_size, "the target", target_cfg)
    if (config.max_model_len or 0) > target_cfg.max_position_embeddings:
        raise ValueError(
            f"max_model_len {config.max_model_len} exceeds the model's "
            f"max_position_embeddings ({target_cfg.max_position_embeddings})"
        )
    max_model_len = config.max_model_len or min(
        target_cfg.max_position_embeddings, DEFAULT_MAX_MODEL_LEN
    )
    spec = config.speculative_config
    draft_cfg, drafter_class, num_spec, draft_schedule = None, DFlashDrafter, 0, None
    if spec is not None:  # a drafter that does not fit fails here, before any weights load
        draft_cfg, drafter_class = resolve_drafter(read_drafter_checkpoint(spec.model).hf_config)
        draft_cfg.check_fits(target_cfg)
        check_tensor_parallel_shape(config.tensor_parallel_size, "the drafter", draft_cfg.body)
        num_spec = spec.num_speculative_tokens or default_num_drafts(
            draft_cfg.block_size, device.type
        )
        if num_spec > draft_cfg.block_size - 1:
            raise ValueError(
                f"num_speculative_tokens {num_spec} exceeds the drafter's "
                f"block_size - 1 ({draft_cfg.block_size - 1})"
            )
        draft_schedule = DraftSchedule.resolve(
            spec.num_speculative_tokens_by_batch, num_spec, device.type
        )
    lookahead = lookahead_rows(num_spec)
    # RoPE tables cover the block the drafter writes past the last committed token.
    max_positions = max(target_cfg.max_position_embeddings, max_model_len + 2 * lookahead)
    target_cfg = dataclasses.replace(target_cfg, max_position_embeddings=max_positions)

    dtype = config.torch_dtype
    if device.type == "cuda":  # the CPU has no free-memory figure to check against
        with torch.device("meta"), without_random_init():
            need = weight_bytes(architecture.model_class(target_cfg).to(dtype))
        check_weights_fit(need, torch.cuda.mem_get_info(device)[0], device)
    with torch.device(device), default_dtype(dtype), without_random_init():
        model = architecture.model_class(target_cfg).to(dtype)
    if config.load_format == "dummy":
        init_dummy_weights(model)
    else:
        params = dict(model.named_parameters())
        load_weights(
            params,
            rank_checkpoint_tensors(ckpt, model, params),
            str(model_path),
            ignore=lambda name: (
                "rotary_emb" in name
                or (name == "lm_head.weight" and target_cfg.tie_word_embeddings)
            ),
            locate=model.checkpoint_slice,
        )
    tokenizer, eos_token_ids, generation_defaults = (
        ckpt.tokenizer,
        ckpt.eos_token_ids,
        ckpt.generation_defaults,
    )
    del ckpt  # its tensors are copied into the model: freed before the drafter loads
    model.eval().requires_grad_(False)
    fuse_projections(model)
    drafter = None
    if spec is not None:
        drafter = load_drafter(
            spec.model,
            model,
            max_positions,
            dtype,
            device,
            dummy=config.load_format == "dummy",
            cfg=draft_cfg,
            drafter_class=drafter_class,
        )
        apply_token_map(drafter, spec, config.tensor_parallel_size)
        fuse_projections(drafter)
        model.capture_layer_ids = drafter.cfg.target_layer_ids
    return LoadedModels(
        model,
        drafter,
        tokenizer,
        eos_token_ids,
        generation_defaults,
        max_model_len,
        num_spec,
        draft_schedule,
    )


def apply_token_map(drafter: DFlashDrafter, spec: SpeculativeConfig, tp_size: int) -> None:
    """Cuts the drafter's head to the config's token map, if any. "auto" leaves the head whole
    under tensor parallelism (where a map cannot apply) and says so."""
    path = resolve_token_map(spec.token_map, spec.model)
    if path is None:
        return
    if tp_size > 1 and spec.token_map == "auto":
        logger.info("the drafter's token map %s is not used under tensor parallelism", path)
        return
    ids = read_token_map(path, drafter.cfg.body.vocab_size)
    drafter.restrict_vocab(ids)
    logger.info("drafts from %d tokens of %d (token map %s)", ids.numel(),
                drafter.cfg.body.vocab_size, path)  # fmt: skip
