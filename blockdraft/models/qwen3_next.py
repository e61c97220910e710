"""Qwen3-Next (`Qwen3NextForCausalLM`, e.g. Qwen3-Next-80B-A3B, Qwen3-Coder-Next): the
Qwen3.5-MoE model but for three things, all handled here rather than in the layers:

- its Gated DeltaNet fuses the input projections per key head: `in_proj_qkvz` holds, for each
  key head, its q and k rows then the v and z rows of the value heads it serves, and
  `in_proj_ba` each key head's b rows then its a rows. `checkpoint_tensors` regroups them into
  Qwen3.5's `in_proj_qkv` (all q, all k, all v), `in_proj_z`, `in_proj_b` and `in_proj_a`;
- layer i routes only when `(i + 1) % decoder_sparse_step == 0` and i is not in
  `mlp_only_layers` (a dense MLP of `intermediate_size` elsewhere);
- `norm_topk_prob` is read (transformers' default: true).

Checkpoints hold one tensor per expert (`mlp.experts.E.{gate,up,down}_proj.weight`) or the
stacked form; both load. The MTP head is skipped."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

import torch

from blockdraft.models.model_config import MoEConfig
from blockdraft.models.qwen3_5 import HybridConfig, hybrid_config
from blockdraft.models.qwen3_5_moe import Qwen3_5MoeLM, shared_expert_size


def qwen3_next_config(hf: dict) -> HybridConfig:
    """`Qwen3NextForCausalLM`'s config.json."""
    moe = dataclasses.replace(
        MoEConfig.from_hf(hf),
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        shared_expert_intermediate_size=shared_expert_size(hf),
    )
    return hybrid_config(hf, "qwen3_next", moe)


class Qwen3NextLM(Qwen3_5MoeLM):
    def checkpoint_tensors(
        self, tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Qwen3.5-MoE's renaming, with each linear-attention layer's fused per-key-head
        projections regrouped into Qwen3.5's four."""
        for name, tensor in super().checkpoint_tensors(tensors):
            if name.endswith(".linear_attn.in_proj_qkvz.weight"):
                prefix = name.removesuffix("qkvz.weight")
                qkv, z = self._split_qkvz(name, tensor)
                yield f"{prefix}qkv.weight", qkv
                yield f"{prefix}z.weight", z
            elif name.endswith(".linear_attn.in_proj_ba.weight"):
                prefix = name.removesuffix("ba.weight")
                b, a = self._split_ba(name, tensor)
                yield f"{prefix}b.weight", b
                yield f"{prefix}a.weight", a
            else:
                yield name, tensor

    def _groups(self, name: str, tensor: torch.Tensor, per_key_head: int) -> torch.Tensor:
        """`tensor` [num_key_heads * per_key_head, hidden] viewed per key head."""
        cfg = self.cfg
        want = (cfg.linear_num_key_heads * per_key_head, cfg.hidden_size)
        if tuple(tensor.shape) != want:
            raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {want}")
        return tensor.reshape(cfg.linear_num_key_heads, per_key_head, cfg.hidden_size)

    def _split_qkvz(
        self,
        name: str,
        tensor: torch.Tensor,  # [num_key_heads * (2 dk + 2 r dv), hidden], r value heads per key
    ) -> tuple[torch.Tensor, torch.Tensor]:  # in_proj_qkv [2 Hk dk + Hv dv, hidden], in_proj_z
        cfg = self.cfg
        dk = cfg.linear_key_head_dim
        rv = cfg.linear_num_value_heads // cfg.linear_num_key_heads * cfg.linear_value_head_dim
        groups = self._groups(name, tensor, 2 * dk + 2 * rv)
        q, k, v, z = groups.split([dk, dk, rv, rv], dim=1)
        hidden = cfg.hidden_size
        qkv = torch.cat([q.reshape(-1, hidden), k.reshape(-1, hidden), v.reshape(-1, hidden)])
        return qkv, z.reshape(-1, hidden)

    def _split_ba(
        self,
        name: str,
        tensor: torch.Tensor,  # [2 Hv, hidden], each key head's r b rows then its r a rows
    ) -> tuple[torch.Tensor, torch.Tensor]:  # in_proj_b, in_proj_a, each [Hv, hidden]
        cfg = self.cfg
        r = cfg.linear_num_value_heads // cfg.linear_num_key_heads
        b, a = self._groups(name, tensor, 2 * r).split([r, r], dim=1)
        return b.reshape(-1, cfg.hidden_size), a.reshape(-1, cfg.hidden_size)
