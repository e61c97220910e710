"""Qwen3.5 (dense): a hybrid decoder whose `layer_types` mix Gated DeltaNet (`linear_attention`)
and gated full attention (`full_attention`, every fourth layer in the published models), each
followed by a dense SwiGLU MLP, with offset-weight RMSNorms (`1 + weight`). The MoE families
(`qwen3_5_moe.py`, `qwen3_next.py`) build the same model with their own MLP per layer.

`Qwen3_5ForCausalLM` checkpoints load as they are; `Qwen3_5ForConditionalGeneration` ones load
their language model (`model.language_model.*`) and skip the vision tower and the MTP head.
The linear-attention layers keep per-request states in slots beside the paged KV cache
(`allocate_states`, `state_bytes`); after a verify the engine commits them at the accepted
length (`commit_verified`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from blockdraft.kernels.forward_context import current_kernel_policy
from blockdraft.layers.attention import PagedAttention
from blockdraft.layers.gated_attention import GatedSelfAttention
from blockdraft.layers.gated_deltanet import STATE_POOLS, GatedDeltaNet
from blockdraft.layers.linear import norm_linear, norm_prologue_fits
from blockdraft.layers.mlp import MLP
from blockdraft.layers.norm import OffsetRMSNorm, input_norm
from blockdraft.layers.rotary import RotaryEmbedding
from blockdraft.layers.vocab_parallel import embedding
from blockdraft.models.llama import DecoderLM, MLPFactory, dense_mlp
from blockdraft.models.model_config import MoEConfig, TransformerConfig

logger = logging.getLogger(__name__)

LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass(frozen=True, kw_only=True)  # after TransformerConfig's defaulted fields
class HybridConfig(TransformerConfig):
    layer_types: tuple[str, ...]
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    partial_rotary_factor: float


def text_config(hf: dict) -> dict:
    """A causal LM's config.json, or a multimodal one's `text_config` over its top level."""
    return {**hf, **hf["text_config"]} if isinstance(hf.get("text_config"), dict) else hf


def qwen3_5_config(hf: dict) -> HybridConfig:
    """`Qwen3_5ForCausalLM`'s config.json, or the `text_config` of a
    `Qwen3_5ForConditionalGeneration` one."""
    return hybrid_config(text_config(hf), "qwen3_5")


def hybrid_config(text: dict, architecture: str, moe: MoEConfig | None = None) -> HybridConfig:
    """The hybrid shape in a (text) config.json; `moe`: the sparse layers of the MoE
    families, parsed by their own parsers."""
    base = TransformerConfig.from_hf(text, architecture, qk_norm=True)
    num_layers = base.num_layers
    interval = int(text.get("full_attention_interval", 4))
    layer_types = text.get("layer_types") or [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention"
        for i in range(num_layers)
    ]
    if len(layer_types) != num_layers or any(t not in LAYER_TYPES for t in layer_types):
        raise ValueError(
            f"config.json layer_types must list {num_layers} entries of {', '.join(LAYER_TYPES)}; "
            f"got {layer_types!r}"
        )
    if text.get("attn_output_gate", True) is not True:
        raise ValueError("config.json attn_output_gate must be true: Qwen3.5 gates its attention")
    rope = text.get("rope_parameters") or {}
    try:
        return HybridConfig(
            **{f: getattr(base, f) for f in base.__dataclass_fields__ if f != "moe"},
            moe=moe,
            layer_types=tuple(layer_types),
            linear_num_key_heads=int(text.get("linear_num_key_heads", 16)),
            linear_num_value_heads=int(text.get("linear_num_value_heads", 32)),
            linear_key_head_dim=int(text.get("linear_key_head_dim", 128)),
            linear_value_head_dim=int(text.get("linear_value_head_dim", 128)),
            linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
            partial_rotary_factor=float(
                rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
            ),
        )
    except (TypeError, ValueError) as e:
        raise ValueError(f"config.json has an invalid value: {e}") from None


class HybridDecoderLayer(nn.Module):
    def __init__(
        self, cfg: HybridConfig, layer_type: str, rotary: RotaryEmbedding, mlp: nn.Module
    ) -> None:
        super().__init__()
        self.layer_type = layer_type
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(
                cfg.hidden_size,
                cfg.linear_num_key_heads,
                cfg.linear_num_value_heads,
                cfg.linear_key_head_dim,
                cfg.linear_value_head_dim,
                cfg.linear_conv_kernel_dim,
                cfg.rms_norm_eps,
            )
        else:
            self.self_attn = GatedSelfAttention(
                cfg.hidden_size,
                cfg.num_heads,
                cfg.num_kv_heads,
                cfg.head_dim,
                rotary,
                cfg.rms_norm_eps,
                bias=cfg.attention_bias,
            )
        self.mlp = mlp
        self.input_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden], the previous layer's MLP output (or the input)
        positions: torch.Tensor,  # [num_tokens] int64
        residual: torch.Tensor | None = None,  # [num_tokens, hidden]; None: x is the stream
        stream_out: torch.Tensor | None = None,  # [num_tokens, hidden] view, unit column stride
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (MLP output, residual stream), [num_tokens, hidden]
        """Pre-norm block, its output left unsummed as in `llama.DecoderLayer` (and its input
        stream written to `stream_out` likewise). Where `norm_prologue_fits` (decode's few
        rows), each norm is formed in the loads of the skinny GEMM after it, as in
        `llama.DecoderLayer`: the input norm in the mixer's fused input projection, the
        post-attention norm in a dense MLP's gate_up (a mixture's router and experts both read
        the normed rows: its norm stays a kernel of its own)."""
        linear = self.layer_type == "linear_attention"
        projection = self.linear_attn._in_proj if linear else self.self_attn._qkv
        if self._norm_fuses(x, residual, self.input_layernorm, projection):
            projected, residual = norm_linear(
                self.input_layernorm, x, residual, *projection, stream_out
            )
            if linear:
                h = self.linear_attn.mix_projected(projected)
            else:
                h = self.self_attn.attend(projected, positions)
        else:
            h, residual = input_norm(self.input_layernorm, x, residual, stream_out)
            h = self.linear_attn(h) if linear else self.self_attn(h, positions)
        gate_up = self.mlp._gate_up if isinstance(self.mlp, MLP) else None
        if self._norm_fuses(h, residual, self.post_attention_layernorm, gate_up):
            gate_up, residual = norm_linear(self.post_attention_layernorm, h, residual, *gate_up)
            return self.mlp.down_gate_up(gate_up), residual
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual

    @staticmethod
    def _norm_fuses(
        x: torch.Tensor,  # [num_tokens, hidden]
        residual: torch.Tensor | None,  # [num_tokens, hidden]
        norm: OffsetRMSNorm,
        projection: tuple[torch.Tensor, torch.Tensor | None] | None,  # fused (weight, bias)
    ) -> bool:
        return projection is not None and norm_prologue_fits(
            x, residual, (norm.weight,), *projection
        )


class HybridDecoderModel(nn.Module):
    def __init__(self, cfg: HybridConfig, make_mlp: MLPFactory = dense_mlp) -> None:
        super().__init__()
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        rotary = RotaryEmbedding(
            cfg.head_dim,
            cfg.max_position_embeddings,
            cfg.rope_theta,
            cfg.rope_scaling,
            partial_rotary_factor=cfg.partial_rotary_factor,
        )
        self.layers = nn.ModuleList(
            HybridDecoderLayer(cfg, t, rotary, make_mlp(cfg, i))
            for i, t in enumerate(cfg.layer_types)
        )
        self.norm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3_5LM(DecoderLM):
    """`DecoderLM` (forward with DFlash feature capture, logits) over hybrid layers; `make_mlp`
    builds each layer's MLP (the MoE families pass their own)."""

    model_class = HybridDecoderModel
    # Every linear layer's state pools stacked, by name, and the views of them each layer was
    # given (`allocate_states`); None: pools of a layer's own.
    _stacked_states: dict[str, torch.Tensor] | None = None
    _stacked_views: list[tuple[GatedDeltaNet, dict[str, torch.Tensor]]] | None = None

    @property
    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers if hasattr(layer, "self_attn")]

    @property
    def linear_layers(self) -> list[GatedDeltaNet]:
        return [layer.linear_attn for layer in self.model.layers if hasattr(layer, "linear_attn")]

    def state_bytes(self, dtype: torch.dtype, max_verify_len: int) -> int:
        """Bytes of one request's state slot over all linear-attention layers."""
        return sum(layer.state_bytes(dtype, max_verify_len) for layer in self.linear_layers)

    def allocate_states(
        self, num_slots: int, max_verify_len: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        """Each linear-attention layer's state pools, as views of one tensor per pool
        stacking every layer's (they all have the same shapes): the commit after a verify is
        then one launch for every layer (`commit_verified`), not one a layer."""
        layers = self.linear_layers
        shapes = [layer.state_shapes(num_slots, max_verify_len, dtype) for layer in layers]
        self._stacked_states = self._stacked_views = None
        if not layers or any(s != shapes[0] for s in shapes):
            for layer in layers:
                layer.allocate_states(num_slots, max_verify_len, dtype, device)
            return
        stacked = {name: torch.zeros((len(layers), *shape), dtype=dt, device=device)
                   for name, (shape, dt) in shapes[0].items()}  # fmt: skip
        views = [(layer, {name: pool[i] for name, pool in stacked.items()})
                 for i, layer in enumerate(layers)]  # fmt: skip
        for layer, pools in views:
            layer.allocate_states(num_slots, max_verify_len, dtype, device, pools)
        self._stacked_states, self._stacked_views = stacked, views

    def commit_verified(
        self,
        slots: torch.Tensor,  # [V] int64
        lengths: torch.Tensor,  # [V] int64 rows of each verify block to keep
    ) -> None:
        """Every linear-attention layer's state of the verified sequences, at the accepted
        length: with the fused commit kernel (`KernelPolicy.fuse_gated_deltanet_verify`) and
        stacked pools, one launch for all layers; else `GatedDeltaNet.commit_verified` a
        layer."""
        layers = self.linear_layers
        fused = None
        if current_kernel_policy().fuse_gated_deltanet_verify and self._stacked_states is not None:
            fused = layers[0]._fused_commit(slots.device)
        if fused is None or not self._states_stacked():
            for layer in layers:
                layer.commit_verified(slots, lengths)
            return
        stacked = self._stacked_states
        fused(layers[0].num_k_heads, *(stacked[name] for name in STATE_POOLS), slots, lengths)

    def _states_stacked(self) -> bool:
        """Whether every layer still holds the views of the stacked pools it was given (a pool
        replaced since takes the per-layer commits). By identity: each verify's eager commit
        asks, and making a view per layer and pool to compare addresses took ~0.8 ms of host
        time at 48 layers."""
        views = self._stacked_views
        return views is not None and all(
            getattr(layer, name) is view for layer, pools in views for name, view in pools.items()
        )

    @staticmethod
    def checkpoint_tensors(
        tensors: Iterable[tuple[str, torch.Tensor]],
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """A checkpoint's tensors under this model's names: the language model of a multimodal
        checkpoint renamed, its vision tower and the MTP head (multi-token prediction, which
        speculation here does not use) skipped."""
        skipped = 0
        for name, tensor in tensors:
            if name.startswith(("model.visual.", "mtp.")):
                skipped += 1
                continue
            yield name.replace("model.language_model.", "model.", 1), tensor
        if skipped:
            logger.info("skipped %d vision-tower / MTP tensors of the checkpoint", skipped)
