"""Checks of the tiny-checkpoint builders in tests/checkpoints.py (fast, CPU, float32)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

import dflash.model as zlab
import jinja2
import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from checkpoints import (
    EOS_ID,
    MASK_ID,
    load_hf_target,
    load_zlab_drafter,
    make_dflash_drafter,
    make_llama_checkpoint,
    make_predictable_target,
    make_qwen3_checkpoint,
    make_tokenizer_files,
    predictable_continuation,
    zlab_first_draft_logits,
    zlab_generate,
)

PROMPTS = [[1, 17, 42, 99, 5, 63], [1, 80, 81, 23, 23, 100], [7, 120, 33, 9]]


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    # Tiny matmuls: one thread is faster and immune to a busy machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    out = {
        "qwen3": make_qwen3_checkpoint(root / "qwen3", seed=0),
        "llama": make_llama_checkpoint(root / "llama", seed=1),
        "predictable": make_predictable_target(root / "predictable", seed=2),
    }
    out["drafter"] = make_dflash_drafter(root / "drafter", out["qwen3"], seed=3)
    out["agree"] = make_dflash_drafter(root / "agree", out["predictable"], agree_with_target=True)
    return out


def _greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def test_tokenizer_files(tmp_path: Path) -> None:
    make_tokenizer_files(tmp_path, 32)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tok.get_vocab_size() == 32
    assert [tok.token_to_id(t) for t in ("<pad>", "<bos>", "<eos>", "<mask>", "w4", "w31")] == [
        0,
        1,
        2,
        3,
        4,
        31,
    ]
    assert tok.encode("<bos>w5  w6\nw7<eos>").ids == [1, 5, 6, 7, 2]
    assert tok.decode([1, 5, 6, 7, 2]) == "w5 w6 w7"
    assert tok.decode([5, 6, 2], skip_special_tokens=False) == "w5 w6 <eos>"
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert (cfg["bos_token"], cfg["eos_token"], cfg["pad_token"]) == ("<bos>", "<eos>", "<pad>")
    assert cfg["add_bos_token"] is False
    text = jinja2.Template(cfg["chat_template"]).render(
        messages=[{"role": "user", "content": "w9 w10"}], add_generation_prompt=True
    )
    assert tok.encode(text).ids == [4, 9, 10, 5, 6]


@pytest.mark.parametrize("kind", ["qwen3", "llama", "predictable"])
def test_target_loads_with_transformers(dirs: dict[str, Path], kind: str) -> None:
    path = dirs[kind]
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    gen = json.loads((path / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (1, 2)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["max_position_embeddings"] == 512 and cfg["rope_theta"] == 10000.0
    model = load_hf_target(path)
    prompts = [[t % cfg["vocab_size"] for t in p] for p in PROMPTS]
    with torch.no_grad():
        logits = torch.cat([model(torch.tensor([p])).logits[0] for p in prompts])
    assert torch.isfinite(logits).all()
    assert logits.std(dim=-1).min() > 0.3  # far from uniform
    firsts = {tuple(_greedy(model, p, 4)) for p in prompts}
    assert len(firsts) == len(PROMPTS)  # greedy continuations depend on the prompt


def test_target_configs(dirs: dict[str, Path]) -> None:
    qwen = json.loads((dirs["qwen3"] / "config.json").read_text())
    assert qwen["architectures"] == ["Qwen3ForCausalLM"]
    assert (qwen["head_dim"], qwen["num_key_value_heads"], qwen["rope_scaling"]) == (24, 2, None)
    assert qwen["tie_word_embeddings"] is False
    assert "lm_head.weight" in load_file(dirs["qwen3"] / "model.safetensors")
    llama = json.loads((dirs["llama"] / "config.json").read_text())
    assert llama["architectures"] == ["LlamaForCausalLM"] and llama["tie_word_embeddings"]
    assert llama["rope_scaling"]["rope_type"] == "llama3"
    assert "lm_head.weight" not in load_file(dirs["llama"] / "model.safetensors")
    # The Llama-3 scaling changes the rotary frequencies at this size.
    inv_freq = load_hf_target(dirs["llama"]).model.rotary_emb.inv_freq
    plain = 1.0 / 10000.0 ** (torch.arange(0, 16, 2).float() / 16)
    assert inv_freq[0] == plain[0] and not torch.allclose(inv_freq, plain)


def test_sharded_and_rope_parameters_style(tmp_path: Path) -> None:
    single = make_llama_checkpoint(tmp_path / "single", seed=5, tie_word_embeddings=False)
    sharded = make_llama_checkpoint(
        tmp_path / "sharded",
        seed=5,
        tie_word_embeddings=False,
        shard=True,
        rope_config_style="rope_parameters",
    )
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert not (sharded / "model.safetensors").exists()
    cfg = json.loads((sharded / "config.json").read_text())
    assert "rope_scaling" not in cfg and cfg["rope_parameters"]["rope_type"] == "llama3"
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        a = load_hf_target(single)(ids).logits
        b = load_hf_target(sharded)(ids).logits
    assert torch.equal(a, b)


def test_drafter_layout_and_zlab_load(dirs: dict[str, Path]) -> None:
    cfg = json.loads((dirs["drafter"] / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert (cfg["hidden_size"], cfg["vocab_size"], cfg["num_target_layers"]) == (64, 128, 4)
    assert cfg["block_size"] == 16
    assert cfg["dflash_config"] == {"mask_token_id": 3, "target_layer_ids": [1, 1]}
    names = set(load_file(dirs["drafter"] / "model.safetensors"))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight"} <= names
    assert "layers.1.self_attn.q_norm.weight" in names
    assert not any("embed" in n or "lm_head" in n for n in names)
    model = load_zlab_drafter(dirs["drafter"])
    assert isinstance(model, zlab.DFlashDraftModel)
    assert (model.block_size, model.mask_token_id, model.target_layer_ids) == (16, 3, [1, 1])
    assert model.fc.weight.shape == (64, 128)


def test_zlab_generate_random_drafter(dirs: dict[str, Path]) -> None:
    prompt = PROMPTS[0]
    generated, accepted = zlab_generate(dirs["qwen3"], dirs["drafter"], prompt, 24)
    assert len(generated) == 24 == 1 + sum(accepted)  # the prefill's token is not counted
    assert all(n >= 1 for n in accepted)
    assert generated == _greedy(load_hf_target(dirs["qwen3"]), prompt, 24)  # lossless


def test_first_draft_logits_match_dflash_generate(dirs: dict[str, Path]) -> None:
    seen: list[torch.Tensor] = []
    original: Callable = zlab.DFlashDraftModel.compute_logits

    def record(self: zlab.DFlashDraftModel, hidden: torch.Tensor, head: torch.nn.Module):
        logits = original(self, hidden, head)
        seen.append(logits[0].clone())
        return logits

    prompt = PROMPTS[1]
    with mock.patch.object(zlab.DFlashDraftModel, "compute_logits", record):
        zlab_generate(dirs["qwen3"], dirs["drafter"], prompt, 20)
    logits = zlab_first_draft_logits(dirs["qwen3"], dirs["drafter"], prompt)
    assert logits.shape == (15, 128)
    torch.testing.assert_close(logits, seen[0], rtol=1e-5, atol=1e-5)


def test_predictable_target_follows_its_cycle(dirs: dict[str, Path]) -> None:
    model = load_hf_target(dirs["predictable"])
    for prompt in ([1, 5, 6, 7], [1, 30, 12, 3, 63], [2, 50, 50, 50, 9]):
        assert _greedy(model, prompt, 6) == predictable_continuation(prompt, 6, 64)


def test_agreeing_drafter_accepts_whole_blocks(dirs: dict[str, Path]) -> None:
    prompt = [1, 10, 40, 22, 7, 8]
    generated, accepted = zlab_generate(dirs["predictable"], dirs["agree"], prompt, 100)
    assert generated == predictable_continuation(prompt, 100, 64)
    assert accepted == [16] * 6 + [3]  # 1 + 6 * 16 + 3 = 100: the last block is cut short
    assert sum(accepted) / len(accepted) >= 5
    drafts = zlab_first_draft_logits(dirs["predictable"], dirs["agree"], prompt).argmax(-1)
    assert drafts.tolist() == predictable_continuation(prompt, 16, 64)[1:]


def test_agreeing_drafter_near_max_tokens_and_stop(dirs: dict[str, Path]) -> None:
    target, agree = dirs["predictable"], dirs["agree"]
    prompt = [1, 4]  # continuation: w5 w6 w7 ...
    # verify_size shrinks to max_new_tokens - 1 - committed: 20 = 1 + 16 + 3.
    assert zlab_generate(target, agree, prompt, 20)[1] == [16, 3]
    assert zlab_generate(target, agree, prompt, 1) == ([5], [])
    # A stop token mid-block ends generation right after it (the stop token is kept).
    generated, accepted = zlab_generate(target, agree, prompt, 60, stop_token_ids=[26, EOS_ID])
    assert generated == list(range(5, 27)) and accepted == [16, 5]
    # A stop token as the prefill's token ends generation before any draft step.
    assert zlab_generate(target, agree, prompt, 60, stop_token_ids=[5]) == ([5], [])


@pytest.mark.parametrize("target_kind", ["qwen3", "llama"])
def test_sliding_window_drafter(dirs: dict[str, Path], tmp_path: Path, target_kind: str) -> None:
    drafter = make_dflash_drafter(
        tmp_path / "sliding",
        dirs[target_kind],
        num_layers=3,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        target_layer_ids=[0, 2, 3],
        block_size=8,
        num_heads=2,
        num_kv_heads=1,
        head_dim=32,
        seed=7,
    )
    cfg = json.loads((drafter / "config.json").read_text())
    assert cfg["use_sliding_window"] is True and cfg["sliding_window"] == 4
    assert cfg["layer_types"][0] == "sliding_attention"
    model = load_zlab_drafter(drafter)
    attn = [layer.self_attn for layer in model.layers]
    assert [a.sliding_window for a in attn] == [4, None, 4]
    assert [a.is_causal for a in attn] == [True, False, True]
    generated, accepted = zlab_generate(dirs[target_kind], drafter, PROMPTS[2], 20)
    assert len(generated) == 20 == 1 + sum(accepted) and min(accepted) >= 1
    assert generated == _greedy(load_hf_target(dirs[target_kind]), PROMPTS[2], 20)
    assert zlab_first_draft_logits(dirs[target_kind], drafter, PROMPTS[2]).shape == (7, 128)


def test_agree_requires_predictable_target(dirs: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="make_predictable_target"):
        make_dflash_drafter(tmp_path / "x", dirs["qwen3"], agree_with_target=True)
    assert MASK_ID == 3


def test_agreeing_drafter_with_errors_gives_varied_acceptance(
    dirs: dict[str, Path], tmp_path: Path
) -> None:
    drafter = make_dflash_drafter(
        tmp_path / "noisy",
        dirs["predictable"],
        agree_with_target=True,
        draft_error_rate=0.1,
        seed=0,
    )
    prompt = [1, 10, 20, 30]
    generated, accepted = zlab_generate(dirs["predictable"], drafter, prompt, 100)
    assert generated == predictable_continuation(prompt, 100, 64)  # greedy stays lossless
    assert accepted == [10, 4, 16, 10, 7, 16, 2, 8, 11, 4, 11]  # deterministic given the seed


def test_zlab_last_layer_feature_is_after_final_norm(dirs: dict[str, Path]) -> None:
    # z-lab takes hidden_states[layer_id + 1]; transformers' last entry is the final-normed
    # output, so a drafter listing the target's last layer sees norm(h), not the raw residual.
    model = load_hf_target(dirs["qwen3"])
    raw: list[torch.Tensor] = []
    hook = model.model.layers[-1].register_forward_hook(lambda m, i, o: raw.append(o))
    with torch.no_grad():
        states = model(torch.tensor([PROMPTS[0]]), output_hidden_states=True).hidden_states
    hook.remove()
    last = raw[0][0] if isinstance(raw[0], tuple) else raw[0]
    feature = zlab.extract_context_feature(states, [3])
    torch.testing.assert_close(feature, model.model.norm(last))
