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
