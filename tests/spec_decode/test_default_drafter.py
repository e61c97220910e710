"""The DFlash drafter shipped for the embedded SmolLM2 target: it fits the package budget,
`speculative_config={"model": "default"}` / `--draft default` selects it, speculative output
equals plain decoding, it really accepts drafts, and z-lab's reference loop agrees with ours."""

import json
import random
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from blockdraft import LLM, SamplingParams
from blockdraft.assets import default_drafter_path
from blockdraft.config import EngineConfig
from blockdraft.models.dflash_drafter import DFlashConfig
from blockdraft.models.gguf_loader import default_model_path, load_gguf
from blockdraft.models.registry import resolve_architecture

from checkpoints import zlab_first_draft_logits, zlab_full_block_steps, zlab_generate

DEFAULT_SPEC = {"method": "dflash", "model": "default"}


def random_questions(count: int) -> list[str]:
    rng = random.Random()
    shapes = [
        "What is {a} plus {b}? Explain step by step.",
        "Write a Python function that returns the {a}th Fibonacci number.",
        "Give me {c} tips for learning to cook.",
        "Write a short story about a robot who owns {a} cats.",
    ]
    return [
        rng.choice(shapes).format(
            a=rng.randrange(2, 99), b=rng.randrange(2, 99), c=rng.randrange(3, 9)
        )
        for _ in range(count)
    ]


@pytest.fixture(scope="module")
def target_gguf():
    """The embedded target's checkpoint (config, tokenizer, dequantized tensors), read once."""
    return load_gguf(default_model_path())


@pytest.fixture(scope="module")
def target_hf_dir(tmp_path_factory, target_gguf) -> Path:
    """The default GGUF target written as a transformers checkpoint (for z-lab's loop)."""
    ckpt = target_gguf
    cfg = {k: v for k, v in ckpt.hf_config.items() if k != "architectures"}
    model = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    model.load_state_dict(ckpt.state_dict, strict=False)
    model.tie_weights()
    out = tmp_path_factory.mktemp("smollm2-hf")
    model.save_pretrained(out)
    return out


@pytest.mark.slow
def test_shipped_drafter_fits_the_default_target(target_gguf) -> None:
    path = Path(default_drafter_path())
    assert (path / "model.safetensors").stat().st_size <= 40 * 1024**2
    cfg = DFlashConfig.from_hf(json.loads((path / "config.json").read_text()))
    target = resolve_architecture(target_gguf.hf_config).parse_config(target_gguf.hf_config)
    cfg.check_fits(target)
    assert cfg.block_size == 16


def test_default_drafter_needs_the_default_target(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="default SmolLM2 target"):
        LLM(str(tmp_path), speculative_config=DEFAULT_SPEC)


def test_on_by_default_for_the_default_target_on_the_cpu(tmp_path: Path) -> None:
    """speculative_config="auto" (the default): the shipped drafter for the default target on
    the CPU; nothing for another target, on a GPU, or with random weights; None: off."""
    assert str(EngineConfig().speculative_config.model) == str(default_drafter_path())
    assert EngineConfig(speculative_config=None).speculative_config is None
    assert EngineConfig(model=str(tmp_path)).speculative_config is None
    assert EngineConfig(device="cuda").speculative_config is None
    assert EngineConfig(load_format="dummy").speculative_config is None
    with pytest.raises(ValueError, match="'auto' or None"):
        EngineConfig(speculative_config="fast")


@pytest.mark.slow
def test_lossless_and_accepting() -> None:
    """The default LLM() (the drafter on, up to 3 drafts a step on the CPU) gives plain
    decoding's tokens, and the shipped drafter accepts drafts at 3 a step (pinned: how often
    the default drafts depends on this CPU's step costs)."""
    questions = random_questions(3)
    params = SamplingParams(temperature=0, max_tokens=40)
    chats = [[{"role": "user", "content": q}] for q in questions]
    plain = LLM(max_model_len=512, speculative_config=None).chat(chats, params, use_tqdm=False)
    llm = LLM(max_model_len=512)
    assert llm.engine.num_spec == 3
    fast = llm.chat(chats, params, use_tqdm=False)
    for p, f in zip(plain, fast, strict=True):
        assert f.outputs[0].token_ids == p.outputs[0].token_ids
    three = {**DEFAULT_SPEC, "num_speculative_tokens": 3, "num_speculative_tokens_by_batch": None}
    pinned = LLM(max_model_len=512, speculative_config=three)
    pinned.chat(chats, params, use_tqdm=False)
    # A trained drafter: clearly above the ~1.0 an untrained one gets on real text.
    assert pinned.engine.spec_stats.mean_acceptance_length > 1.15


@pytest.mark.slow
def test_zlab_agrees_on_the_shipped_drafter(target_hf_dir: Path) -> None:
    # z-lab's loop drafts whole blocks over the whole vocabulary: so does the engine with
    # N = block_size - 1 and no token map.
    llm = LLM(
        max_model_len=512,
        speculative_config={
            **DEFAULT_SPEC,
            "num_speculative_tokens": 15,
            "num_speculative_tokens_by_batch": None,
            "token_map": None,
        },
    )
    question = random_questions(1)[0]
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": question}])
    prompt = llm.tokenizer.encode(text, add_special_tokens=False)
    seen: list[torch.Tensor] = []
    drafter = llm.engine.proposer.drafter
    original = drafter.compute_logits
    drafter.compute_logits = lambda h, **kw: seen.append(original(h, **kw)) or seen[-1]
    max_new = 32
    params = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    drafter_dir = Path(default_drafter_path())
    ref_logits = zlab_first_draft_logits(target_hf_dir, drafter_dir, prompt)
    assert ((seen[0] - ref_logits).abs().max() / ref_logits.abs().max()).item() < 1e-4
    ref_tokens, ref_lengths = zlab_generate(target_hf_dir, drafter_dir, prompt, max_new)
    assert out.outputs[0].token_ids == ref_tokens
    full = zlab_full_block_steps(ref_lengths, max_new, block_size=16)
    assert full >= 3
    assert out.spec_accept_lengths[:full] == ref_lengths[:full]
