"""Qwen3.5-MoE (hybrid Gated DeltaNet + gated attention layers, each with routed experts and a
gated shared expert) through `LLM`: greedy output equal to transformers'
`Qwen3_5MoeForCausalLM.generate` on tiny random checkpoints (mixed layer types, top-2 and
top-1, per-expert and stacked expert tensors, prompts longer than a prefill chunk, requests at
different positions); the multimodal checkpoint loads its language model."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_qwen3_5 import hf_greedy

from blockdraft import LLM, SamplingParams
from blockdraft.layers.moe import SparseMoE
from blockdraft.models.qwen3_5_moe import qwen3_5_moe_config

from checkpoints import make_hybrid_moe_checkpoint

CASES = {
    # name: make_hybrid_moe_checkpoint kwargs
    "top2-per-expert": dict(top_k=2),
    "top1-stacked-full-first": dict(
        top_k=1,
        stacked_experts=True,
        layer_types=("full_attention", "linear_attention", "linear_attention"),
        num_layers=3,
    ),
    # As published (Qwen3.5-35B-A3B: 512 and 512): the shared expert stacks with the routed ones.
    "top2-shared-as-wide": dict(top_k=2, shared_expert_intermediate_size=16),
}


def greedy(llm: LLM, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_transformers(tmp_path: Path, case: str, rng) -> None:
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))
    target = make_hybrid_moe_checkpoint(tmp_path / case, seed=seed, **CASES[case])
    prompts = [torch.randint(4, 128, (n,), generator=rng).tolist() for n in (3, 21)]
    llm = LLM(str(target), block_size=4, max_num_batched_tokens=16)
    layers = llm.engine.model.model.layers
    assert all(isinstance(layer.mlp, SparseMoE) for layer in layers)
    assert all(layer.mlp.shared_expert is not None for layer in layers)
    stacked = CASES[case].get("shared_expert_intermediate_size") == 16  # the routed width
    assert all((layer.mlp._stacked is not None) == stacked for layer in layers)
    assert greedy(llm, prompts, 10) == hf_greedy(target, prompts, 10)


def test_multimodal_checkpoint_loads_its_language_model(tmp_path: Path, rng, caplog) -> None:
    """A `Qwen3_5MoeForConditionalGeneration` checkpoint (text_config, `model.language_model.*`
    with per-expert tensors, a vision tower and an MTP head) runs its language model."""
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))
    target = make_hybrid_moe_checkpoint(tmp_path / "lm", num_layers=2, seed=seed)
    mm = shutil.copytree(target, tmp_path / "mm")
    text = json.loads((mm / "config.json").read_text())
    config = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
              "text_config": {**text, "model_type": "qwen3_5_moe_text"},
              "vision_config": {"depth": 1}, "tie_word_embeddings": False}  # fmt: skip
    (mm / "config.json").write_text(json.dumps(config))
    tensors = {
        name.replace("model.", "model.language_model.", 1): t
        for name, t in load_file(mm / "model.safetensors").items()
    }
    assert "model.language_model.layers.0.mlp.experts.3.up_proj.weight" in tensors
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)
    tensors["mtp.layers.0.mlp.experts.0.up_proj.weight"] = torch.zeros(4, 4)
    save_file(tensors, mm / "model.safetensors")
    prompt = torch.randint(4, 128, (9,), generator=rng).tolist()
    with caplog.at_level(logging.INFO, logger="blockdraft"):
        out = greedy(LLM(str(mm)), [prompt], 8)
    assert "skipped 2 vision-tower / MTP tensors" in caplog.text
    assert out == greedy(LLM(str(target)), [prompt], 8)


def test_bad_configs_are_refused(tmp_path: Path) -> None:
    target = make_hybrid_moe_checkpoint(tmp_path / "t", num_layers=2)
    hf = json.loads((target / "config.json").read_text())
    cfg = qwen3_5_moe_config({**hf, "norm_topk_prob": False, "decoder_sparse_step": 2})
    assert cfg.moe.norm_topk_prob and all(cfg.moe.is_sparse(i) for i in range(2))
    for edit, message in [
        ({"shared_expert_intermediate_size": None}, "missing required MoE field 'shared_exp"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok 9 must be between 1 and num_experts"),
        ({"layer_types": ["linear_attention"]}, "must list 2 entries"),
    ]:
        bad = {k: v for k, v in {**hf, **edit}.items() if v is not None}
        with pytest.raises(ValueError, match=message):
            qwen3_5_moe_config(bad)
