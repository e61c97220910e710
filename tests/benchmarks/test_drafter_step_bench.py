"""benchmarks/drafter_step_bench.py: the DFlash2-vs-DFlash drafter step table, on a tiny shape
on the CPU (the H200 runs it at Qwen3-8B shapes)."""

from benchmarks.drafter_step_bench import main


def test_drafter_step_bench_times_both_drafters(capsys) -> None:
    argv = ["--tiny", "--steps", "1", "--batches", "1", "2", "--context-len", "40"]
    rows = main([*argv, "--block", "8", "--temperatures", "0", "0.7"])
    assert [(r[0], r[1]) for r in rows] == [(1, "0"), (1, "0.7"), (2, "0"), (2, "0.7")]
    assert all(float(r[2]) > 0 and float(r[3]) > 0 and float(r[4]) > 0 for r in rows)
    out = capsys.readouterr().out
    assert "DFlash2/DFlash" in out and "block 8" in out


def test_fused_conv_projection_column_runs_the_fused_opening(capsys, monkeypatch) -> None:
    from blockdraft.kernels import select

    calls = []
    real = select.projected_dynamic_conv_torch

    def counting(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(select, "projected_dynamic_conv_torch", counting)
    argv = ["--tiny", "--steps", "1", "--batches", "1", "--context-len", "24", "--block", "4"]
    rows = main([*argv, "--temperatures", "0", "--fused-conv-projection"])
    assert len(rows) == 1 and len(rows[0]) == 7 and all(float(v) > 0 for v in rows[0][2:])
    # 2 tiny layers x 2 sub-blocks, for warm-up and timed steps of the fused engine only
    assert calls and len(calls) % 4 == 0
    assert "DFlash2 fused/DFlash" in capsys.readouterr().out
