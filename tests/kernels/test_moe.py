"""The MoE torch twins against transformers' Qwen3-MoE router and experts, in float32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from blockdraft.kernels.moe import experts_torch, route_torch


@pytest.mark.parametrize("top_k,renormalize", [(1, False), (2, True), (4, False), (8, True)])
def test_twins_match_transformers_sparse_block(rng, top_k, renormalize) -> None:
    num_experts = int(torch.randint(top_k, 17, (1,), generator=rng))
    cfg = Qwen3MoeConfig(
        hidden_size=32,
        moe_intermediate_size=24,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=renormalize,
    )
    block = Qwen3MoeSparseMoeBlock(cfg).float()
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=rng) * 0.2)
    x = torch.randn(int(torch.randint(1, 40, (1,), generator=rng)), 32, generator=rng)
    with torch.no_grad():
        expected = block(x[None])
        expected = expected[0] if isinstance(expected, tuple) else expected
        weights, ids = route_torch(F.linear(x, block.gate.weight), top_k, renormalize)
        got = experts_torch(x, block.experts.gate_up_proj, block.experts.down_proj, weights, ids)
    assert ids.shape == (x.shape[0], top_k)
    if renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(x.shape[0]))
    torch.testing.assert_close(got, expected.reshape(x.shape), rtol=1e-5, atol=1e-5)


def test_experts_untouched_rows_are_zero_and_unused_experts_cost_nothing(rng) -> None:
    x = torch.randn(6, 8, generator=rng)
    w_gate_up, w_down = torch.randn(4, 10, 8, generator=rng), torch.randn(4, 8, 5, generator=rng)
    ids = torch.full((6, 1), 2)
    weights = torch.zeros(6, 1)
    weights[3] = 1.0
    out = experts_torch(x, w_gate_up, w_down, weights, ids)
    assert torch.count_nonzero(out[[0, 1, 2, 4, 5]]) == 0
    gate, up = (x[3] @ w_gate_up[2].T).chunk(2)
    torch.testing.assert_close(out[3], (F.silu(gate) * up) @ w_down[2].T)
