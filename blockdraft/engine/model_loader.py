"""Builds an engine's models from its config: the target (checkpoint or dummy weights) and, when
speculating, the DFlash drafter on top of it, with the lengths and draft counts they imply. A
drafter that does not fit the target fails before any weights load."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from blockdraft.config import EngineConfig
from blockdraft.layers.linear import fuse_projections
from blockdraft.models.dflash_drafter import DFlashConfig, DFlashDrafter, load_drafter
from blockdraft.models.llama import DecoderLM
from blockdraft.models.loader import (
    init_dummy_weights,
    iter_checkpoint_tensors,
    load_weights,
    read_checkpoint,
    read_json,
)
from blockdraft.models.registry import resolve_architecture
from blockdraft.spec_decode.draft_schedule import DraftSchedule, default_num_drafts
from blockdraft.tokenizer import Tokenizer

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


def load_models(config: EngineConfig, device: torch.device) -> LoadedModels:
    model_path = config.model
    if model_path is None:
        from blockdraft.models.gguf_loader import default_model_path

        model_path = default_model_path()
    ckpt = read_checkpoint(model_path, config.load_format)
    architecture = resolve_architecture(ckpt.hf_config)
    target_cfg = architecture.parse_config(ckpt.hf_config)
    if (config.max_model_len or 0) > target_cfg.max_position_embeddings:
        raise ValueError(
            f"max_model_len {config.max_model_len} exceeds the model's "
            f"max_position_embeddings ({target_cfg.max_position_embeddings})"
        )
    max_model_len = config.max_model_len or min(
        target_cfg.max_position_embeddings, DEFAULT_MAX_MODEL_LEN
    )
    spec = config.speculative_config
    draft_cfg, num_spec, draft_schedule = None, 0, None
    if spec is not None:  # a drafter that does not fit fails here, before any weights load
        draft_cfg = DFlashConfig.from_hf(read_json(Path(spec.model) / "config.json"))
        draft_cfg.check_fits(target_cfg)
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
    with torch.device(device):
        model = architecture.model_class(target_cfg).to(dtype)
    if config.load_format == "dummy":
        init_dummy_weights(model)
    else:
        tensors = iter_checkpoint_tensors(ckpt)
        # A family may rename or skip checkpoint tensors (a multimodal checkpoint's LM).
        rename = getattr(model, "checkpoint_tensors", None)
        load_weights(
            dict(model.named_parameters()),
            tensors if rename is None else rename(tensors),
            str(model_path),
            ignore=lambda name: (
                "rotary_emb" in name
                or (name == "lm_head.weight" and target_cfg.tie_word_embeddings)
            ),
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
        )
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
