"""`triton.jit` options for kernels whose sizes and index tensors change from step to step.

Triton compiles an integer argument of 1, a multiple of 16 and any other value apart, and a
pointer 16-byte aligned or not apart: a batch that first meets another case compiles in the
middle of serving (a step of seconds). Sizes that only bound loops and masks, and index
tensors read element by element (views whose 16-byte alignment the callers do not promise),
gain nothing from it."""

from __future__ import annotations

import inspect

import triton


def unspecialised(sizes: list[str], pointers: list[str]) -> dict[str, list[str]]:
    """Options for `triton.jit(**...)`: neither `sizes` nor the alignment of `pointers` is
    specialised (the latter where this Triton can tell them apart from sizes)."""
    options = {"do_not_specialize": list(sizes)}
    if "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters:
        options["do_not_specialize_on_alignment"] = list(pointers)
    else:
        options["do_not_specialize"] += pointers
    return options
