"""The DFlash drafter: a few Qwen3 decoder layers fed with the target's hidden states.

Context rows (the committed tokens' target features, fused by `fc` and `hidden_norm`) enter
every layer only as extra keys and values, written once into the drafter's own paged cache by
`write_context`. The block `[anchor, MASK x N]` then runs through the layers with non-causal
attention (causal and windowed on sliding layers) and sees the context plus itself.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from blockdraft.kernels.select import PerDevice, get_store_kv_backend
from blockdraft.layers.attention import PagedAttention
from blockdraft.layers.linear import linear
from blockdraft.layers.norm import RMSNorm, final_norm
from blockdraft.layers.rotary import RotaryEmbedding
from blockdraft.models.llama import DecoderLayer, DecoderLM, qwen3_config
from blockdraft.models.model_config import TransformerConfig


def default_target_layer_ids(num_target_layers: int, num_features: int) -> list[int]:
    if num_features == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_features - 1)) for i in range(num_features)]


@dataclass(frozen=True)
class DFlashConfig:
    body: TransformerConfig  # the draft layers' shape (Qwen3 with q/k norms)
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    layer_causal: tuple[bool, ...]
    layer_window: tuple[int | None, ...]
    input_embedding_scale: float
    output_multiplier: float
    final_logit_softcapping: float | None

    @classmethod
    def from_hf(cls, hf: dict) -> DFlashConfig:
        archs = hf.get("architectures") or []
        if "DFlashDraftModel" not in archs:
            raise ValueError(
                f"drafter config.json architectures is {archs!r}; expected ['DFlashDraftModel']"
            )
        dflash = hf.get("dflash_config") or {}

        def value(name: str, default: object = None) -> object:
            return dflash.get(name, hf.get(name, default))

        if value("sample_from_anchor", False):
            raise ValueError(
                "this drafter samples from the anchor (DSpark layout, sample_from_anchor=true); "
                "only DFlash drafters, whose anchor is the bonus token, are supported"
            )
        body = qwen3_config(hf)
        if value("mask_token_id") is None:
            raise ValueError("drafter config has no mask_token_id (in dflash_config)")
        num_target_layers = value("num_target_layers")
        if num_target_layers is None:
            raise ValueError("drafter config has no num_target_layers")
        layer_ids = value("target_layer_ids")
        if layer_ids is None:
            layer_ids = default_target_layer_ids(int(num_target_layers), body.num_layers)
        layer_types = hf.get("layer_types") or ["full_attention"] * body.num_layers
        if len(layer_types) != body.num_layers:
            raise ValueError(
                f"layer_types has {len(layer_types)} entries for {body.num_layers} layers"
            )
        causal_override = value("causal", hf.get("is_causal"))
        # Qwen3Config drops the window when `use_sliding_window` is false (z-lab's drafter
        # would then run its sliding layers unwindowed, and transformers builds no cache for
        # them): such a config is refused rather than run with a window it does not have.
        window = hf.get("sliding_window") if hf.get("use_sliding_window") is not False else None
        causal, windows = [], []
        for t in layer_types:
            if t not in ("full_attention", "sliding_attention"):
                raise ValueError(f"unsupported drafter layer type {t!r}")
            sliding = t == "sliding_attention"
            if sliding and not window:
                raise ValueError(
                    "sliding_attention layers need a positive sliding_window (and "
                    "use_sliding_window not false)"
                )
            causal.append(sliding if causal_override is None else bool(causal_override))
            windows.append(int(window) if sliding else None)
        softcap = value("final_logit_softcapping")
        return cls(
            body=body,
            block_size=int(value("block_size", 16)),
            mask_token_id=int(value("mask_token_id")),
            target_layer_ids=tuple(int(i) for i in layer_ids),
            num_target_layers=int(num_target_layers),
            layer_causal=tuple(causal),
            layer_window=tuple(windows),
            input_embedding_scale=float(value("input_embedding_scale", 1.0) or 1.0),
            output_multiplier=float(value("output_multiplier", 1.0) or 1.0),
            final_logit_softcapping=float(softcap) if softcap else None,
        )

    def check_fits(self, target: TransformerConfig) -> None:
        if self.body.hidden_size != target.hidden_size:
            raise ValueError(
                f"drafter hidden_size {self.body.hidden_size} does not match the target's "
                f"{target.hidden_size}"
            )
        if self.body.vocab_size != target.vocab_size:
            raise ValueError(
                f"drafter vocab_size {self.body.vocab_size} does not match the target's "
                f"{target.vocab_size}"
            )
        bad = [i for i in self.target_layer_ids if not 0 <= i < target.num_layers]
        if bad:
            raise ValueError(
                f"drafter target_layer_ids {bad} are out of range for a target with "
                f"{target.num_layers} layers"
            )
        if not 0 <= self.mask_token_id < target.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is outside the vocabulary")


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DFlashConfig, target: DecoderLM, max_positions: int) -> None:
        super().__init__()
        self.cfg = cfg
        body = dataclasses.replace(cfg.body, max_position_embeddings=max_positions)
        rotary = RotaryEmbedding(body.head_dim, max_positions, body.rope_theta, body.rope_scaling)
        self.layers = nn.ModuleList(
            DecoderLayer(body, rotary, causal, window)
            for causal, window in zip(cfg.layer_causal, cfg.layer_window, strict=True)
        )
        hidden = body.hidden_size
        self.fc = nn.Linear(len(cfg.target_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, body.rms_norm_eps)
        self.norm = RMSNorm(hidden, body.rms_norm_eps)
        # Shared with the target (and frozen) unless the checkpoint ships its own.
        self.embed_tokens = target.model.embed_tokens
        self.lm_head = target.lm_head
        # The kernel the layers use (unless the RoPE kernel stores: fuse_kv_store_into_rope).
        self._store_kv = PerDevice(get_store_kv_backend)

    @property
    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.layers]

    def write_context(
        self,
        features: torch.Tensor,  # [num_ctx, K * hidden] target features of committed tokens
        positions: torch.Tensor,  # [num_ctx] int64
        slot_mapping: torch.Tensor,  # [num_ctx] int64
    ) -> None:
        ctx = self.hidden_norm(self.fc(features))
        store_kv = self._store_kv(features.device)
        for layer in self.layers:
            layer.self_attn.write_kv(ctx, positions, slot_mapping, store_kv)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64, blocks [anchor, MASK x N]
        positions: torch.Tensor,  # [num_tokens] int64
    ) -> torch.Tensor:  # [num_tokens, hidden]
        x = self.embed_tokens(input_ids)
        if self.cfg.input_embedding_scale != 1.0:
            x = x * self.cfg.input_embedding_scale
        residual = None
        for layer in self.layers:
            x, residual = layer(x, positions, residual)
        return final_norm(self.norm, x, residual)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [R, hidden] -> [R, V] fp32
        # Through the skinny GEMM on a GPU, as the target's head: the block's <= 16 rows read
        # 1.24 GB on Qwen3-8B shapes in 279 us against cuBLAS's 289 (gemv_bench, M = 16).
        logits = linear(hidden, self.lm_head.weight, self.lm_head.bias).float()
        if self.cfg.output_multiplier != 1.0:  # a pass over [R, V] floats: skip when it is 1
            logits = logits * self.cfg.output_multiplier
        cap = self.cfg.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits


def load_drafter(
    path: str,
    target: DecoderLM,
    max_positions: int,
    dtype: torch.dtype,
    device: torch.device,
    dummy: bool = False,
    cfg: DFlashConfig | None = None,
) -> DFlashDrafter:
    """Builds the drafter for `target` from a z-lab checkpoint directory (or random weights);
    `cfg` is the directory's config when the caller has already read it."""
    from blockdraft.models.loader import (
        init_dummy_weights,
        iter_checkpoint_tensors,
        load_weights,
        read_checkpoint,
        read_json,
    )

    if cfg is None:
        cfg = DFlashConfig.from_hf(read_json(Path(path) / "config.json"))
    cfg.check_fits(target.cfg)
    with torch.device(device):
        drafter = DFlashDrafter(cfg, target, max_positions).to(dtype)
    shared = ("embed_tokens.", "lm_head.")
    if dummy:
        for module in (drafter.layers, drafter.fc, drafter.hidden_norm, drafter.norm):
            init_dummy_weights(module)
    else:
        tensors = dict(iter_checkpoint_tensors(read_checkpoint(path)))
        if "embed_tokens.weight" in tensors:  # the drafter ships its own embedding
            with torch.device(device):
                drafter.embed_tokens = nn.Embedding(*tensors["embed_tokens.weight"].shape).to(dtype)
        if "lm_head.weight" in tensors:  # ... or its own LM head
            vocab, hidden = tensors["lm_head.weight"].shape
            with torch.device(device):
                drafter.lm_head = nn.Linear(hidden, vocab, bias=False).to(dtype)
        params = {
            name: p
            for name, p in drafter.named_parameters()
            if not name.startswith(shared) or name in tensors
        }
        load_weights(params, tensors.items(), path, ignore=lambda name: "rotary_emb" in name)
    drafter.eval().requires_grad_(False)
    return drafter
