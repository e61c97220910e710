"""The DFlash drafter: a few Qwen3 decoder layers fed with the target's hidden states.

Context rows (the committed tokens' target features, fused by `fc` and `hidden_norm`) enter
every layer only as extra keys and values, written once into the drafter's own paged cache by
`write_context`. The block `[anchor, MASK x N]` then runs through the layers with non-causal
attention (causal and windowed on sliding layers) and sees the context plus itself.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from blockdraft.distributed.tensor_parallel import current_tensor_parallel
from blockdraft.kernels.select import PerDevice, get_store_kv_backend
from blockdraft.layers.attention import PagedAttention
from blockdraft.layers.linear import linear
from blockdraft.layers.norm import RMSNorm, final_norm
from blockdraft.layers.rotary import RotaryEmbedding
from blockdraft.layers.vocab_parallel import embedding, gather_logits, lm_head
from blockdraft.models.draft_vocab import draft_token_ids, scatter_draft_logits
from blockdraft.models.llama import DecoderLayer, DecoderLM, qwen3_config
from blockdraft.models.model_config import TransformerConfig


def default_target_layer_ids(num_target_layers: int, num_features: int) -> list[int]:
    if num_features == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_features - 1)) for i in range(num_features)]


# Fields some published drafters set that change the drafter's computation in ways this one
# does not implement: (field, the value that needs no support, what it means).
UNSUPPORTED_FIELDS = (
    ("attention_sink_bias", None, "attention sinks"),
    # windowed layers given other than by layer_types / sliding_window (with swa_window_size)
    ("use_swa", None, "sliding-window attention by use_swa / swa_window_size"),
)


def check_unsupported_fields(value) -> None:  # value(name, default) reads the drafter config
    """A ValueError naming the first config field this engine cannot honour."""
    for name, harmless, meaning in UNSUPPORTED_FIELDS:
        if value(name, harmless) not in (harmless, False, 0):
            raise ValueError(
                f"drafter config sets {name}={value(name)!r} ({meaning}): not supported"
            )
    if value("is_neox_style", True) is False:
        raise ValueError(
            "drafter config sets is_neox_style=false (interleaved RoPE): only the "
            "rotate-half (NeoX) layout is supported"
        )


@dataclass(frozen=True)
class DFlashConfig:
    architecture: ClassVar[str] = "DFlashDraftModel"  # config.json's `architectures` entry

    body: TransformerConfig  # the draft layers' shape (Qwen3 with q/k norms)
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int | None  # None: not recorded (formats that list the layer ids only)
    layer_causal: tuple[bool, ...]
    layer_window: tuple[int | None, ...]
    input_embedding_scale: float
    output_multiplier: float
    final_logit_softcapping: float | None
    # A reduced draft vocabulary (vLLM speculators, llama.cpp `d2t`): the drafter's own head
    # scores this many target tokens, whose ids the checkpoint's `d2t` lists. None: all of them.
    draft_vocab_size: int | None = None

    @classmethod
    def from_hf(cls, hf: dict) -> DFlashConfig:
        archs = hf.get("architectures") or []
        if cls.architecture not in archs:
            raise ValueError(
                f"drafter config.json architectures is {archs!r}; expected [{cls.architecture!r}]"
            )
        dflash = hf.get("dflash_config") or {}

        def value(name: str, default: object = None) -> object:
            return dflash.get(name, hf.get(name, default))

        if value("sample_from_anchor", False):
            raise ValueError(
                "this drafter samples from the anchor (DSpark layout, sample_from_anchor=true); "
                "only DFlash drafters, whose anchor is the bonus token, are supported"
            )
        check_unsupported_fields(value)
        body = qwen3_config(hf)
        target_hidden = value("target_hidden_size")
        if target_hidden is not None and int(target_hidden) != body.hidden_size:
            raise ValueError(
                f"drafter config sets target_hidden_size={target_hidden} unlike its hidden_size "
                f"{body.hidden_size}: not supported"
            )
        if value("mask_token_id") is None:
            raise ValueError("drafter config has no mask_token_id (in dflash_config)")
        num_target_layers = value("num_target_layers")
        layer_ids = value("target_layer_ids")
        if layer_ids is None:
            if num_target_layers is None:
                raise ValueError(
                    "drafter config has neither target_layer_ids nor num_target_layers"
                )
            layer_ids = default_target_layer_ids(int(num_target_layers), body.num_layers)
        draft_vocab = value("draft_vocab_size")
        if draft_vocab is not None and not 0 < int(draft_vocab) <= body.vocab_size:
            raise ValueError(
                f"draft_vocab_size {draft_vocab} must be in 1..vocab_size ({body.vocab_size})"
            )
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
            num_target_layers=None if num_target_layers is None else int(num_target_layers),
            layer_causal=tuple(causal),
            layer_window=tuple(windows),
            input_embedding_scale=float(value("input_embedding_scale", 1.0) or 1.0),
            output_multiplier=float(value("output_multiplier", 1.0) or 1.0),
            final_logit_softcapping=float(softcap) if softcap else None,
            draft_vocab_size=(None if draft_vocab in (None, body.vocab_size) else int(draft_vocab)),
            **cls._extra_fields(value, body),
        )

    @classmethod
    def _extra_fields(cls, value, body: TransformerConfig) -> dict:
        """A subclass's own fields, read with `value(name, default)`."""
        return {}

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
    """Under tensor parallelism the draft layers shard as the target's do (their heads and
    intermediate features split, and their K/V cache with them); `fc` and the norms, whose
    inputs are the target's features (the same on every rank), are replicated."""

    config_class: ClassVar[type[DFlashConfig]] = DFlashConfig

    def __init__(self, cfg: DFlashConfig, target: DecoderLM, max_positions: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = current_tensor_parallel()
        body = dataclasses.replace(cfg.body, max_position_embeddings=max_positions)
        rotary = RotaryEmbedding(body.head_dim, max_positions, body.rope_theta, body.rope_scaling)
        self.layers = nn.ModuleList(
            self.make_layer(body, rotary, causal, window)
            for causal, window in zip(cfg.layer_causal, cfg.layer_window, strict=True)
        )
        hidden = body.hidden_size
        self.fc = nn.Linear(len(cfg.target_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, body.rms_norm_eps)
        self.norm = RMSNorm(hidden, body.rms_norm_eps)
        # Shared with the target (and frozen) unless the checkpoint ships its own.
        self.embed_tokens = target.model.embed_tokens
        self.lm_head = target.lm_head
        # A reduced draft vocabulary always comes with its own head, over those tokens only.
        draft_vocab = cfg.draft_vocab_size
        if draft_vocab is not None:
            self.lm_head = lm_head(hidden, draft_vocab)
        self.register_buffer(
            "draft_token_ids",  # [D] int64, the target id of each draft-vocabulary row
            None if draft_vocab is None else torch.arange(draft_vocab),
        )
        # The kernel the layers use (unless the RoPE kernel stores: fuse_kv_store_into_rope).
        self._store_kv = PerDevice(get_store_kv_backend)

    def make_layer(
        self, body: TransformerConfig, rotary: RotaryEmbedding, causal: bool, window: int | None
    ) -> nn.Module:
        return DecoderLayer(body, rotary, causal, window)

    @staticmethod
    def checkpoint_name(name: str) -> str:
        """The parameter a checkpoint tensor fills: published drafters may nest the fusion
        under `encoder.` (`encoder.fc.weight`)."""
        return name.removeprefix("encoder.")

    @staticmethod
    def saved_name(name: str) -> str:
        """The checkpoint tensor a parameter is written as (training saves z-lab's names)."""
        return name

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

    def restrict_vocab(self, token_ids: torch.Tensor) -> None:  # [D] int64, ascending
        """Scores only these target tokens from now on (a token map): the head becomes a copy
        of those rows of the current one. Not under tensor parallelism (each rank holds another
        slice of the target's head), nor over a drafter that has its own reduced vocabulary."""
        if self.tp is not None:
            raise ValueError("a token map is not supported with tensor_parallel_size > 1")
        if self.cfg.draft_vocab_size is not None:
            raise ValueError(
                f"the drafter already scores a reduced vocabulary (draft_vocab_size "
                f"{self.cfg.draft_vocab_size}): a token map cannot apply"
            )
        weight = self.lm_head.weight
        ids = token_ids.to(weight.device)
        with torch.device(weight.device):
            head = lm_head(self.cfg.body.hidden_size, ids.numel()).to(weight.dtype)
        head.weight.data.copy_(weight[ids])
        self.lm_head = head.requires_grad_(False)
        self.draft_token_ids = ids
        self.cfg = dataclasses.replace(self.cfg, draft_vocab_size=ids.numel())

    def compute_logits(
        self,
        hidden: torch.Tensor,  # [R, hidden]
        float32: bool = True,
    ) -> torch.Tensor:  # [R, V] float32; float32=False: the head's dtype where nothing follows
        """float32=False leaves plain head logits in the head's dtype (a ranking, DFlash2's
        top-K, needs no float32 copy of [R, V]: its values cast exactly); logits a multiplier,
        a cap, a gather or a scatter changes still come back in float32."""
        # Through the skinny GEMM on a GPU, as the target's head: the block's <= 16 rows read
        # 1.24 GB on Qwen3-8B shapes in 279 us against cuBLAS's 289 (gemv_bench, M = 16).
        logits = linear(hidden, self.lm_head.weight, self.lm_head.bias)
        if (
            not float32
            and self.tp is None
            and self.cfg.output_multiplier == 1.0
            and not self.cfg.final_logit_softcapping
            and self.draft_token_ids is None
        ):
            return logits  # nothing below would change them but their dtype
        if self.tp is not None:  # every rank's vocabulary slice, on every rank
            head_rows = self.cfg.draft_vocab_size or self.cfg.body.vocab_size
            logits = gather_logits(self.tp, logits, head_rows)
        logits = logits.float()
        if self.cfg.output_multiplier != 1.0:  # a pass over [R, V] floats: skip when it is 1
            logits = logits * self.cfg.output_multiplier
        cap = self.cfg.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        if self.draft_token_ids is not None:
            logits = scatter_draft_logits(logits, self.draft_token_ids, self.cfg.body.vocab_size)
        return logits


def load_drafter(
    path: str,
    target: DecoderLM,
    max_positions: int,
    dtype: torch.dtype,
    device: torch.device,
    dummy: bool = False,
    cfg: DFlashConfig | None = None,
    drafter_class: type[DFlashDrafter] = DFlashDrafter,
) -> DFlashDrafter:
    """Builds the drafter for `target` from a checkpoint (a z-lab or vLLM speculators directory,
    or a llama.cpp GGUF; see `drafter_checkpoint`) or random weights; `cfg` is the checkpoint's
    config when the caller has already read it (parsed by the config class of `drafter_class`,
    the family the registry names)."""
    from blockdraft.models.drafter_checkpoint import read_drafter_checkpoint
    from blockdraft.models.loader import (
        init_dummy_weights,
        load_weights,
        param_shards,
        shard_tensors,
        without_random_init,
    )

    ckpt = read_drafter_checkpoint(path)
    if cfg is None:
        cfg = drafter_class.config_class.from_hf(ckpt.hf_config)
    cfg.check_fits(target.cfg)
    with torch.device(device), without_random_init():
        drafter = drafter_class(cfg, target, max_positions).to(dtype)
    # The target's, unless the checkpoint ships its own (a reduced vocabulary always does).
    shared = ("embed_tokens.", "lm_head.") if cfg.draft_vocab_size is None else ("embed_tokens.",)
    if dummy:
        for name, module in drafter.named_children():
            if f"{name}." not in shared:
                init_dummy_weights(module)
    else:
        tensors = {drafter.checkpoint_name(name): t for name, t in ckpt.read_tensors()}
        mask_embedding = [name for name in tensors if "mask_emb" in name]
        if mask_embedding:
            raise ValueError(
                f"{path}: the drafter ships its own mask embedding ({mask_embedding[0]!r}): not "
                "supported (the mask token is embedded with the target's embedding)"
            )
        _load_draft_vocab(drafter, tensors.pop("d2t", None), tensors.pop("t2d", None), path)
        vocab, hidden = cfg.body.vocab_size, cfg.body.hidden_size
        with torch.device(device):
            if "embed_tokens.weight" in tensors:  # the drafter ships its own embedding
                drafter.embed_tokens = embedding(vocab, hidden).to(dtype)
            if "lm_head.weight" in tensors and cfg.draft_vocab_size is None:  # ... or its head
                drafter.lm_head = lm_head(hidden, vocab).to(dtype)
        params = {
            name: p
            for name, p in drafter.named_parameters()
            if not name.startswith(shared) or name in tensors
        }
        sharded = shard_tensors(tensors.items(), param_shards(params), path)
        load_weights(params, sharded, path, ignore=lambda name: "rotary_emb" in name)
    drafter.eval().requires_grad_(False)
    return drafter


def _load_draft_vocab(
    drafter: DFlashDrafter,
    d2t: torch.Tensor | None,  # [D] offsets to the target ids, if the checkpoint has them
    t2d: torch.Tensor | None,  # [V] mask of the target tokens with a draft row
    path: str,
) -> None:
    vocab, draft_vocab = drafter.cfg.body.vocab_size, drafter.cfg.draft_vocab_size
    if draft_vocab is None:
        # Full-vocabulary checkpoints may still carry identity maps, which change nothing.
        if d2t is not None and d2t.to(torch.int64).any():
            raise ValueError(f"{path}: d2t remaps tokens, but draft_vocab_size is vocab_size")
        return
    if d2t is None:
        raise ValueError(
            f"{path}: draft_vocab_size {draft_vocab} < vocab_size {vocab}, but the checkpoint "
            "has no d2t tensor mapping the draft vocabulary to target ids"
        )
    if d2t.shape != (draft_vocab,):
        raise ValueError(f"{path}: d2t has shape {tuple(d2t.shape)}, expected ({draft_vocab},)")
    try:
        ids = draft_token_ids(d2t, t2d, vocab)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    drafter.draft_token_ids.copy_(ids)
