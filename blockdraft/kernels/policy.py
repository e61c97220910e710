"""Every kernel choice that is still a real choice, in one frozen value.

The engine's config holds one `KernelPolicy` (`EngineConfig.kernel_policy`, whose backend comes
from BLOCKDRAFT_KERNELS, see blockdraft/config.py); the engine enters it around its forwards and
sampling (`blockdraft.kernels.forward_context.use_kernel_policy`), and kernels read it there
(`current_kernel_policy()`). Benchmarks A/B a choice with `dataclasses.replace(policy, ...)`.
Each default is the one measured fastest on an H200 (BENCHMARKS.md has the runs).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, fields

BACKENDS = ("auto", "torch", "triton")
# The row counts a CPU linear's path is chosen at (`KernelPolicy.cpu_weight_left_rows`): a
# linear of m rows follows the choice made for the largest count <= m.
CPU_ROW_COUNTS = (1, 2, 3, 4, 8, 16)
# `KernelPolicy.cpu_weight_left_rows` where no CPU engine measured it (small models, tests).
CPU_WEIGHT_LEFT_ROWS = (16,)


def cpu_row_count(rows: int) -> int:
    """The count of CPU_ROW_COUNTS whose choice a linear of `rows` (>= 1) rows follows."""
    return CPU_ROW_COUNTS[bisect.bisect_right(CPU_ROW_COUNTS, rows) - 1]


@dataclass(frozen=True)
class KernelPolicy:
    # "auto": Triton on CUDA when it imports, the torch twins elsewhere; "torch" / "triton"
    # force one (tests, A/B runs; Triton on the CPU needs TRITON_INTERPRET=1).
    backend: str = "auto"
    # Linears of at most this many rows run the skinny GEMM (it only streams the weight); whole
    # steps were as fast or faster with it up to 16 rows (AR batch 8 5.76 -> 5.45 ms).
    skinny_max_rows: int = 16
    # Device type whose linears may take the skinny GEMM: compiled Triton only, since in the
    # interpreter it would crawl through every projection ("cpu": tests).
    skinny_device_type: str = "cuda"
    # Row limit of the skinny GEMM's residual add + RMSNorm prologue: at 16 rows (a batch-1
    # verify) the prologues doubled the step.
    norm_prologue_max_rows: int = 2
    # Row limit of the skinny GEMM's SiLU·mul prologue: at 16 rows the batch-1 DFlash step took
    # 8.45 ms against 6.02.
    silu_mul_prologue_max_rows: int = 2
    # The down projection forms silu(gate) * up in its loads, one launch a layer less (batch-1
    # decode 4.92 -> 4.61 ms with the norm prologue).
    fuse_silu_mul_into_down: bool = True
    # The q/k/v and gate/up skinny GEMMs form the residual add + RMSNorm in their loads, two
    # norm launches a layer less.
    fuse_norm_into_skinny: bool = True
    # Outside autograd the q/k norm + RoPE kernel also stores the step's keys and values, one
    # store launch a layer less (batch-1 DFlash step 6.38 -> 6.27 ms).
    fuse_kv_store_into_rope: bool = True
    # A split-K decode attention merges its splits in its last program instead of a reduce
    # kernel, one launch a layer less.
    fuse_decode_split_merge: bool = True
    # Forwards of at most this many query rows a sequence norm, rotate and store q/k in the
    # attention kernel (0: never); decode only: at 16 rows the batch-8 DFlash step was slower
    # (7.96 vs 7.60-7.73 ms).
    rope_in_attention_max_query_len: int = 1
    # A Gated DeltaNet layer's decode rows (one row a sequence, no verify block) run its whole
    # token mixer (conv, gates, recurrence, gated norm) in one kernel, not ~30 small launches.
    fuse_gated_deltanet_decode: bool = True
    # That kernel splits each value head's dims over more programs until a launch has about
    # this many (one request on a 132-SM GPU has 32-48 heads: a program each); 0: never. Off:
    # on an H100 the 35B-A3B heads' kernel at batch 1 took 10.5 -> 8.4 us (4 parts), but 8
    # layers' AR step 1.016 -> 1.023 ms (within noise).
    gated_deltanet_decode_fill_programs: int = 0
    # A mixture whose shared expert is stacked with its routed ones (`SparseMoE.
    # fuse_projections`) runs it as one more routed slot for forwards of at most this many
    # tokens, and apart (its own GEMMs) above: on an H100, 8 layers of Qwen3.5-35B-A3B shapes,
    # AR step at batch 1 1.133 -> 1.016 ms with the slot, at batch 8 (the grouped experts path)
    # 2.013 -> 2.088.
    moe_shared_slot_max_tokens: int = 2
    # A Gated DeltaNet layer's verify forwards (every sequence a verify block) run its token
    # mixer in one kernel, and the state commit after them in one more per layer (Qwen3.5-27B
    # shapes, DFlash step at batch 1 / 8: 34.9 / 48.0 -> 25.5 / 35.1 ms).
    fuse_gated_deltanet_verify: bool = True
    # Verify blocks of at least this many rows (and at most MAX_CHUNK_ROWS) take that kernel
    # in the delta rule's chunked form (the block's rows as a few matrix products,
    # `triton_gated_deltanet_verify_chunked`) instead of a serial pass over the rows; None: never.
    # Qwen3.5-27B heads on an H100 (`gdn_kernel_bench`): the row kernel costs ~1.4 / 6 / 22 us
    # more per row at batch 1 / 8 / 32, the chunked one is ~flat in rows (16 rows: 29 -> 13,
    # 105 -> 44, 398 -> 179 us); at 4 rows the row kernel is 7-16% faster, at 8 the chunked
    # 25-33%, so the break-even is ~5 rows.
    chunked_gated_deltanet_verify_min_rows: int | None = 6
    # A Gated DeltaNet layer's prefill chunks run the chunked rule in two Triton launches
    # (`triton_chunk_gated_delta_rule`) rather than its torch twin, a loop over the chunks'
    # sequences.
    triton_chunked_prefill: bool = True
    # A DFlash2 drafter's sub-block opening (the kernel projection, then the convolution with
    # its first dynamic kernel) in one kernel (`triton_projected_dynamic_conv`) instead of a
    # GEMM and a convolution. Off: no faster (H100, `conv_projection_bench.py`: 16 rows 9.94 us
    # separate, 10.22 fused at its best options, 15.31 at its defaults; 512 rows 15.3 vs 19.3;
    # `drafter_step_bench.py --fused-conv-projection` DFlash2 / DFlash at batch 1 1.133 -> 1.175).
    fuse_conv_projection: bool = False
    # The counts of CPU_ROW_COUNTS at which CPU linears run as `weight @ x.T` (the weight as
    # the left operand, as stored; one row as two: `layers.linear`) instead of F.linear; a
    # linear of m rows follows the largest count <= m ((16,): every linear of 16 rows or more).
    # Which is faster depends on the CPU's BLAS and its threads: on one host F.linear was 2-4x
    # faster at two rows; on an AMD EPYC its one-row GEMV streams a weight from memory at a
    # third of a two-row `weight @ x.T`'s speed, while on one thread its 16-row GEMM wins.
    # None: a CPU engine measures each count at start (`engine/cpu_linear_plan.py`),
    # CPU_WEIGHT_LEFT_ROWS where it does not.
    cpu_weight_left_rows: tuple[int, ...] | None = None
    # Programmatic dependent launch on devices that have it (compute capability 9.0+).
    pdl: bool = True
    # PDL only in forwards of at most this many query rows a request: it pays in decode steps
    # (8B batch 1 4.45 -> 4.34 ms) and costs in 16-row verify steps (6.08 vs 6.02 ms).
    pdl_max_query_len: int = 1

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {self.backend!r}")
        if self.skinny_device_type not in ("cuda", "cpu"):
            raise ValueError(
                f"skinny_device_type must be 'cuda' or 'cpu', got {self.skinny_device_type!r}"
            )
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "bool" and not isinstance(value, bool):
                raise ValueError(f"{f.name} must be True or False, got {value!r}")
            if f.type == "int" and (
                isinstance(value, bool) or not isinstance(value, int) or value < 0
            ):
                raise ValueError(f"{f.name} must be an integer >= 0, got {value!r}")
        rows = self.chunked_gated_deltanet_verify_min_rows
        if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 1):
            raise ValueError(
                "chunked_gated_deltanet_verify_min_rows must be an integer >= 1 or None, "
                f"got {rows!r}"
            )
        counts = self.cpu_weight_left_rows
        if counts is not None and (
            not isinstance(counts, tuple)
            or any(isinstance(m, bool) or m not in CPU_ROW_COUNTS for m in counts)
            or list(counts) != sorted(set(counts))
        ):
            raise ValueError(
                f"cpu_weight_left_rows must be None or an ascending tuple of distinct counts "
                f"from {CPU_ROW_COUNTS}, got {counts!r}"
            )
