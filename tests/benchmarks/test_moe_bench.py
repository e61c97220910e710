"""benchmarks/moe_bench.py runs on the CPU at its tiny shape (the Triton path interpreted)."""

import pytest

pytest.importorskip("triton")


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["qwen3-30b-a3b", "qwen3.5-35b-a3b"])
def test_moe_bench_tiny_times_both_paths_and_counts_expert_bytes(capsys, shape: str) -> None:
    """Both paths at tiny widths; with 35B-A3B's shared expert as a slot, every token also
    reads that expert (one more distinct, always)."""
    from benchmarks import moe_bench

    rows = moe_bench.main(["--tiny", "--shape", shape, "--reps", "1"])
    assert [r["tokens"] for r in rows] == moe_bench.TINY_TOKENS
    assert {r["path"] for r in rows} == {"decode", "grouped"}
    hidden, experts, top_k, inter, _ = moe_bench.TINY
    shared = int(moe_bench.SHARED[shape])
    for r in rows:
        assert r["max_rel_err"] < 1e-4
        assert 1 + shared <= r["distinct"] <= min(experts, r["tokens"] * top_k) + shared
        assert r["expected_distinct"] == pytest.approx(
            moe_bench.expected_distinct(experts, top_k, r["tokens"]) + shared
        )
        assert r["expert_MB"] == pytest.approx(r["distinct"] * 3 * hidden * inter * 4 / 1e6)
        assert r["triton_ms"] > 0 and r["GB_s"] > 0
    assert "GB/s" in capsys.readouterr().out


def test_expected_distinct_experts() -> None:
    from benchmarks.moe_bench import expected_distinct

    assert expected_distinct(128, 8, 1) == pytest.approx(8)
    assert expected_distinct(4, 4, 3) == pytest.approx(4)
    # Two tokens: 8 + 8 * (120 / 128) distinct on average.
    assert expected_distinct(128, 8, 2) == pytest.approx(8 + 8 * 120 / 128)
