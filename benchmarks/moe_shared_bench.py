"""AR step time of a hybrid MoE shape with its shared expert run three ways: as one more routed
slot (the default for forwards of up to `KernelPolicy.moe_shared_slot_max_tokens` tokens),
apart with its gate in the router's GEMM (`moe_shared_slot_max_tokens=0`), and apart as
before the stacking (`SparseMoE.fuse_projections` skipped: its own gate GEMM too). Random bf16
weights; the engines take turns, each built afresh per round.

    python benchmarks/moe_shared_bench.py [--layers 8] [--batches 1 8] [--rounds 2] [--steps 30]

`--layers` cuts Qwen3.5-35B-A3B's 40 layers (an 80 GB GPU holds 8-12 of them beside its LM
head); `--tiny` a CPU smoke run on a shrunk shape.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import hardware, print_table  # noqa: E402
from benchmarks.gpu_bench import mean_step_ms  # noqa: E402
from benchmarks.shapes import SHAPES  # noqa: E402
from blockdraft import LLM  # noqa: E402
from blockdraft.kernels.policy import KernelPolicy  # noqa: E402
from blockdraft.layers.moe import SparseMoE  # noqa: E402

MODES = ("slot", "apart", "before stacking")


@contextlib.contextmanager
def stacking(on: bool) -> Iterator[None]:
    """Engines built inside stack their shared experts (on) or keep them as loaded (off)."""
    fuse = SparseMoE.fuse_projections
    if not on:
        SparseMoE.fuse_projections = lambda self: None
    try:
        yield
    finally:
        SparseMoE.fuse_projections = fuse


def build(target: Path, mode: str, max_seqs: int) -> LLM:
    policy = KernelPolicy(moe_shared_slot_max_tokens=0) if mode == "apart" else KernelPolicy()
    with stacking(mode != "before stacking"):
        return LLM(str(target), load_format="dummy", max_model_len=512, max_num_seqs=max_seqs,
                   kernel_policy=policy)  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--tiny", action="store_true", help="a shrunk shape (CPU smoke run)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    shape = SHAPES["qwen3.5-35b-a3b"]
    shape = shape.shrunk(args.layers) if args.tiny else shape.with_layers(args.layers)
    target, _ = shape.dirs()
    prompt = torch.randint(4, shape.config["vocab_size"], (64 if args.tiny else 256,)).tolist()
    times: dict[tuple[str, int], list[float]] = {}
    for rnd in range(args.rounds):
        for mode in MODES if rnd % 2 == 0 else MODES[::-1]:
            llm = build(target, mode, max(args.batches))
            for batch in args.batches:
                mean_step_ms(llm, prompt, batch, 2 if args.tiny else 8)  # warm: graphs, compiles
                times.setdefault((mode, batch), []).append(
                    mean_step_ms(llm, prompt, batch, args.steps)
                )
            llm.shutdown()
            del llm
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    rows = []
    for batch in args.batches:
        base = statistics.median(times[("before stacking", batch)])
        for mode in MODES:
            ms = statistics.median(times[(mode, batch)])
            rows.append([batch, mode, f"{ms:.3f}", f"{ms / base:.3f}"])
    print_table(
        f"{shape.name}, AR step ms (median of {args.rounds} rounds x {args.steps} steps), "
        f"{hardware()}",
        ["batch", "shared expert", "ms", "x before"],
        rows,
    )
    results = {"shape": shape.name, "hardware": hardware(),
               "step_ms": {f"{m} b{b}": v for (m, b), v in times.items()}}  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
