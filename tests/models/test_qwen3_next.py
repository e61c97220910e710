"""Qwen3-Next through `LLM`: greedy output equal to transformers'
`Qwen3NextForCausalLM.generate` on tiny random checkpoints: per-key-head fused `in_proj_qkvz` /
`in_proj_ba` regrouped into Qwen3.5's projections (2 key heads serving 4 value heads), routed
experts with a gated shared expert, dense layers by `decoder_sparse_step` / `mlp_only_layers`,
with and without `norm_topk_prob`, per-expert and stacked expert tensors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_qwen3_5 import hf_greedy

from blockdraft import LLM, SamplingParams
from blockdraft.layers.moe import SparseMoE
from blockdraft.models.qwen3_next import qwen3_next_config

from checkpoints import make_hybrid_moe_checkpoint

CASES = {
    # name: (make_hybrid_moe_checkpoint kwargs, which layers route)
    "top2-norm": (dict(top_k=2), [True] * 4),
    "sparse-step2-mlp-only-nonorm-stacked": (
        dict(
            top_k=3,
            norm_topk_prob=False,
            decoder_sparse_step=2,
            mlp_only_layers=(3,),
            stacked_experts=True,
            linear_heads=(1, 2),
        ),
        [False, True, False, False],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_transformers(tmp_path: Path, case: str, rng) -> None:
    kwargs, sparse = CASES[case]
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))
    target = make_hybrid_moe_checkpoint(tmp_path / case, "qwen3_next", seed=seed, **kwargs)
    names = json.loads((target / "config.json").read_text())["architectures"]
    assert names == ["Qwen3NextForCausalLM"]
    prompts = [torch.randint(4, 128, (n,), generator=rng).tolist() for n in (3, 21)]
    llm = LLM(str(target), block_size=4, max_num_batched_tokens=16)
    layers = llm.engine.model.model.layers
    assert [isinstance(layer.mlp, SparseMoE) for layer in layers] == sparse
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(target, prompts, 10)


def test_config_defaults(tmp_path: Path) -> None:
    """transformers' defaults where config.json leaves a field out: norm_topk_prob true."""
    target = make_hybrid_moe_checkpoint(tmp_path / "t", "qwen3_next", num_layers=2)
    hf = json.loads((target / "config.json").read_text())
    del hf["norm_topk_prob"], hf["decoder_sparse_step"], hf["mlp_only_layers"]
    cfg = qwen3_next_config(hf)
    assert cfg.moe.norm_topk_prob and cfg.moe.shared_expert_intermediate_size == 24
    assert all(cfg.moe.is_sparse(i) for i in range(2))
