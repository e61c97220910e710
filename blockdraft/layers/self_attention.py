"""The attention front-end of a decoder layer: q/k/v projections (fused into one GEMM), the
optional per-head q/k RMSNorm (Qwen3), RoPE, paged attention and the output projection.

Under tensor parallelism each rank holds its share of the query heads and of the KV heads
(one replicated KV head, its query heads' group's, when there are fewer KV heads than ranks):
q/k/v are column-parallel, o_proj row-parallel, one all-reduce after it."""

from __future__ import annotations

import torch
from torch import nn

from blockdraft.distributed.tensor_parallel import (
    Shard,
    TensorParallel,
    current_tensor_parallel,
    tag_shard,
)
from blockdraft.kernels.forward_context import current_kernel_policy
from blockdraft.kernels.select import StoreKVFn, needs_autograd
from blockdraft.layers.attention import PagedAttention
from blockdraft.layers.linear import fuse_linears, linear, row_parallel_linear
from blockdraft.layers.norm import RMSNorm
from blockdraft.layers.rotary import RotaryEmbedding


def head_shards(tp: TensorParallel, num_heads: int, num_kv_heads: int) -> tuple[int, int, int, int]:
    """(first query head, query heads, first KV head, KV heads) of this rank: the query heads
    split evenly, the KV heads too, or, when the ranks outnumber them, the one KV head of this
    rank's query heads' group (config.check_tensor_parallel_shape checks the divisibility)."""
    q_start, q_stop = tp.split(num_heads)
    if num_kv_heads >= tp.size:
        kv_start, kv_stop = tp.split(num_kv_heads)
        return q_start, q_stop - q_start, kv_start, kv_stop - kv_start
    return q_start, q_stop - q_start, q_start // (num_heads // num_kv_heads), 1


def rope_stores_kv(*tensors: torch.Tensor | None) -> bool:
    """Whether the RoPE kernel stores the keys and values (`fuse_kv_store_into_rope` of the
    kernel policy): not under autograd (of `tensors`: the step's heads and the q/k norm
    weights), which the separate store's path keeps for training."""
    return current_kernel_policy().fuse_kv_store_into_rope and not needs_autograd(*tensors)


class SelfAttention(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotary: RotaryEmbedding,
        bias: bool = False,  # on q, k, v and o
        qk_norm_eps: float | None = None,  # per-head RMSNorm of q and k (Qwen3); None: none
        causal: bool = True,
        window: int | None = None,
    ) -> None:
        super().__init__()
        h, d = hidden_size, head_dim
        self.tp = tp = current_tensor_parallel()
        if tp is not None:
            q_start, num_heads, kv_start, kv_heads = head_shards(tp, num_heads, num_kv_heads)
            shards = (
                Shard(0, q_start * d, (q_start + num_heads) * d, num_heads * tp.size * d),
                Shard(0, kv_start * d, (kv_start + kv_heads) * d, num_kv_heads * d),
            )
            num_kv_heads = kv_heads
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, d
        self.q_proj = nn.Linear(h, num_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(num_heads * d, h, bias=bias)
        if tp is not None:
            q_shard, kv_shard = shards
            for param in (self.q_proj.weight, self.q_proj.bias):
                if param is not None:
                    tag_shard(param, q_shard)
            for proj in (self.k_proj, self.v_proj):
                for param in (proj.weight, proj.bias):
                    if param is not None:
                        tag_shard(param, kv_shard)
            tag_shard(self.o_proj.weight, Shard(1, q_shard.start, q_shard.stop, q_shard.full))
        self.qk_norm = qk_norm_eps is not None
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(d, qk_norm_eps)
            self.k_norm = RMSNorm(d, qk_norm_eps)
        self.rotary = rotary
        self.attn = PagedAttention(num_heads, num_kv_heads, d, causal, window)
        self._split = (num_heads * d, num_kv_heads * d, num_kv_heads * d)
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
        the RoPE kernel under KernelPolicy.fuse_kv_store_into_rope, else by store_kv."""
        k, v = self._kv_heads(x)
        cache = self.attn.key_cache, self.attn.value_cache
        slot_mapping = self.attn.cache_slots(slot_mapping, cache[0].shape[1])
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
        """`rope_stores_kv` for these step tensors and this layer's q/k norm weights."""
        return rope_stores_kv(*tensors, *self._norms()[:2])

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
        o_proj = self.o_proj
        if self.tp is not None:
            return row_parallel_linear(self.tp, out.flatten(1), o_proj.weight, o_proj.bias)
        return linear(out.flatten(1), o_proj.weight, o_proj.bias)
