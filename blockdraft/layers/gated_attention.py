"""The full-attention layer of Qwen3.5 / Qwen3-Next (transformers' `Qwen3_5Attention`): q_proj
gives each head's query and an output gate side by side, per-head q/k RMSNorm with offset
weights, partial rotary, paged attention, and `o_proj(attn * sigmoid(gate))`."""

from __future__ import annotations

import torch
from torch import nn

from blockdraft.layers.attention import PagedAttention
from blockdraft.layers.linear import linear
from blockdraft.layers.norm import OffsetRMSNorm
from blockdraft.layers.rotary import RotaryEmbedding


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
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(hidden_size, 2 * num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias)
        self.q_norm = OffsetRMSNorm(head_dim, eps)
        self.k_norm = OffsetRMSNorm(head_dim, eps)
        self.rotary = rotary
        self.attn = PagedAttention(num_heads, num_kv_heads, head_dim)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        positions: torch.Tensor,  # [num_tokens] int64
    ) -> torch.Tensor:  # [num_tokens, hidden]
        heads = (-1, self.num_heads, 2 * self.head_dim)
        q, gate = linear(x, self.q_proj.weight, self.q_proj.bias).view(heads).chunk(2, dim=-1)
        kv_heads = (-1, self.num_kv_heads, self.head_dim)
        k = linear(x, self.k_proj.weight, self.k_proj.bias).view(kv_heads)
        v = linear(x, self.v_proj.weight, self.v_proj.bias).view(kv_heads)
        q = self.rotary.rotate(positions, self.q_norm(q))
        k = self.rotary.rotate(positions, self.k_norm(k))
        out = self.attn(q.contiguous(), k.contiguous(), v).flatten(1)
        out = out * torch.sigmoid(gate.reshape(out.shape))
        return linear(out, self.o_proj.weight, self.o_proj.bias)
