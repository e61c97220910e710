"""Triton kernels compiled for a GPU that is not here: the registers, spills and shared memory
of each kernel a case launches, at a model's shapes.

Each case calls the kernels' own Python wrappers with CPU tensors; their launches only compile
(Triton's JIT with a stand-in driver that names the target, and `warmup`: nothing runs, the
outputs stay empty). The compiled binary's resource line (`cuobjdump -res-usage`, shipped in
Triton's wheel) gives registers and stack (spills, bytes a thread); Triton's metadata the
shared memory; a digest of its SASS instructions (`cuobjdump -sass`, addresses dropped) tells
whether a refactor changed the machine code (run the tool at both revisions). So a kernel
variant's spills can be read, a compile error that the CPU tests' interpreter cannot see
caught, and a refactor shown to leave a timed kernel as it was, without a GPU. Speed still
needs one.

Cases (`--groups`): `gdn`, the Gated DeltaNet decode, verify (the row kernel, and the chunked
form at each value block and warp count) and commit kernels at Qwen3.5-27B heads (`--tiny`:
small heads); `dflash2`, a DFlash2 drafter step's own kernels at Qwen3-8B shapes (z-lab's
published fields: conv kernel 2, groups of 16, selector rank 256, top-16): the kernel
projection's skinny GEMM, the dynamic conv, the two fused into one (`fuse_conv_projection`),
the conv + residual + RMSNorm, the top-K over the vocabulary and the candidate walk, for one
block of 16 rows; `prefill`, the chunked delta
rule's three kernels (a prefill chunk of Gated DeltaNet layers) for batches of 1, 15, 16 and 33
sequences, and the padded recurrence of the decode rows and verify blocks beside them at 1, 5
and 16 rows. Last, the compiles each kernel took over all cases: the prefill kernels must take
one for every number of sequences and the recurrence one for every width (a new one
mid-serving stalls a step for seconds).

    python -m benchmarks.kernel_resources [--arch 90] [--groups gdn dflash2 prefill] [--tiny]
"""

from __future__ import annotations

import os

# The interpreter (which the tests turn on) has no compiler: this must precede Triton's import.
os.environ.pop("TRITON_INTERPRET", None)

import argparse  # noqa: E402
import hashlib  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver, jit  # noqa: E402

from benchmarks.common import DFLASH2_FIELDS, print_table  # noqa: E402
from benchmarks.gdn_kernel_bench import HEADS, layer_inputs, verify_inputs  # noqa: E402

CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


class _TargetOnlyDriver:
    """What Triton's JIT asks of a driver before it launches: a device, a stream, a target."""

    def __init__(self, target: GPUTarget) -> None:
        self.target = target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return self.target


@contextmanager
def compile_only(arch: int) -> Iterator[list[tuple[str, object]]]:
    """Every Triton launch inside compiles for sm_`arch` and runs nothing; yields the list of
    (kernel name, compiled kernel) it fills."""
    compiled: list[tuple[str, object]] = []
    launch = jit.JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):  # noqa: ANN001, ANN202 (Triton's signature)
        kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append((self.fn.__name__, kernel))
        return kernel

    before = driver._active  # DriverConfig has no public getter that would not probe for a GPU
    driver.set_active(_TargetOnlyDriver(GPUTarget("cuda", arch, 32)))
    jit.JITFunction.run = run
    try:
        yield compiled
    finally:
        jit.JITFunction.run = launch
        driver.set_active(before)


def cuobjdump(kernel: object, flag: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run(
            [str(CUOBJDUMP), flag, f.name], capture_output=True, text=True, check=True
        ).stdout


def resources(kernel: object) -> dict[str, int | str]:
    """registers, stack (spilled bytes a thread), shared memory (bytes) and a digest of the
    SASS instructions of a compiled kernel."""
    usage = cuobjdump(kernel, "-res-usage")
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    if found is None:
        raise RuntimeError(f"no resource line in cuobjdump's output:\n{usage}")
    # Instruction lines read "        /*0a70*/  FFMA R3, R4, R5, R3 ;  /* 0x... */": the address
    # and the encoding go, so only the instructions count.
    instructions = re.findall(r"/\*[0-9a-f]{4,}\*/\s+([^;]+;)", cuobjdump(kernel, "-sass"))
    digest = hashlib.sha1("\n".join(instructions).encode()).hexdigest()[:10]
    return {"registers": int(found[1]), "stack": int(found[2]), "shared": kernel.metadata.shared,
            "sass": digest}  # fmt: skip


def gdn_cases(heads: tuple, batch: int, rows: int) -> dict[str, Callable[[], object]]:
    """The Gated DeltaNet kernels' launches at these heads, bf16, on CPU tensors."""
    from blockdraft.kernels.triton_gated_deltanet_step import triton_gated_deltanet_decode
    from blockdraft.kernels.triton_gated_deltanet_verify import (
        triton_gated_deltanet_commit,
        triton_gated_deltanet_verify,
    )
    from blockdraft.kernels.triton_gated_deltanet_verify_chunk import (
        triton_gated_deltanet_verify_chunked,
    )

    cpu, dtype = torch.device("cpu"), torch.bfloat16
    decode_inputs = layer_inputs(heads, batch, batch + 1, cpu, dtype)
    projections, weights, pools, block = verify_inputs(heads, batch, rows, cpu, dtype)
    slots, fresh = block[:2]
    verify_args = (*projections, *weights, *pools, *block)
    cases = {
        "decode": lambda: triton_gated_deltanet_decode(
            *decode_inputs[0], *decode_inputs[1], *decode_inputs[2], slots, fresh
        ),
        f"verify {rows} rows": lambda: triton_gated_deltanet_verify(*verify_args),
    }
    for block_v in (32, 64):
        for warps in (4, 8):
            cases[f"verify {rows} rows, chunked, {block_v} value dims, {warps} warps"] = (
                lambda bv=block_v, w=warps: triton_gated_deltanet_verify_chunked(
                    *verify_args, block_v=bv, num_warps=w
                )
            )
    cases["commit"] = lambda: triton_gated_deltanet_commit(
        heads[0], *pools, slots, torch.full((batch,), rows)
    )
    return cases


def dflash2_cases(rows: int) -> dict[str, Callable[[], object]]:
    """A DFlash2 drafter step's kernels for one block of `rows` rows at Qwen3-8B shapes, bf16,
    on CPU tensors."""
    from blockdraft.kernels.triton_candidate_walk import triton_candidate_walk
    from blockdraft.kernels.triton_dynamic_conv import (
        triton_conv_rms_norm,
        triton_grouped_dynamic_causal_conv,
        triton_projected_dynamic_conv,
    )
    from blockdraft.kernels.triton_linear import skinny_linear
    from blockdraft.kernels.triton_top_k import triton_top_k

    hidden, vocab, dtype = 4096, 151936, torch.bfloat16
    taps, rank, top_k = (DFLASH2_FIELDS[k] for k in ("conv_kernel_size", "selector_rank",
                                                      "selector_top_k"))  # fmt: skip
    groups = hidden // DFLASH2_FIELDS["conv_group_size"]
    x = torch.zeros(rows, hidden, dtype=dtype)
    projection = torch.zeros(2 * taps * groups, hidden, dtype=dtype)
    dynamic = torch.zeros(rows, taps, groups, dtype=dtype)
    base = torch.zeros(taps, hidden, dtype=dtype)
    drafts = rows - 1
    codebook = torch.zeros(vocab, rank, dtype=dtype)
    one = torch.zeros(1, dtype=torch.int64)
    return {
        "kernel projection": lambda: skinny_linear(x, projection),
        "dynamic conv": lambda: triton_grouped_dynamic_causal_conv(x, dynamic, base, rows),
        "projection + conv (fused)": lambda: triton_projected_dynamic_conv(
            x, projection, base, rows
        ),
        "conv + RMSNorm": lambda: triton_conv_rms_norm(
            x, dynamic, base, rows, torch.ones(hidden, dtype=dtype), 1e-6, x
        ),
        "top-K": lambda: triton_top_k(torch.zeros(drafts, vocab, dtype=dtype), top_k),
        "candidate walk": lambda: triton_candidate_walk(
            torch.zeros(1, drafts, rank, dtype=dtype),
            torch.zeros(1, drafts, top_k),
            torch.zeros(1, drafts, top_k, dtype=torch.int64),
            one,
            codebook,
            codebook,
            torch.zeros(1),
            one,
            one,
            0,
        ),  # fmt: skip
    }


# Prefill batches of these many sequences: one, and either side of the sequence lookup's tile.
PREFILL_SEQUENCES = (1, 15, 16, 33)


def prefill_cases(heads: tuple) -> dict[str, Callable[[], object]]:
    """The chunked rule's launches for prefill batches of PREFILL_SEQUENCES sequences of 20
    tokens, q / k / v as views of one conv output (the layer's strides), bf16, on CPU tensors."""
    from blockdraft.kernels.triton_chunk_gated_delta_rule import triton_chunk_gated_delta_rule

    hk, hv, dk, dv = heads[:4]
    dtype = torch.bfloat16

    def launch(p: int) -> object:
        n = 20 * p
        mixed = torch.zeros(n, 2 * hk * dk + hv * dv, dtype=dtype)
        q, k, v = mixed.split((hk * dk, hk * dk, hv * dv), dim=-1)
        g, beta = torch.zeros(n, hv), torch.zeros(n, hv, dtype=dtype)
        cu_seqlens = torch.arange(0, n + 1, 20, dtype=torch.int32)
        return triton_chunk_gated_delta_rule(
            q.view(n, hk, dk), k.view(n, hk, dk), v.view(n, hv, dv), g, beta,
            torch.zeros(p, hv, dk, dv), cu_seqlens,
        )  # fmt: skip

    return {f"prefill, {p} sequences": lambda p=p: launch(p) for p in PREFILL_SEQUENCES}


# A mixed step's padded recurrence (decode rows and verify blocks beside a prefill): its width
# and, through its per-sequence slices of one host transfer, its index tensors' alignment.
MIXED_WIDTHS = (1, 5, 16)


def mixed_step_cases(heads: tuple) -> dict[str, Callable[[], object]]:
    """The padded recurrence for 3 sequences at MIXED_WIDTHS rows, each with its lengths at
    another offset of one int64 tensor (16-byte aligned or not), bf16, on CPU tensors."""
    from blockdraft.kernels.triton_gated_delta_rule import triton_recurrent_gated_delta_rule

    hk, hv, dk, dv = heads[:4]
    dtype, s = torch.bfloat16, 3

    def launch(width: int, offset: int) -> object:
        q = torch.zeros(s, width, hk, dk, dtype=dtype)
        v = torch.zeros(s, width, hv, dv, dtype=dtype)
        gate = torch.zeros(s, width, hv)
        host = torch.ones(offset + s, dtype=torch.int64)
        slots = torch.arange(s)
        fresh = torch.zeros(s, dtype=torch.bool)
        return triton_recurrent_gated_delta_rule(
            q, q, v, gate, gate.to(dtype), torch.zeros(s, hv, dk, dv), slots, fresh,
            host[offset:], fresh,
        )  # fmt: skip

    return {
        f"mixed step, {w} rows, lengths at +{8 * i} bytes": lambda w=w, i=i: launch(w, i)
        for i, w in enumerate(MIXED_WIDTHS)
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100/H200)")
    p.add_argument("--shape", choices=sorted(HEADS), default="qwen3.5-27b")
    p.add_argument("--tiny", action="store_true", help="tiny heads")
    p.add_argument("--rows", type=int, default=16, help="rows of a verify or draft block")
    groups = ["gdn", "dflash2", "prefill"]
    p.add_argument("--groups", nargs="+", choices=groups, default=groups)
    args = p.parse_args(argv)
    heads = HEADS["tiny" if args.tiny else args.shape]
    cases: dict[str, Callable[[], object]] = {}
    if "gdn" in args.groups:
        cases |= gdn_cases(heads, 1, args.rows)
    if "dflash2" in args.groups:
        cases |= {f"DFlash2 {k}": v for k, v in dflash2_cases(args.rows).items()}
    if "prefill" in args.groups:
        cases |= prefill_cases(heads) | mixed_step_cases(heads)
    rows = []
    variants: dict[str, set[int]] = {}  # kernel -> its compiled binaries (the JIT's cache hits)
    for case, launch in cases.items():
        with compile_only(args.arch) as compiled:
            launch()
        for name, kernel in compiled:
            use = resources(kernel)
            rows.append([case, name, *use.values()])
            variants.setdefault(name, set()).add(id(kernel))
    print_table(
        f"Triton kernels compiled for sm_{args.arch}, bf16; Gated DeltaNet heads "
        f"{heads[:4]}, conv {heads[4]}; stack: spilled bytes a thread",
        ["case", "kernel", "registers", "stack", "shared", "sass"],
        rows,
    )
    print("compiles: " + ", ".join(f"{name} {len(ids)}" for name, ids in variants.items()))


if __name__ == "__main__":
    main()
