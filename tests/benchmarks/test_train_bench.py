"""benchmarks/train_bench.py on a tiny random target, DFlash and DFlash2: it runs, reports what
it says, and the two loss paths (float32 and the fused kernel, interpreted here) start from the
same loss."""

import json
import math
import sys
from pathlib import Path

import pytest

from benchmarks import train_bench
from blockdraft.train.trainer import TrainConfig


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
def test_train_bench_tiny(tmp_path: Path, monkeypatch, capsys, arch: str) -> None:
    out = tmp_path / "bench.json"
    argv = [
        "train_bench",
        "--tiny",
        "--batch-sizes",
        "2",
        "--steps",
        "1",
        "--warmup",
        "1",
        "--anchors",
        "8",
        "--prompt-len",
        "32",
        "--response-len",
        "24",
        "--loss",
        "both",
        "--json",
        str(out),
        "--arch",
        arch,
    ]
    monkeypatch.setattr(sys, "argv", argv)
    train_bench.main()
    report = json.loads(out.read_text())
    runs = {r["loss_path"]: r for r in report["runs"]}
    assert set(runs) == {"float32", "fused"}
    for r in runs.values():
        assert r["batch_size"] == 2 and r["ms_per_step"] > 0 and math.isfinite(r["first_step_loss"])
    # Same seed, same sequences, same random target: the first step's loss is the same math.
    assert runs["fused"]["first_step_loss"] == pytest.approx(
        runs["float32"]["first_step_loss"], rel=1e-4
    )
    assert report["arch"] == arch
    assert f"3-layer {arch} drafter" in capsys.readouterr().out


def test_load_format_is_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="load_format"):
        TrainConfig(out_dir=str(tmp_path), data="d", device="cpu", load_format="random")
