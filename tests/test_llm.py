"""The Python API: bad input gets a ValueError naming the problem and the engine keeps serving;
seeded sampling is reproducible whatever the batch; stops, aborts and chat behave like vLLM."""

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from blockdraft import LLM, SamplingParams

from checkpoints import make_llama_checkpoint, make_qwen3_checkpoint


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return make_qwen3_checkpoint(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def llm(target: Path) -> LLM:
    return LLM(str(target), max_model_len=64)


def random_prompt(rng: torch.Generator, n: int) -> list[int]:
    return torch.randint(4, 128, (n,), generator=rng).tolist()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-3), "max_tokens"),
        (dict(temperature=-0.5), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(top_k=2**70), "top_k"),
        (dict(min_p=2.0), "min_p"),
        (dict(seed=-1), "seed"),
        (dict(stop=[""]), "stop"),
        (dict(n=2), "n must be 1"),
    ],
)
def test_bad_sampling_params(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_extreme_but_valid_sampling_values_do_not_break_a_batch(llm: LLM, rng) -> None:
    prompts = [random_prompt(rng, 5) for _ in range(3)]
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    extreme = [
        SamplingParams(temperature=1e-30, max_tokens=4, ignore_eos=True),  # treated as greedy
        SamplingParams(temperature=1.0, top_k=2**31 - 1, max_tokens=4, ignore_eos=True, seed=3),
        greedy,
    ]
    outs = llm.generate(prompts, extreme, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == expected[0]
    assert all(0 <= t < 128 for t in outs[1].outputs[0].token_ids)
    assert outs[2].outputs[0].token_ids == expected[2]


def test_bad_prompts_are_rejected_and_engine_keeps_serving(llm: LLM, rng) -> None:
    good = random_prompt(rng, 5)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    before = llm.generate([good], params, use_tqdm=False)[0].outputs[0].token_ids
    bad_cases = [
        ([], "empty"),
        ("", "empty"),
        (random_prompt(rng, 64), "max_model_len"),
        ([5, 10_000], r"token ids must be in \[0, 128\)"),
        ([5, "x"], "integers"),
        (3.5, "string or a list"),
    ]
    for prompt, message in bad_cases:
        with pytest.raises(ValueError, match=message):
            llm.generate([good, prompt], params, use_tqdm=False)
        # The good request submitted in the same call was withdrawn: nothing is left behind.
        assert not llm.engine.has_unfinished_requests()
    after = llm.generate([good], params, use_tqdm=False)[0].outputs[0].token_ids
    assert after == before
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_bad_checkpoints(tmp_path: Path, target: Path) -> None:
    with pytest.raises(ValueError, match="does not exist: give a Hugging Face checkpoint dir"):
        LLM(str(tmp_path / "nope"))
    broken = tmp_path / "broken"
    shutil.copytree(target, broken)
    (broken / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no weights"):
        LLM(str(broken))
    (broken / "model.safetensors").write_bytes(b"\x00" * 100)
    with pytest.raises(ValueError, match="corrupt or unreadable"):
        LLM(str(broken))
    shutil.copy(target / "model.safetensors", broken / "model.safetensors")
    config = json.loads((target / "config.json").read_text())
    gpt2 = {**config, "architectures": ["GPT2LMHeadModel"]}
    (broken / "config.json").write_text(json.dumps(gpt2))
    with pytest.raises(ValueError, match="supported: Qwen3ForCausalLM, LlamaForCausalLM"):
        LLM(str(broken))
    (broken / "config.json").write_text(json.dumps({**config, "hidden_size": 96}))
    with pytest.raises(ValueError, match="shape"):
        LLM(str(broken))
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        LLM(str(broken))


def test_max_model_len_beyond_the_model(target: Path) -> None:
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings"):
        LLM(str(target), max_model_len=100_000)


def test_sharded_llama_checkpoint_loads(tmp_path: Path, rng) -> None:
    single = make_llama_checkpoint(tmp_path / "single", seed=3)
    sharded = make_llama_checkpoint(tmp_path / "sharded", seed=3, shard=True)
    assert (sharded / "model.safetensors.index.json").is_file()
    prompt = random_prompt(rng, 7)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    a = LLM(str(single)).generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    b = LLM(str(sharded)).generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert a == b


def test_seeded_sampling_is_independent_of_batch_mates(llm: LLM, rng) -> None:
    prompt = random_prompt(rng, 6)
    seeded = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=10, seed=1234, ignore_eos=True)
    alone = llm.generate([prompt], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [random_prompt(rng, n) for n in (3, 9, 20)]
    mates = [SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True)] * 3
    batch = llm.generate(
        others[:2] + [prompt] + others[2:], mates[:2] + [seeded] + mates[2:], use_tqdm=False
    )
    assert batch[2].outputs[0].token_ids == alone
    other_seed = SamplingParams(
        temperature=1.0, top_p=0.95, max_tokens=10, seed=99, ignore_eos=True
    )
    assert llm.generate([prompt], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_stop_conditions(llm: LLM, rng) -> None:
    prompt = random_prompt(rng, 8)
    free = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    tokens = llm.generate([prompt], free, use_tqdm=False)[0].outputs[0].token_ids
    stop_id = tokens[5]
    first = tokens.index(stop_id)
    out = llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_id]),
        use_tqdm=False,
    )[0]
    assert out.outputs[0].token_ids == tokens[: first + 1]
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", stop_id)
    tok = llm.tokenizer
    full_text = tok.decode(tokens)
    # Two output tokens' text as the stop string, from the 8th token on: the first pair whose
    # text is in the output (special tokens decode to nothing, so a pair can be empty).
    stop_text = next(
        text
        for i in range(7, len(tokens) - 1)
        if (text := tok.decode(tokens[i : i + 2])) and text in full_text
    )
    out = llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=stop_text),
        use_tqdm=False,
    )[0]
    assert out.outputs[0].text == full_text[: full_text.index(stop_text)]
    assert out.outputs[0].stop_reason == stop_text
    out = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False
    )[0]
    assert out.outputs[0].token_ids == tokens[:3] and out.outputs[0].finish_reason == "length"


def test_eos_ends_generation(llm: LLM, rng) -> None:
    eos = llm.engine.eos_token_ids[0]
    prompts = [random_prompt(rng, 4) for _ in range(20)]
    outs = llm.generate(prompts, SamplingParams(temperature=1.5, max_tokens=30), use_tqdm=False)
    for out in outs:
        ids = out.outputs[0].token_ids
        assert eos not in ids[:-1]
        assert (ids[-1] == eos) == (out.outputs[0].finish_reason == "stop")


def test_abort_frees_blocks(llm: LLM, rng) -> None:
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    engine.add_request("a", random_prompt(rng, 30), params)
    engine.add_request("b", random_prompt(rng, 10), params)
    engine.step()
    engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    engine.abort_request("a")
    while engine.has_unfinished_requests():
        outs = engine.step()
        assert all(o.request_id == "b" for o in outs), [o.request_id for o in outs]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_chat_uses_the_template(llm: LLM, rng) -> None:
    messages = [{"role": "user", "content": "w10 w11 w12"}]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    chat = llm.chat(messages, params, use_tqdm=False)[0]
    text = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert chat.prompt_token_ids == llm.tokenizer.encode(text, add_special_tokens=False)
    plain = llm.generate([chat.prompt_token_ids], params, use_tqdm=False)[0]
    assert chat.outputs[0].token_ids == plain.outputs[0].token_ids
    with pytest.raises(ValueError, match="messages"):
        llm.chat([], params)
    with pytest.raises(ValueError, match="role"):
        llm.chat([{"content": "w5"}], params)


def test_engine_start_reports_its_times(target: Path, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="blockdraft"):
        llm = LLM(str(target), max_model_len=64)
    (line,) = [r.getMessage() for r in caplog.records if "engine ready" in r.getMessage()]
    assert f"engine ready in {llm.engine.load_time_s:.1f} s" in line
    assert "CUDA graphs" not in line  # a CPU engine captures none
