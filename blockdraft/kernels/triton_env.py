"""What this process's Triton can do: installed or not, compiled or interpreted."""

from __future__ import annotations

import functools
import importlib.util


@functools.cache  # find_spec searches sys.path: once per process, not per call
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_interpreting() -> bool:
    """Whether Triton kernels run in its CPU interpreter (TRITON_INTERPRET=1, through Triton's
    own knob, which reads the environment when asked)."""
    if not triton_available():
        return False
    import triton

    return bool(triton.knobs.runtime.interpret)
