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
