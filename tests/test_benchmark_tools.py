"""Shared benchmark tools (benchmarks/common.py) that do not need a GPU to be checked."""

from types import SimpleNamespace

import pytest

from benchmarks.common import TritonCompileLog


def test_triton_compile_log_records_kernels_only_inside_timed_phases() -> None:
    knobs = pytest.importorskip("triton.knobs")
    before = knobs.runtime.jit_post_compile_hook
    log = TritonCompileLog()
    try:
        assert log.installed and knobs.runtime.jit_post_compile_hook == log._hook
        kernel = SimpleNamespace(name="_paged_attention_kernel")
        log._hook(key=1, fn=kernel, repr="untimed")  # a warm-up compile: not a stall
        with log.timed("c. SD conc 4"):
            log._hook(key=2, fn=kernel)
            log._hook(key=3, fn=SimpleNamespace(name="_rms_norm_kernel"))
        log._hook(key=4, fn=kernel)
        assert log.by_phase() == {"c. SD conc 4": ["_paged_attention_kernel", "_rms_norm_kernel"]}
        with pytest.raises(RuntimeError), log.timed("b. AR step 1"):
            raise RuntimeError  # the phase ends with the block, even on an error
        assert log.phase is None
    finally:
        knobs.runtime.jit_post_compile_hook = before


def test_host_ops_counts_eager_ops_outside_the_graphed_forwards(capsys) -> None:
    from benchmarks import host_ops

    rows = host_ops.main(["--steps", "3", "--num-drafts", "3"])["rows"]
    ops = {(r["engine"], r["temperature"]): r for r in rows}
    assert 0 < ops["AR", 0.0]["ops_per_step"] < ops["DFlash", 0.0]["ops_per_step"]
    # Sampling at T = 1 hashes its random numbers: more ops than the greedy argmax.
    assert ops["AR", 1.0]["ops_per_step"] > ops["AR", 0.0]["ops_per_step"]
    sites = {s for r in rows for s in r["by_site"]}
    assert "rejection_sampler.rejection_sample" in sites
    # The MLP only runs inside the forwards that CUDA graphs capture: never counted.
    assert not any(s.startswith("decoder.down") for s in sites)
    assert "eager ops per step" in capsys.readouterr().out
