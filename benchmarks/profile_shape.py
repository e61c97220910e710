"""Where a decode step's GPU time goes on a model shape (benchmarks/shapes.py, random bf16
weights): the top kernels of AR steps at each batch size, under the engine's CUDA graphs, and
with `--dflash N` those of DFlash steps (verify 1+N + draft, synthetic acceptance) beside them.

    python -m benchmarks.profile_shape --shape qwen3.5-27b [--batches 1 32] [--top 15]
        [--layers 8]  # the shape's first 8 layers: a 70 GB model's kernels on an 80 GB GPU
        [--dflash 15 --accept 0.8]  # also DFlash steps of 15 drafts
        [--tiny]  # the shape at CPU widths (`BenchShape.shrunk`): a smoke run, no kernels
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import print_table  # noqa: E402
from benchmarks.gpu_bench import dflash_llm, profile_steps  # noqa: E402
from benchmarks.shapes import SHAPES  # noqa: E402
from blockdraft import LLM  # noqa: E402


def main(argv: list[str] | None = None) -> list[list]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3.5-27b")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--layers", type=int, default=None, help="keep the first N layers")
    p.add_argument("--dflash", type=int, default=0, metavar="N",
                   help="also profile DFlash steps of N drafts (0: AR only)")  # fmt: skip
    p.add_argument("--accept", type=float, default=0.8, help="synthetic acceptance per draft")
    p.add_argument("--tiny", action="store_true", help="CPU widths (a smoke run)")
    args = p.parse_args(argv)
    shape = SHAPES[args.shape]
    if args.tiny:
        shape = shape.shrunk(args.layers or 5)
    elif args.layers is not None:
        shape = shape.with_layers(args.layers)
    target, drafter = shape.dirs()
    prompt = torch.randint(4, shape.config["vocab_size"], (args.prompt_len,)).tolist()
    kw = dict(load_format="dummy", max_model_len=args.prompt_len + 256,
              max_num_seqs=max(args.batches))  # fmt: skip
    llm = LLM(str(target), **kw)
    rows = []
    for batch in args.batches:
        rows += profile_steps(llm, prompt, args.steps, f"AR batch {batch}", batch, args.top)
    if args.dflash:
        llm.shutdown()  # memory back before the next engine sizes its caches
        llm = dflash_llm(target, drafter, args.dflash, None, args.accept, kw)
        for batch in args.batches:
            label = f"N={args.dflash} batch {batch}"
            rows += profile_steps(llm, prompt, args.steps, label, batch, args.top)
    llm.shutdown()
    print_table(f"{shape.name}: ms per step", ["steps", "kernel", "ms"], rows)
    return rows


if __name__ == "__main__":
    main()
