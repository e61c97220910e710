"""The Llama family: Llama and Qwen3 dense, decoder-only transformers over flat token batches.

Pre-norm layers of `SelfAttention` (q/k norms for Qwen3) and a dense SwiGLU `MLP`. Parameter
names follow Hugging Face (`model.layers.{i}.self_attn.q_proj.weight`, ...) so that checkpoints
load without renaming. The DFlash drafter reuses `DecoderLayer` with non-causal attention.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from blockdraft.distributed.tensor_parallel import current_tensor_parallel
from blockdraft.kernels.forward_context import current_attention_metadata
from blockdraft.layers.attention import PagedAttention
from blockdraft.layers.linear import linear, norm_linear, norm_prologue_fits
from blockdraft.layers.mlp import MLP
from blockdraft.layers.norm import RMSNorm, final_norm, input_norm
from blockdraft.layers.rotary import RotaryEmbedding
from blockdraft.layers.self_attention import SelfAttention
from blockdraft.layers.vocab_parallel import embedding, gather_logits, lm_head
from blockdraft.models.model_config import TransformerConfig


def llama_config(hf: dict) -> TransformerConfig:
    """`LlamaForCausalLM`'s config.json."""
    return TransformerConfig.from_hf(hf, "llama", qk_norm=False)


def qwen3_config(hf: dict) -> TransformerConfig:
    """`Qwen3ForCausalLM`'s config.json: Llama with per-head q/k RMSNorm before RoPE."""
    return TransformerConfig.from_hf(hf, "qwen3", qk_norm=True)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: TransformerConfig,
        rotary: RotaryEmbedding,
        causal: bool = True,
        window: int | None = None,
        mlp: nn.Module | None = None,  # None: the dense MLP of cfg.intermediate_size
    ) -> None:
        super().__init__()
        self.self_attn = SelfAttention(
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            rotary,
            bias=cfg.attention_bias,
            qk_norm_eps=cfg.rms_norm_eps if cfg.qk_norm else None,
            causal=causal,
            window=window,
        )
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size) if mlp is None else mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden], the previous layer's MLP output (or the input)
        positions: torch.Tensor,  # [num_tokens] int64
        residual: torch.Tensor | None = None,  # [num_tokens, hidden]; None: x is the stream
        stream_out: torch.Tensor | None = None,  # [num_tokens, hidden] view, unit column stride
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (MLP output, residual stream), [num_tokens, hidden]
        """Pre-norm block whose output `mlp_out + residual` is left unsummed: each residual add
        is fused into the norm after it (one kernel on the Triton path), the last one into the
        next layer's input norm or the final norm; `stream_out` gets this layer's input stream
        (the previous layer's output, a DFlash target feature) from the input norm's add."""
        if self._norms_fuse(x, residual):
            # Each norm formed in the loads of the skinny GEMM after it: same outputs and stream.
            attn, mlp = self.self_attn, self.mlp
            qkv, residual = norm_linear(self.input_layernorm, x, residual, *attn._qkv, stream_out)
            h = attn.attend(qkv, positions)
            gate_up, residual = norm_linear(
                self.post_attention_layernorm, h, residual, *mlp._gate_up
            )
            return mlp.down_gate_up(gate_up), residual
        h, residual = input_norm(self.input_layernorm, x, residual, stream_out)
        h = self.self_attn(h, positions)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual

    def _norms_fuse(self, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
        """Whether both norms can go into the skinny q/k/v and gate/up GEMMs (a dense MLP,
        fused projections, `norm_prologue_fits`)."""
        if not isinstance(self.mlp, MLP):
            return False
        qkv, gate_up = self.self_attn._qkv, self.mlp._gate_up
        if qkv is None or gate_up is None:
            return False
        norms = self.input_layernorm.weight, self.post_attention_layernorm.weight
        return norm_prologue_fits(x, residual, norms, *qkv, *gate_up)


# Builds layer i's MLP (cfg, i) -> module of [num_tokens, hidden] -> [num_tokens, hidden].
MLPFactory = Callable[[TransformerConfig, int], nn.Module]


def dense_mlp(cfg: TransformerConfig, layer: int) -> nn.Module:
    return MLP(cfg.hidden_size, cfg.intermediate_size)


class DecoderModel(nn.Module):
    def __init__(self, cfg: TransformerConfig, make_mlp: MLPFactory = dense_mlp) -> None:
        super().__init__()
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        rotary = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, rotary, mlp=make_mlp(cfg, i)) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DecoderLM(nn.Module):
    """Target model. `forward` also returns the hidden states after the decoder layers listed in
    `capture_layer_ids` (DFlash target features), concatenated, taken in the same pass.
    `make_mlp` builds each layer's MLP (families with sparse layers pass their own);
    `model_class` the layer stack (families with other layers set their own)."""

    model_class: type[nn.Module] = DecoderModel

    def __init__(self, cfg: TransformerConfig, make_mlp: MLPFactory = dense_mlp) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = self.model_class(cfg, make_mlp)
        self.lm_head = lm_head(cfg.hidden_size, cfg.vocab_size)
        self.tp = current_tensor_parallel()  # None: one process holds the whole model
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.capture_layer_ids: tuple[int, ...] = ()

    @property
    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns (final hidden [num_tokens, hidden], features [num_tokens, K*hidden] or None)."""
        x, residual = self.model.embed_tokens(input_ids), None
        meta = current_attention_metadata()
        after_layer = None if meta is None else meta.after_layer
        hidden, ids = self.cfg.hidden_size, self.capture_layer_ids
        # Each captured layer's output lands in its slice of `features` from the next layer's
        # input norm, which sums it anyway (on the decode path inside the skinny GEMM): no add
        # and no concatenation of its own.
        features = x.new_empty(x.shape[0], len(ids) * hidden) if ids else None
        stream_out = None
        for i, layer in enumerate(self.model.layers):
            x, residual = layer(x, positions, residual, stream_out)
            if after_layer is not None:
                after_layer(i)
            stream_out = None
            if i in ids:
                j = ids.index(i)
                stream_out = features[:, j * hidden : (j + 1) * hidden]
        x = final_norm(self.model.norm, x, residual)
        if stream_out is not None:
            # The last layer is captured: transformers' hidden_states tuple (what drafters are
            # trained on) ends with the final-normed output, not the last layer's raw one.
            stream_out.copy_(x)
        for j, i in enumerate(ids):  # a layer listed twice: its later slices copy the first
            first = ids.index(i)
            if first != j:
                features[:, j * hidden : (j + 1) * hidden] = features[
                    :, first * hidden : (first + 1) * hidden
                ]
        return x, features

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [R, hidden] -> [R, V] fp32
        logits = linear(hidden, self.lm_head.weight, self.lm_head.bias)
        if self.tp is not None:  # every rank's vocabulary slice, on every rank
            logits = gather_logits(self.tp, logits, self.cfg.vocab_size)
        return logits.float()

    def checkpoint_slice(self, name: str) -> tuple[str, tuple] | None:
        """Where a checkpoint tensor that fills part of a parameter goes: (parameter name,
        index into it). None: the tensor is the whole parameter of its own name."""
        return None
