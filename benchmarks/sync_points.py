"""Where engine steps make the host wait for the GPU, by call site (a GPU).

A step should wait for the GPU once, at its readback (`ModelRunner.finish`, an event). Any
other synchronising call (a copy from pageable host memory, `.item()`, `nonzero`) holds the host
until every kernel queued before it has run: a decode step launched ahead (async decode) then
stops overlapping the one before, and the drafter's work stops overlapping the host's
bookkeeping, and step times are charged to the wrong step (the draft-length chooser reads
them). This runs an engine on a shape's random weights under
`torch.cuda.set_sync_debug_mode("warn")` and prints, for each kind of step (plain decode; DFlash
at N = 7; DFlash at N = 0 through the decode-ahead pipeline), each synchronising call site: the
innermost blockdraft frame and the engine method above it, with its calls a step.

    python -m benchmarks.sync_points [--shape qwen3-8b] [--batch 8] [--steps 20]
"""

from __future__ import annotations

import argparse
import sys
import traceback
import warnings
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import print_table  # noqa: E402
from benchmarks.shapes import SHAPES  # noqa: E402
from blockdraft import LLM, SamplingParams  # noqa: E402

PACKAGE = f"{Path(__file__).resolve().parent.parent / 'blockdraft'}/"


def call_site(stack: list[traceback.FrameSummary]) -> str:
    """The innermost blockdraft frame of `stack` (file:line function), and the outermost
    engine method it runs under."""
    ours = [f for f in stack if f.filename.startswith(PACKAGE)]
    if not ours:
        return "outside blockdraft"
    inner, outer = ours[-1], ours[0]
    where = f"{inner.filename.removeprefix(PACKAGE)}:{inner.lineno} {inner.name}"
    return where if outer is inner else f"{where} (under {outer.name})"


@contextmanager
def synchronising_calls() -> Iterator[Counter]:
    """Counts the synchronising CUDA calls made inside, by `call_site`."""
    sites: Counter = Counter()

    def record(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001
        sites[call_site(traceback.extract_stack()[:-1])] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield sites
        finally:
            torch.cuda.set_sync_debug_mode("default")


def engines(accept: float) -> list[tuple[str, dict | None]]:
    """(label, speculative_config) of each kind of step; the drafter's path is filled in."""
    fixed = {
        "method": "dflash",
        "num_speculative_tokens": 7,
        "num_speculative_tokens_by_batch": None,
        "synthetic_acceptance_rate": accept,
    }
    never = {**fixed, "num_speculative_tokens_by_batch": {1: 0}}  # N = 0 at every batch size
    return [("AR decode", None), ("DFlash, N = 7", fixed), ("DFlash, N = 0", never)]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=20, help="steps watched, after as many unwatched")
    p.add_argument("--accept", type=float, default=0.8)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("sync_points.py needs a CUDA device (the CPU has no stream to wait for)")
    target, drafter = SHAPES[args.shape].dirs()
    prompt = torch.randint(1000, 30_000, (64,)).tolist()
    rows = []
    for label, spec in engines(args.accept):
        if spec is not None:
            spec = {**spec, "model": str(drafter)}
        llm = LLM(str(target), load_format="dummy", max_model_len=1024,
                  max_num_seqs=args.batch, speculative_config=spec)  # fmt: skip
        engine = llm.engine
        params = SamplingParams(temperature=0, max_tokens=600, ignore_eos=True)
        for i in range(args.batch):
            engine.add_request(f"r{i}", prompt, params)
        for _ in range(args.steps):  # admission, then the steady steps
            engine.step()
        with synchronising_calls() as sites:
            for _ in range(args.steps):
                engine.step()
        rows += [[label, site, count / args.steps] for site, count in sites.most_common()]
        if not sites:
            rows.append([label, "none", 0.0])
        llm.shutdown()
    print_table(
        f"{args.shape}, batch {args.batch}: synchronising calls a step ({args.steps} steps)",
        ["steps", "call site", "calls a step"],
        rows,
    )


if __name__ == "__main__":
    main()
