"""Llama / Qwen3 decoder-only transformer over flat token batches.

Parameter names follow Hugging Face (`model.layers.{i}.self_attn.q_proj.weight`, ...) so that
checkpoints load without renaming. The DFlash drafter reuses `DecoderLayer` with non-causal
attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from blockdraft.kernels.rope import silu_mul_torch
from blockdraft.kernels.select import (
    PerDevice,
    StoreKVFn,
    get_linear_backend,
    get_silu_mul_backend,
    needs_autograd,
)
from blockdraft.layers.attention import PagedAttention
from blockdraft.layers.norm import RMSNorm
from blockdraft.layers.rotary import RotaryEmbedding
from blockdraft.models.model_config import TransformerConfig

# At most this many rows (decode: the batch; verify: batch * (1 + N)), a linear on the GPU runs
# the skinny GEMM, which only streams the weight; more rows are cuBLAS's. Measured on the H200
# (benchmarks/gemv_bench.py, BENCHMARKS.md): faster than cuBLAS at 1-2 rows on every Qwen3-8B
# projection, not reliably at 4-16 alone; but whole steps were as fast or faster at 16 rows
# (gpu_bench --ablate, run VIII: AR batch 8 5.76 -> 5.45 ms, DFlash verify 16 rows 6.26 -> 6.15).
SKINNY_MAX_ROWS = 16
# Compiled Triton only: in the interpreter the kernel would crawl through every projection.
SKINNY_DEVICE_TYPE = "cuda"
# Where the down projection runs the skinny GEMM, form the MLP's silu(gate) * up in its loads
# from the fused gate_up output, saving the activation kernel's launch (one per layer).
# Measured on the H200 (gpu_bench.py --ablate, BENCHMARKS.md): with the norm prologue, the
# batch-1 Qwen3-8B decode step 4.92 -> 4.61 ms.
FUSE_SILU_MUL_INTO_DOWN = True
# Where a layer's fused q/k/v and gate/up projections run the skinny GEMM, form the residual
# add + RMSNorm before each in the GEMM's loads (two norm kernels' launches less per layer).
FUSE_NORM_INTO_SKINNY = True
# Outside autograd, the q/k norm + RoPE kernel also writes the step's keys and values into the
# paged cache (the target's and the drafter's layers, and the drafter's context rows), saving
# the store kernel's launch (one per layer). On the H200 (gpu_bench.py --ablate): the batch-1
# DFlash N = 15 step 6.38 -> 6.27 ms, the decode step unchanged.
FUSE_KV_STORE_INTO_ROPE = True
# The norm prologue runs for at most this many rows even where SKINNY_MAX_ROWS is larger: at 16
# rows (a batch-1 verify) the two prologues together doubled the H200's step (gpu_bench --ablate).
PROLOGUE_MAX_ROWS = 2
# The SiLU·mul prologue's own row limit (it reads only its tile's gate and up halves, unlike the
# norm's whole-row pass), measured at 16 on the H200 (gpu_bench --ablate, BENCHMARKS.md run XIV):
# the batch-1 DFlash step 6.02 -> 8.45 ms, AR batch 8 5.15 -> 5.20; so 2, as the norm's.
SILU_MUL_PROLOGUE_MAX_ROWS = 2


def skinny(
    x: torch.Tensor,  # [num_tokens, in_features]
    *params: torch.Tensor | None,
) -> bool:
    """Whether a linear of x runs the skinny GEMM: few rows, on the GPU, outside autograd."""
    return (
        x.device.type == SKINNY_DEVICE_TYPE
        and x.shape[:-1].numel() <= SKINNY_MAX_ROWS
        and not needs_autograd(x, *params)
    )


def prologue_fits(
    x: torch.Tensor,  # [num_tokens, in_features]
    *params: torch.Tensor | None,
    max_rows: int | None = None,  # None: PROLOGUE_MAX_ROWS
) -> bool:
    """Whether the skinny GEMM of x may also form its input in its loads (a prologue)."""
    limit = PROLOGUE_MAX_ROWS if max_rows is None else max_rows
    return x.shape[:-1].numel() <= limit and skinny(x, *params)


def linear(
    x: torch.Tensor,  # [num_tokens, in_features]
    weight: torch.Tensor,  # [out_features, in_features]
    bias: torch.Tensor | None = None,  # [out_features]
) -> torch.Tensor:  # [num_tokens, out_features]
    """`F.linear`, through `get_linear_backend` (the Triton skinny GEMM) for a few rows on the
    GPU outside autograd; CPU and training run F.linear itself."""
    if skinny(x, weight, bias):
        return get_linear_backend(x.device)(x, weight, bias)
    return F.linear(x, weight, bias)


class SelfAttention(nn.Module):
    def __init__(
        self,
        cfg: TransformerConfig,
        rotary: RotaryEmbedding,
        causal: bool = True,
        window: int | None = None,
    ) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=cfg.attention_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.rotary = rotary
        self.attn = PagedAttention(cfg.num_heads, cfg.num_kv_heads, d, causal, window)
        self._split = (cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d)
        self._qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None  # fuse_projections

    def fuse_projections(self) -> None:
        """One GEMM for q, k and v (and one for the drafter's context k and v) instead of three."""
        self._qkv = fuse_linears(self.q_proj, self.k_proj, self.v_proj)

    def project_kv(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        positions: torch.Tensor,  # [num_tokens] int64
    ) -> tuple[torch.Tensor, torch.Tensor]:  # 2 x [num_tokens, Hkv, D], rotated keys
        k, v = self._kv_heads(x)
        return self.norm_rope(positions, None, k)[1], v

    def write_kv(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        positions: torch.Tensor,  # [num_tokens] int64
        slot_mapping: torch.Tensor,  # [num_tokens] int64, PAD_SLOT_ID rows write nothing
        store_kv: StoreKVFn,
    ) -> None:
        """`project_kv` into this layer's cache at slot_mapping (the drafter's context rows): by
        the RoPE kernel under FUSE_KV_STORE_INTO_ROPE, else by store_kv."""
        k, v = self._kv_heads(x)
        cache = self.attn.key_cache, self.attn.value_cache
        if self.fuses_kv_store(k, v):
            self.rotary.forward_store(positions, None, k, v, *cache, slot_mapping, *self._norms())
        else:
            store_kv(self.norm_rope(positions, None, k)[1], v, *cache, slot_mapping)

    def _kv_heads(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # 2 x [num_tokens, Hkv, D], before norm and RoPE
        if self._qkv is None:
            k, v = self.k_proj(x), self.v_proj(x)
        else:
            weight, bias = self._qkv
            q_rows = self._split[0]  # the k and v rows of the fused matrix are contiguous
            kv = linear(x, weight[q_rows:], None if bias is None else bias[q_rows:])
            k, v = kv.split(self._split[1:], dim=-1)
        heads = (-1, self.num_kv_heads, self.head_dim)
        return k.view(heads), v.view(heads)

    def _norms(self) -> tuple[torch.Tensor | None, torch.Tensor | None, float]:
        """(q_norm_weight, k_norm_weight, eps) for the rotary kernels; no weights: no q/k norm."""
        if not self.qk_norm:
            return None, None, 1e-6
        # Both norms are built with the config's eps; the fused kernel takes one.
        return self.q_norm.weight, self.k_norm.weight, self.k_norm.eps

    def fuses_kv_store(self, *tensors: torch.Tensor) -> bool:
        """Whether the RoPE kernel stores the keys and values (FUSE_KV_STORE_INTO_ROPE): not
        under autograd, which the separate store's path keeps for training."""
        return FUSE_KV_STORE_INTO_ROPE and not needs_autograd(*tensors, *self._norms()[:2])

    def norm_rope(
        self,
        positions: torch.Tensor,  # [num_tokens] int64
        q: torch.Tensor | None,  # [num_tokens, num_heads, head_dim]; None: keys only
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    ) -> tuple[torch.Tensor | None, torch.Tensor]:  # rotated (q, k)
        """q/k norms (Qwen3) and RoPE in one fused kernel on the Triton path."""
        return self.rotary(positions, q, k, *self._norms())

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        positions: torch.Tensor,  # [num_tokens] int64
    ) -> torch.Tensor:  # [num_tokens, hidden]
        if self._qkv is not None:
            return self.attend(linear(x, *self._qkv), positions)
        return self.attend_qkv(self.q_proj(x), self.k_proj(x), self.v_proj(x), positions)

    def attend(
        self,
        qkv: torch.Tensor,  # [num_tokens, q + 2 kv], the fused projection's output
        positions: torch.Tensor,  # [num_tokens] int64
    ) -> torch.Tensor:  # [num_tokens, hidden]
        """The rest of `forward` after the fused q/k/v projection (split into row views)."""
        return self.attend_qkv(*qkv.split(self._split, dim=-1), positions)

    def attend_qkv(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads * head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
        positions: torch.Tensor,  # [num_tokens] int64
    ) -> torch.Tensor:  # [num_tokens, hidden]
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.fuses_kv_store(q, k, v):
            rotary = self.rotary
            out = self.attn.rope_store_attend(
                q, k, v, positions, rotary.cos_cache, rotary.sin_cache, *self._norms()
            )
        else:
            q, k = self.norm_rope(positions, q, k)
            out = self.attn(q, k, v)
        return linear(out.flatten(1), self.o_proj.weight, self.o_proj.bias)


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self._silu_mul = PerDevice(get_silu_mul_backend)  # Triton on CUDA, else torch
        self._gate_up: tuple[torch.Tensor, torch.Tensor | None] | None = None  # fuse_projections

    def fuse_projections(self) -> None:
        """One GEMM for gate and up instead of two."""
        self._gate_up = fuse_linears(self.gate_proj, self.up_proj)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
    ) -> torch.Tensor:  # [num_tokens, hidden]
        if self._gate_up is None:
            return self.down(self.gate_proj(x), self.up_proj(x))
        return self.down_gate_up(linear(x, *self._gate_up))

    def down_gate_up(
        self,
        gate_up: torch.Tensor,  # [num_tokens, 2 * intermediate], the fused projection's output
    ) -> torch.Tensor:  # [num_tokens, hidden]
        """The rest of `forward` after the fused gate/up projection."""
        down = self.down_proj
        fits = prologue_fits(gate_up, down.weight, down.bias, max_rows=SILU_MUL_PROLOGUE_MAX_ROWS)
        if FUSE_SILU_MUL_INTO_DOWN and fits:
            return get_linear_backend(gate_up.device)(
                gate_up, down.weight, down.bias, silu_mul_input=True
            )
        # row-strided halves of one output; the activation kernel reads them in place
        return self.down(*gate_up.chunk(2, dim=-1))

    def down(
        self,
        gate: torch.Tensor,  # [num_tokens, intermediate]
        up: torch.Tensor,  # [num_tokens, intermediate]
    ) -> torch.Tensor:  # [num_tokens, hidden]
        down = self.down_proj
        if needs_autograd(gate, up):
            act = silu_mul_torch(gate, up)
        else:
            act = self._silu_mul(gate.device)(gate, up)
        return linear(act, down.weight, down.bias)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: TransformerConfig,
        rotary: RotaryEmbedding,
        causal: bool = True,
        window: int | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = SelfAttention(cfg, rotary, causal, window)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden], the previous layer's MLP output (or the input)
        positions: torch.Tensor,  # [num_tokens] int64
        residual: torch.Tensor | None = None,  # [num_tokens, hidden]; None: x is the stream
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (MLP output, residual stream), [num_tokens, hidden]
        """Pre-norm block whose output `mlp_out + residual` is left unsummed: each residual add
        is fused into the norm after it (one kernel on the Triton path), the last one into the
        next layer's input norm or the final norm. `layer_output` sums it where it is needed."""
        if FUSE_NORM_INTO_SKINNY and self._norms_fuse(x, residual):
            # Each norm formed in the loads of the skinny GEMM after it: same outputs and stream.
            attn, mlp = self.self_attn, self.mlp
            qkv, residual = _norm_linear(self.input_layernorm, x, residual, *attn._qkv)
            h = attn.attend(qkv, positions)
            gate_up, residual = _norm_linear(
                self.post_attention_layernorm, h, residual, *mlp._gate_up
            )
            return mlp.down_gate_up(gate_up), residual
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, positions)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual

    def _norms_fuse(self, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
        """Whether both norms can go into the skinny q/k/v and gate/up GEMMs: fused projections
        that run it, and one dtype for the activations, the residual and the norm weights."""
        qkv, gate_up = self.self_attn._qkv, self.mlp._gate_up
        if qkv is None or gate_up is None:
            return False
        norms = self.input_layernorm.weight, self.post_attention_layernorm.weight
        dtypes = {x.dtype, *(w.dtype for w in norms)}
        if residual is not None:
            dtypes.add(residual.dtype)
        return len(dtypes) == 1 and prologue_fits(x, residual, *qkv, *gate_up, *norms)


def _norm_linear(
    norm: RMSNorm,
    x: torch.Tensor,  # [num_tokens, hidden]
    residual: torch.Tensor | None,  # [num_tokens, hidden]; None: x is the stream
    weight: torch.Tensor,  # [out_features, hidden]
    bias: torch.Tensor | None,  # [out_features]
) -> tuple[torch.Tensor, torch.Tensor]:  # (linear(norm(x + residual)), x + residual)
    """`norm` (with its residual add) and the skinny GEMM after it, in one kernel."""
    gemm = get_linear_backend(x.device)
    if residual is None:
        return gemm(x, weight, bias, rms_norm=(norm.weight, norm.eps)), x
    stream = torch.empty_like(x, memory_format=torch.contiguous_format)
    out = gemm(
        x, weight, bias, rms_norm=(norm.weight, norm.eps), residual=residual, residual_out=stream
    )
    return out, stream


def fuse_linears(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Stacks the weights (and biases) of linears that read the same input into one matrix and
    makes each linear's parameters row views of it: one weight read and one launch per forward
    instead of one per linear, with parameter names, state dicts and memory as before. For
    inference only (the views do not train)."""
    weight = torch.cat([lin.weight.detach() for lin in linears])
    has_bias = linears[0].bias is not None
    bias = torch.cat([lin.bias.detach() for lin in linears]) if has_bias else None
    start = 0
    for lin in linears:
        rows = slice(start, start + lin.out_features)
        lin.weight = nn.Parameter(weight[rows], requires_grad=False)
        if bias is not None:
            lin.bias = nn.Parameter(bias[rows], requires_grad=False)
        start += lin.out_features
    return weight, bias


def fuse_projections(model: nn.Module) -> None:
    """Fuses q/k/v and gate/up of every attention and MLP in `model` (see `fuse_linears`)."""
    for module in model.modules():
        if isinstance(module, SelfAttention | MLP):
            module.fuse_projections()


def layer_output(x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """The hidden state after a `DecoderLayer` from its (MLP output, residual stream)."""
    return x if residual is None else x + residual


def final_norm(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """`norm(x + residual)`, the last layer's residual add fused into the final norm."""
    return norm(x) if residual is None else norm(x, residual)[0]


class DecoderModel(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        rotary = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )
        self.layers = nn.ModuleList(DecoderLayer(cfg, rotary) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DecoderLM(nn.Module):
    """Target model. `forward` also returns the hidden states after the decoder layers listed in
    `capture_layer_ids` (DFlash target features), concatenated, taken in the same pass."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = DecoderModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
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
        captured = {}
        for i, layer in enumerate(self.model.layers):
            x, residual = layer(x, positions, residual)
            if i in self.capture_layer_ids:
                # Summed only where captured; elsewhere the add is fused into the next norm.
                x, residual = layer_output(x, residual), None
                captured[i] = x
        x = final_norm(self.model.norm, x, residual)
        last = len(self.model.layers) - 1
        if last in captured:
            # transformers' hidden_states tuple (what drafters are trained on) ends with the
            # final-normed output, not the last layer's raw one.
            captured[last] = x
        features = (
            torch.cat([captured[i] for i in self.capture_layer_ids], dim=-1) if captured else None
        )
        return x, features

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [R, hidden] -> [R, V] fp32
        return linear(hidden, self.lm_head.weight, self.lm_head.bias).float()
