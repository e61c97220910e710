"""llama.cpp DFlash drafter GGUFs: a drafter written with the `gguf` package under llama.cpp's
names (conversion/qwen.py `DFlashModel`, src/models/dflash.cpp) loads back as the z-lab (or
speculators, or DFlash2) drafter it came from, and runs beside a GGUF target."""

import dataclasses
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from blockdraft import LLM, SamplingParams

from checkpoints import (
    make_dflash_drafter,
    make_qwen3_checkpoint,
    make_speculators_drafter,
)
from dflash2_checkpoints import make_dflash2_drafter
from spies import spy_draft_logits, spy_proposals

# z-lab name -> llama.cpp name, written out independently of the loader's table.
GLOBAL = {
    "fc.weight": "fc.weight",
    "hidden_norm.weight": "enc.output_norm.weight",
    "norm.weight": "output_norm.weight",
    "embed_tokens.weight": "token_embd.weight",
    "lm_head.weight": "output.weight",
    # DFlash2 (src/models/dflash.cpp); z-lab's safetensors store the codebooks bare.
    "candidate_selector.hidden_projection.weight": "selector_hidden.weight",
    "candidate_selector.predecessor_codebook": "selector_predecessor.weight",
    "candidate_selector.successor_codebook": "selector_successor.weight",
}
LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "attention_conv.base_kernel": "attn_conv_base",
    "attention_conv.kernel_projection.weight": "attn_conv_proj.weight",
    "mlp_conv.base_kernel": "ffn_conv_base",
    "mlp_conv.kernel_projection.weight": "ffn_conv_proj.weight",
}
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def _llama_cpp_name(name: str) -> str:
    if name in GLOBAL:
        return GLOBAL[name]
    _, layer, rest = name.split(".", 2)
    return f"blk.{layer}.{LAYER[rest]}"


def write_drafter_gguf(
    path: Path,
    drafter_dir: Path,
    zlab_config: dict,
    extra: dict | None = None,
    tensors: dict[str, np.ndarray] | None = None,
) -> Path:
    """What llama.cpp's converter writes for the drafter at `drafter_dir` (z-lab names, or a
    speculators dir's with d2t; t2d is dropped as the converter drops it)."""
    cfg, dflash = zlab_config, zlab_config["dflash_config"]
    w = gguf.GGUFWriter(str(path), "dflash")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_array("dflash.target_layers", [i + 1 for i in dflash["target_layer_ids"]])
    w.add_uint32("dflash.target_hidden_size", cfg["hidden_size"])
    if "block_size" in cfg:
        w.add_uint32("dflash.block_size", cfg["block_size"])
    if cfg.get("sliding_window"):
        w.add_sliding_window(cfg["sliding_window"])
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])
    # The converter copies the target's tokenizer in; the drafter only needs its size.
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"w{i}" for i in range(cfg["vocab_size"])])
    w.add_mask_token_id(dflash["mask_token_id"])
    for key in DFLASH2_KEYS:
        if key in dflash:
            w.add_uint32(f"dflash.{key}", dflash[key])
    for key, value in (extra or {}).items():
        w.add_key_value(key, value, gguf.GGUFValueType.get_type(value))
    for name, tensor in load_file(drafter_dir / "model.safetensors").items():
        if name == "t2d":
            continue
        if name == "d2t":
            w.add_tensor("d2t", tensor.numpy().astype(np.int64))
        else:
            w.add_tensor(_llama_cpp_name(name), tensor.float().numpy())
    for name, array in (tensors or {}).items():
        w.add_tensor(name, array.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("gguf-drafter")
    target = make_qwen3_checkpoint(root / "target", num_layers=6)
    zlab = make_dflash_drafter(
        root / "zlab",
        target,
        num_layers=3,
        block_size=8,
        target_layer_ids=[0, 3, 5],
        sliding_window=5,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    )
    # speculators drafters have no sliding layers here (speculators_config.py says why).
    full = make_dflash_drafter(root / "full", target, num_layers=2, block_size=8)
    ids = sorted(torch.randperm(128, generator=torch.Generator().manual_seed(1))[:50].tolist())
    spec = make_speculators_drafter(root / "spec", full, target, ids)
    cfg = json.loads((zlab / "config.json").read_text())
    full_cfg = json.loads((full / "config.json").read_text())
    return {
        "target": target,
        "zlab": zlab,
        "zlab.gguf": write_drafter_gguf(root / "zlab.gguf", zlab, cfg),
        "spec": spec,
        "spec.gguf": write_drafter_gguf(root / "spec.gguf", spec, full_cfg),
        "config": cfg,
        "root": root,
    }


def spec(drafter: Path) -> dict:
    return {
        "method": "dflash",
        "model": str(drafter),
        "num_speculative_tokens": 7,
        "num_speculative_tokens_by_batch": None,
    }


def run(target: Path, drafter: Path, prompt: list[int]):
    """(drafter, its first proposal's logits, greedy output, the LLM, its first draft tokens) of
    a speculative run."""
    llm = LLM(str(target), speculative_config=spec(drafter))
    d, seen, drafts = llm.engine.proposer.drafter, spy_draft_logits(llm), spy_proposals(llm)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    return d, seen[0] if seen else None, out, llm, drafts[0] if drafts else None


@pytest.mark.parametrize("source", ["zlab", "spec"])
def test_round_trip_proposes_as_the_source(files, source: str, rng) -> None:
    """Same weights, config (target_layers - 1 are z-lab's ids, sliding layers) and reduced
    vocabulary, so the same proposals, tokens and acceptance lengths."""
    prompt = torch.randint(4, 128, (13,), generator=rng).tolist()
    ours, ours_logits, ours_out, _, _ = run(files["target"], files[f"{source}.gguf"], prompt)
    ref, ref_logits, ref_out, _, _ = run(files["target"], files[source], prompt)
    # GGUF stores rms_norm_eps as float32; it lists the target layers, not their count.
    assert abs(ours.cfg.body.rms_norm_eps - ref.cfg.body.rms_norm_eps) < 1e-12
    body = dataclasses.replace(ours.cfg.body, rms_norm_eps=ref.cfg.body.rms_norm_eps)
    assert ours.cfg.num_target_layers is None
    layers = ref.cfg.num_target_layers
    assert dataclasses.replace(ours.cfg, body=body, num_target_layers=layers) == ref.cfg
    ours_state, ref_state = ours.state_dict(), ref.state_dict()
    assert ours_state.keys() == ref_state.keys()
    for name, tensor in ours_state.items():
        assert torch.equal(tensor, ref_state[name]), name
    torch.testing.assert_close(ours_logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert ours_out.outputs[0].token_ids == ref_out.outputs[0].token_ids
    assert ours_out.spec_accept_lengths == ref_out.spec_accept_lengths


def test_beside_a_gguf_target(files, rng) -> None:
    """A GGUF target with a GGUF drafter: the same tokens as the target alone."""
    from test_gguf_loader import _byte_alphabet

    target_dir, root = files["target"], files["root"]
    hf = json.loads((target_dir / "config.json").read_text())
    path = root / "target.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3")
    w.add_block_count(hf["num_hidden_layers"])
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(hf["hidden_size"])
    w.add_feed_forward_length(hf["intermediate_size"])
    w.add_head_count(hf["num_attention_heads"])
    w.add_head_count_kv(hf["num_key_value_heads"])
    w.add_key_length(hf["head_dim"])
    w.add_value_length(hf["head_dim"])
    w.add_rope_freq_base(hf["rope_theta"])
    w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(_byte_alphabet()[: hf["vocab_size"] - 1] + ['!"'])
    w.add_token_merges(['! "'])
    w.add_eos_token_id(2)
    for name, tensor in load_file(target_dir / "model.safetensors").items():
        if name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            gguf_name = f"blk.{layer}.{LAYER[rest]}"
        else:
            gguf_name = {
                "model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight",
            }[name]
        w.add_tensor(gguf_name, tensor.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    prompt = torch.randint(4, 128, (9,), generator=rng).tolist()
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ar = LLM(str(path)).generate([prompt], params, use_tqdm=False)[0]
    _, _, sd, llm, _ = run(path, files["zlab.gguf"], prompt)
    assert sd.outputs[0].token_ids == ar.outputs[0].token_ids
    assert llm.engine.spec_stats.num_drafts > 0
    _, _, ref, _, _ = run(files["target"], files["zlab"], prompt)
    assert sd.outputs[0].token_ids == ref.outputs[0].token_ids
    assert sd.spec_accept_lengths == ref.spec_accept_lengths


@pytest.fixture(scope="module")
def dflash2(files) -> dict:
    root = files["root"]
    drafter = make_dflash2_drafter(
        root / "dflash2", files["target"], num_layers=3, block_size=8, sliding_window=5, seed=7
    )
    cfg = json.loads((drafter / "config.json").read_text())
    gguf_path = write_drafter_gguf(root / "dflash2.gguf", drafter, cfg)
    return {"drafter": drafter, "gguf": gguf_path, "config": cfg}


def test_dflash2_round_trip_proposes_as_the_source(files, dflash2, rng) -> None:
    """A DFlash2 drafter (convolutions, candidate selector) under llama.cpp's names and keys:
    z-lab's config and tensors back, so the same first logits and selector drafts, tokens and
    acceptance lengths as the safetensors drafter."""
    from blockdraft.models.dflash2_drafter import DFlash2Drafter

    prompt = torch.randint(4, 128, (13,), generator=rng).tolist()
    ours, ours_logits, ours_out, _, ours_drafts = run(files["target"], dflash2["gguf"], prompt)
    ref, ref_logits, ref_out, _, ref_drafts = run(files["target"], dflash2["drafter"], prompt)
    assert isinstance(ours, DFlash2Drafter)
    body = dataclasses.replace(ours.cfg.body, rms_norm_eps=ref.cfg.body.rms_norm_eps)
    layers = ref.cfg.num_target_layers
    assert dataclasses.replace(ours.cfg, body=body, num_target_layers=layers) == ref.cfg
    ours_state, ref_state = ours.state_dict(), ref.state_dict()
    assert ours_state.keys() == ref_state.keys()
    for name, tensor in ours_state.items():
        assert torch.equal(tensor, ref_state[name]), name
    torch.testing.assert_close(ours_logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(ours_drafts, ref_drafts)
    assert ours_out.outputs[0].token_ids == ref_out.outputs[0].token_ids
    assert ours_out.spec_accept_lengths == ref_out.spec_accept_lengths


@pytest.mark.parametrize("key", [*DFLASH2_KEYS, "block_size"])
def test_dflash2_metadata_is_required(dflash2, tmp_path: Path, key: str) -> None:
    from blockdraft.models.gguf_drafter import read_gguf_drafter

    cfg = json.loads(json.dumps(dflash2["config"]))
    del (cfg if key == "block_size" else cfg["dflash_config"])[key]
    path = write_drafter_gguf(tmp_path / "bad.gguf", dflash2["drafter"], cfg)
    with pytest.raises(ValueError, match=f"'dflash.{key}' is missing"):
        read_gguf_drafter(str(path))


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"dflash.sample_from_anchor": True}, "sample_from_anchor"),
        ({"dflash.hyper_connection.count": 4}, "hyper_connection"),
        ({"dflash.logit_scale": 0.5}, "logit_scale"),
        ({"dflash.target_hidden_size": 128}, "target_hidden_size 128"),
    ],
)
def test_unsupported_variants_are_named(files, tmp_path: Path, extra, message) -> None:
    path = write_drafter_gguf(tmp_path / "bad.gguf", files["zlab"], files["config"], extra)
    with pytest.raises(ValueError, match=message):
        LLM(str(files["target"]), speculative_config=spec(path))


@pytest.mark.parametrize(
    "name, message",
    [
        ("blk.0.attn_sinks.weight", "attention sinks"),
        ("selector_successor.weight", "DFlash2 candidate selector without selector_hidden"),
        ("blk.1.attn_conv_base", "DFlash2 convolutions without selector_hidden"),
        ("markov_w1.weight", "DSpark Markov head"),
        ("blk.0.attn_qkv.weight", "not part of a DFlash drafter"),
    ],
)
def test_unsupported_tensors_are_named(files, tmp_path: Path, name: str, message: str) -> None:
    path = write_drafter_gguf(
        tmp_path / "bad.gguf", files["zlab"], files["config"], tensors={name: np.zeros(4)}
    )
    with pytest.raises(ValueError, match=message):
        LLM(str(files["target"]), speculative_config=spec(path))


def test_bad_headers_are_named(files, tmp_path: Path) -> None:
    from blockdraft.models.gguf_drafter import read_gguf_drafter

    cfg = json.loads(json.dumps(files["config"]))
    cfg["dflash_config"]["target_layer_ids"] = [-1, 3]  # written as target_layers [0, 4]
    path = write_drafter_gguf(tmp_path / "layers.gguf", files["zlab"], cfg)
    with pytest.raises(ValueError, match=r"target_layers \[0, 4\] must be >= 1"):
        read_gguf_drafter(str(path))
    w = gguf.GGUFWriter(str(tmp_path / "target.gguf"), "qwen3")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    with pytest.raises(ValueError, match="a DFlash drafter GGUF has 'dflash'"):
        read_gguf_drafter(str(tmp_path / "target.gguf"))
    (tmp_path / "short.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="not a valid GGUF file"):
        read_gguf_drafter(str(tmp_path / "short.gguf"))
