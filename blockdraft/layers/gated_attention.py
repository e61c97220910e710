"""The full-attention layer of Qwen3.5 / Qwen3-Next (transformers' `Qwen3_5Attention`): q_proj
gives each head's query and an output gate side by side, per-head q/k RMSNorm with offset
weights, partial rotary, paged attention, and `o_proj(attn * sigmoid(gate))`.

The q/k norms, the (partial) rotation and the KV store are the one fused kernel `SelfAttention`
runs (`RotaryEmbedding.forward_store` in its `norm_offset` mode, reading the queries in place
beside their gates), then attention over the cache: on the Triton path a decode step's layer
is six launches (q/k/v GEMM, that kernel, attention, sigmoid, multiply, o_proj), where the
eager norms and rotation alone took ~24. Under autograd (training), or with the policy's
`fuse_kv_store_into_rope` off, it rotates with `RotaryEmbedding.forward` and stores
separately, as `SelfAttention` does. On the torch backend every path computes what the eager
`rotary.rotate(positions, q_norm(q))` did, bit for bit.

Under tensor parallelism each rank holds its query heads (a head's query and gate rows are
adjacent in q_proj, so they are one range) and KV heads as `SelfAttention` does; o_proj is
row-parallel, one all-reduce after it; the q/k norms (per head dim) are whole on every rank."""

from __future__ import annotations

import torch
from torch import nn

from blockdraft.distributed.tensor_parallel import Shard, current_tensor_parallel, tag_shard
from blockdraft.layers.attention import PagedAttention
from blockdraft.layers.linear import fuse_linears, linear, row_parallel_linear
from blockdraft.layers.norm import OffsetRMSNorm
from blockdraft.layers.rotary import RotaryEmbedding
from blockdraft.layers.self_attention import head_shards, rope_stores_kv


class GatedSelfAttention(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotary: RotaryEmbedding,
        eps: float,
        bias: bool = False,
    ) -> None:
        super().__init__()
        d, full_heads, full_kv_heads = head_dim, num_heads, num_kv_heads
        self.tp = tp = current_tensor_parallel()
        if tp is not None:
            q_start, num_heads, kv_start, num_kv_heads = head_shards(tp, num_heads, num_kv_heads)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(hidden_size, 2 * num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias)
        if tp is not None:
            q_stop, kv_stop = q_start + num_heads, kv_start + num_kv_heads
            shards = {
                self.q_proj: Shard(0, 2 * q_start * d, 2 * q_stop * d, 2 * full_heads * d),
                self.k_proj: Shard(0, kv_start * d, kv_stop * d, full_kv_heads * d),
                self.v_proj: Shard(0, kv_start * d, kv_stop * d, full_kv_heads * d),
            }
            for proj, shard in shards.items():
                for param in (proj.weight, proj.bias):
                    if param is not None:
                        tag_shard(param, shard)
            tag_shard(self.o_proj.weight, Shard(1, q_start * d, q_stop * d, full_heads * d))
        self.q_norm = OffsetRMSNorm(head_dim, eps)
        self.k_norm = OffsetRMSNorm(head_dim, eps)
        self.rotary = rotary
        self.attn = PagedAttention(num_heads, num_kv_heads, head_dim)
        self._split = (2 * num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim)
        self._qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None  # fuse_projections

    def fuse_projections(self) -> None:
        """One GEMM for q (with its gate), k and v instead of three."""
        self._qkv = fuse_linears(self.q_proj, self.k_proj, self.v_proj)

    def _norms(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        """(q_norm_weight, k_norm_weight, eps) for the rotary kernels, in their norm_offset mode."""
        # Both norms are built with the config's eps; the fused kernel takes one.
        return self.q_norm.weight, self.k_norm.weight, self.k_norm.eps

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        positions: torch.Tensor,  # [num_tokens] int64
    ) -> torch.Tensor:  # [num_tokens, hidden]
        if self._qkv is not None:
            return self.attend(linear(x, *self._qkv), positions)
        q_gate, k, v = (
            linear(x, p.weight, p.bias) for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        return self._attend(q_gate, k, v, positions)

    def attend(
        self,
        qkv: torch.Tensor,  # [num_tokens, sum(self._split)], the fused projection's output
        positions: torch.Tensor,  # [num_tokens] int64
    ) -> torch.Tensor:  # [num_tokens, hidden]
        """The rest of `forward` after the fused q/gate/k/v projection (`_qkv`), for a caller
        that formed it itself (the input norm in the skinny GEMM's loads)."""
        return self._attend(*qkv.split(self._split, dim=-1), positions)

    def _attend(
        self,
        q_gate: torch.Tensor,  # [num_tokens, 2 * num_heads * head_dim], each head's q then gate
        k: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
        positions: torch.Tensor,  # [num_tokens] int64
    ) -> torch.Tensor:  # [num_tokens, hidden]
        # Views of the projection's rows (q a strided one beside its gate): the rotary kernels
        # read heads at any row stride, so nothing is copied.
        q, gate = q_gate.reshape(-1, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        kv_heads = (-1, self.num_kv_heads, self.head_dim)
        k, v = k.reshape(kv_heads), v.reshape(kv_heads)
        if rope_stores_kv(q, k, v, *self._norms()[:2]):
            attn = self.attn
            cache = attn.key_cache, attn.value_cache
            slots = attn.metadata().slot_mapping
            q, _ = self.rotary.forward_store(
                positions, q, k, v, *cache, slots, *self._norms(), norm_offset=True
            )
            out = attn.attend(q)
        else:
            q, k = self.rotary(positions, q, k, *self._norms(), norm_offset=True)
            out = self.attn(q, k, v)
        out = output_gate(out, gate).flatten(1)
        if self.tp is not None:
            return row_parallel_linear(self.tp, out, self.o_proj.weight, self.o_proj.bias)
        return linear(out, self.o_proj.weight, self.o_proj.bias)


def output_gate(
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim], attention's output
    gate: torch.Tensor,  # [num_tokens, num_heads, head_dim], a strided view beside the queries
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """`out * sigmoid(gate)`, the numbers of transformers' expression (the gate copied
    contiguous first) on every device."""
    if gate.is_cuda:
        # CUDA's sigmoid computes each element alike whatever the layout: the strided gate is
        # read in place, two launches instead of three (copy, sigmoid, multiply).
        return out * torch.sigmoid(gate)
    # The CPU's vectorised sigmoid and its scalar loop round differently, and a strided gate
    # goes through them a row at a time (a row's tail, all of a short row, scalar): keep the
    # contiguous copy.
    return out * torch.sigmoid(gate.contiguous())
