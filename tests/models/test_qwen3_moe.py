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


# --- llama.cpp's qwen3moe ------------------------------------------------------------------

# Hugging Face name (within a layer) -> llama.cpp name, written out independently of the loader.
GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm",
    "self_attn.q_proj.weight": "attn_q",
    "self_attn.k_proj.weight": "attn_k",
    "self_attn.v_proj.weight": "attn_v",
    "self_attn.o_proj.weight": "attn_output",
    "self_attn.q_norm.weight": "attn_q_norm",
    "self_attn.k_norm.weight": "attn_k_norm",
    "post_attention_layernorm.weight": "ffn_norm",
    "mlp.gate.weight": "ffn_gate_inp",
}


def write_qwen3moe_gguf(path: Path, model, vocab_size: int) -> None:
    """`model` (a transformers Qwen3MoeForCausalLM) as llama.cpp's converter writes it: experts
    stacked per layer (`ffn_{gate,up}_exps` [E, I, H], `ffn_down_exps` [E, H, I])."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    # A minimal byte-level BPE vocabulary: "t", "1" and their merge "t1", then "t2", "t3", ...
    w.add_token_list(["t", "1"] + [f"t{i}" for i in range(1, vocab_size - 2)] + ["<|im_end|>"])
    w.add_token_merges(["t 1"])
    w.add_eos_token_id(vocab_size - 1)
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd.pop("model.embed_tokens.weight"))
    w.add_tensor("output_norm.weight", sd.pop("model.norm.weight"))
    w.add_tensor("output.weight", sd.pop("lm_head.weight"))
    inter = cfg.moe_intermediate_size
    for i in range(cfg.num_hidden_layers):
        prefix = f"model.layers.{i}."
        for hf, ours in GGUF_LAYER_NAMES.items():
            w.add_tensor(f"blk.{i}.{ours}.weight", sd.pop(prefix + hf))
        gate_up = sd.pop(prefix + "mlp.experts.gate_up_proj")
        w.add_tensor(f"blk.{i}.ffn_gate_exps.weight", np.ascontiguousarray(gate_up[:, :inter]))
        w.add_tensor(f"blk.{i}.ffn_up_exps.weight", np.ascontiguousarray(gate_up[:, inter:]))
        w.add_tensor(f"blk.{i}.ffn_down_exps.weight", sd.pop(prefix + "mlp.experts.down_proj"))
    assert not sd, sorted(sd)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_greedy_matches_transformers(tmp_path: Path, rng) -> None:
    """A qwen3moe GGUF (llama.cpp always renormalises the top-k weights) loads into the
    per-expert Hugging Face names and generates what transformers does from the source."""
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))
    target = make_qwen3_moe_checkpoint(tmp_path / "hf", top_k=3, norm_topk_prob=True, seed=seed)
    ref = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    path = tmp_path / "tiny-qwen3moe.gguf"
    write_qwen3moe_gguf(path, ref, vocab_size=128)
    # transformers reads the file back into the source's weights: the writer lays experts out
    # as llama.cpp does (it does not read expert_feed_forward_length, hence the override).
    theirs = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32, moe_intermediate_size=32
    )
    for name, tensor in ref.state_dict().items():
        assert torch.equal(theirs.state_dict()[name], tensor), name
    ckpt = load_gguf(path)
    cfg = ckpt.hf_config
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"]
    assert (cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]) == (
        8,
        3,
        32,
    )
    assert cfg["norm_topk_prob"] is True and cfg["mlp_only_layers"] == []
    source = json.loads((target / "config.json").read_text())
    assert cfg["intermediate_size"] == source["intermediate_size"]
    # One tensor per expert, as a Hugging Face checkpoint holds them.
    up = ref.model.layers[1].mlp.experts.gate_up_proj[5, 32:]
    torch.testing.assert_close(ckpt.state_dict["model.layers.1.mlp.experts.5.up_proj.weight"], up)
    prompts = [torch.randint(4, 127, (n,), generator=rng).tolist() for n in (2, 9)]
    assert greedy(LLM(str(path), block_size=4), prompts, 10) == hf_greedy(target, prompts, 10)
