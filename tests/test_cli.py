"""The command line: generate with and without a drafter, and errors as one clear line."""

import json
from pathlib import Path

import pytest

from blockdraft.cli import main

from checkpoints import make_dflash_drafter, make_predictable_target


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
    main(["generate", "w10 w11", "--model", str(target), "--raw", "--max-tokens", "20",
          "--draft", str(drafter), "--num-speculative-tokens", "7"])
    spec = capsys.readouterr().out.splitlines()
    assert spec[0] == plain[0]  # lossless
    assert "speculative decoding:" in spec[2] and "mean acceptance length" in spec[2]
    assert "steps by chosen N" in spec[2]  # the N the engine chose, step by step


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
        main(["generate", "hi", "--model", str(target), "--draft", str(drafter),
              "--num-speculative-tokens", "40"])
    assert exc.value.code == 2
    assert "exceeds the drafter's block_size - 1" in capsys.readouterr().err


def test_speculative_config_json_as_in_vllm(pair, capsys) -> None:
    """`--speculative-config` takes vLLM's JSON (string batch keys included); bad JSON or bad
    fields are one clear error line."""
    target, drafter = pair
    base = ["generate", "w10 w11", "--model", str(target), "--raw", "--max-tokens", "12"]
    main(base)
    plain = capsys.readouterr().out.splitlines()
    spec = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": 5,
            "num_speculative_tokens_by_batch": {"2": 3}}
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
