"""The command line: generate with and without a drafter, and errors as one clear line."""

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
