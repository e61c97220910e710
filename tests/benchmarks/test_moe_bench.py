"""benchmarks/moe_bench.py runs on the CPU at its tiny shape (the Triton path interpreted)."""

import pytest

pytest.importorskip("triton")


@pytest.mark.slow
def test_moe_bench_tiny_times_both_paths_and_counts_expert_bytes(capsys) -> None:
    from benchmarks import moe_bench

    rows = moe_bench.main(["--tiny", "--reps", "1"])
    assert [r["tokens"] for r in rows] == moe_bench.TINY_TOKENS
    assert {r["path"] for r in rows} == {"decode", "grouped"}
    hidden, experts, top_k, inter, _ = moe_bench.TINY
    for r in rows:
        assert r["max_rel_err"] < 1e-4
        assert 1 <= r["distinct"] <= min(experts, r["tokens"] * top_k)
        assert r["expert_MB"] == pytest.approx(r["distinct"] * 3 * hidden * inter * 4 / 1e6)
        assert r["triton_ms"] > 0 and r["GB_s"] > 0
    assert "GB/s" in capsys.readouterr().out


def test_expected_distinct_experts() -> None:
    from benchmarks.moe_bench import expected_distinct

    assert expected_distinct(128, 8, 1) == pytest.approx(8)
    assert expected_distinct(4, 4, 3) == pytest.approx(4)
    # Two tokens: 8 + 8 * (120 / 128) distinct on average.
    assert expected_distinct(128, 8, 2) == pytest.approx(8 + 8 * 120 / 128)
