"""Eager tensor ops per engine step outside the captured forwards, on the CPU.

On a GPU the target's and the drafter's forwards replay CUDA graphs; every other tensor op of
a step is an eager launch the host pays for (a few microseconds each), which is what bounds a
small target's step. This counts them on the CPU with a tiny random Qwen3 target and drafter
(`load_format="dummy"`), per call site, for the AR and the DFlash step at T = 0 and T = 1, with
the graphs' CPU twins captured as the engine captures CUDA graphs on a GPU: whatever a replay
runs (the forwards, and the drafter's context K/V write on steady steps) is not counted.
Views count as ops here although they launch nothing, and on a GPU some sites run one Triton
kernel where the CPU runs their torch twin (`kernels/select.py`): read the sites, not the
total, as the launch budget.

    python benchmarks/host_ops.py [--steps 20] [--num-drafts 15] [--target qwen3.5] [--json o.json]

`--target qwen3.5`: a tiny hybrid target (Gated DeltaNet and gated attention), whose drafting
step also commits the requests' states.

`--time`: also the host's own time a step, with the graphs' replays skipped (their outputs
stay as captured): plain decoding against a speculative engine whose N is pinned to 0, both
with async decode, and a drafting step (N as `--num-drafts`), taking turns. On a GPU a small
target's step is bound by this time, so the first difference is what keeping a drafter costs
there; a large target's drafting steps are synchronous, so their host time leaves the GPU idle
between them. Medians of `--passes` passes of
`--time-steps` steps each; on a shared 2-vCPU host runs of one build moved by ~20 us, as much
as the difference: read it on a quiet host.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import print_table, write_dummy_drafter  # noqa: E402
from blockdraft import LLM, SamplingParams  # noqa: E402
from blockdraft.models.dflash_drafter import DFlashDrafter  # noqa: E402
from blockdraft.models.llama import DecoderLM  # noqa: E402
from blockdraft.runtime.cuda_graph_runner import EagerGraph  # noqa: E402

TINY_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
}
# The hybrid family (Qwen3.5 / 3.6 / 3.8): three Gated DeltaNet layers to one gated attention,
# whose verify also commits each request's recurrent and conv states at its accepted length.
TINY_QWEN3_5 = {
    **TINY_QWEN3,
    "architectures": ["Qwen3_5ForCausalLM"],
    "model_type": "qwen3_5_text",
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
    },
}
TARGETS = {"qwen3": TINY_QWEN3, "qwen3.5": TINY_QWEN3_5}


class OpCounter(TorchDispatchMode):
    """Counts aten ops by the innermost blockdraft frame that issued them, skipping those
    issued inside the forwards that CUDA graphs capture (`graphed`)."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0  # > 0 while a graphed forward runs
        self.sites: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if not self.depth:
            frames = [f for f in traceback.extract_stack() if "/blockdraft/" in f.filename]
            where = frames[-1] if frames else None
            site = f"{Path(where.filename).stem}.{where.name}" if where else "?"
            self.sites[site] += 1
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def graphed(self) -> Iterator[None]:
        """While active, the forwards of the target and the drafter, and whatever a graph
        replay (its CPU twin) runs, are not counted."""
        originals = {
            (DecoderLM, "forward"): DecoderLM.forward,
            (DFlashDrafter, "forward"): DFlashDrafter.forward,
            (EagerGraph, "replay"): EagerGraph.replay,
        }

        def wrap(method):  # noqa: ANN001, ANN202
            def uncounted(obj, *args, **kwargs):  # noqa: ANN001, ANN202
                self.depth += 1
                try:
                    return method(obj, *args, **kwargs)
                finally:
                    self.depth -= 1

            return uncounted

        for (cls, name), method in originals.items():
            setattr(cls, name, wrap(method))
        try:
            yield
        finally:
            for (cls, name), method in originals.items():
                setattr(cls, name, method)


def count_step_ops(
    llm: LLM, temperature: float, steps: int, requests: int = 1
) -> collections.Counter[str]:
    """Ops per call site over `steps` decode (or speculative) steps of `requests` requests."""
    engine = llm.engine
    params = SamplingParams(temperature=temperature, seed=1, max_tokens=10_000, ignore_eos=True)
    for i in range(requests):
        engine.add_request(f"probe{i}", list(range(5 + i, 45)), params)
    for _ in range(4):  # prefill and a few steps first: the counted steps are steady ones
        engine.step()
    counter = OpCounter()
    with counter.graphed(), counter:
        for _ in range(steps):
            engine.step()
    for i in range(requests):
        engine.abort_request(f"probe{i}")
    while engine.has_unfinished_requests():  # a step launched ahead
        engine.step()
    return counter.sites


@contextlib.contextmanager
def replays_skipped() -> Iterator[None]:
    """Graph replays (their CPU twins) do nothing: a step costs only the host's own work."""
    replay = EagerGraph.replay
    EagerGraph.replay = lambda self: None
    try:
        yield
    finally:
        EagerGraph.replay = replay


def host_step_us(
    engines: dict[str, LLM], temperature: float, steps: int, passes: int
) -> dict[str, float]:
    """Median microseconds a step of one request, per engine, with replays skipped; the
    engines take turns pass by pass."""
    params = SamplingParams(temperature=temperature, seed=1, max_tokens=10_000, ignore_eos=True)
    times: dict[str, list[float]] = {name: [] for name in engines}
    with replays_skipped():
        for _ in range(passes):
            for name, llm in engines.items():
                engine = llm.engine
                engine.add_request("timed", list(range(5, 45)), params)
                for _ in range(10):  # prefill, and the pipeline and chooser settle
                    engine.step()
                t0 = time.perf_counter()
                for _ in range(steps):
                    engine.step()
                times[name].append((time.perf_counter() - t0) / steps * 1e6)
                engine.abort_request("timed")
                while engine.has_unfinished_requests():
                    engine.step()
    return {name: statistics.median(v) for name, v in times.items()}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--num-drafts", type=int, default=15)
    p.add_argument("--top", type=int, default=8, help="call sites listed per row")
    p.add_argument("--requests", type=int, default=1, help="requests decoded together")
    p.add_argument("--time", action="store_true", help="also time the host's own work a step")
    p.add_argument("--time-steps", type=int, default=300)
    p.add_argument("--passes", type=int, default=5)
    p.add_argument("--json", default=None)
    p.add_argument("--target", choices=list(TARGETS), default="qwen3", help="tiny target family")
    args = p.parse_args(argv)
    config, label = TARGETS[args.target], f"tiny {args.target}"
    tmp = Path(tempfile.mkdtemp())
    target = tmp / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(config))
    drafter = write_dummy_drafter(tmp / "drafter", config, num_layers=1, with_weights=False)
    kw = dict(device="cpu", load_format="dummy", max_model_len=1024)
    spec = {
        "method": "dflash",
        "model": str(drafter),
        "num_speculative_tokens": args.num_drafts,
        "num_speculative_tokens_by_batch": None,
    }
    never = {**spec, "num_speculative_tokens_by_batch": {1: 0}}  # N = 0 at every step
    engines = {
        "AR": LLM(str(target), **kw),
        "DFlash": LLM(str(target), speculative_config=spec, **kw),
        # As on a GPU: plain decode steps launched one ahead, a speculative engine's at N = 0
        # too (its drafter's context deferred).
        "AR, async decode": LLM(str(target), async_decode=True, **kw),
        "DFlash N = 0, async decode": LLM(
            str(target), speculative_config=never, async_decode=True, **kw
        ),
    }
    for llm in engines.values():  # what a GPU engine captures at start, as CPU twins
        llm.engine.capture_graphs([1])
    results: dict = {"steps": args.steps, "num_drafts": args.num_drafts, "rows": []}
    table = []
    for temperature in (0.0, 1.0):
        for name, llm in engines.items():
            sites = count_step_ops(llm, temperature, args.steps, args.requests)
            per_step = {s: n / args.steps for s, n in sites.most_common()}
            total = sum(per_step.values())
            results["rows"].append(
                {"engine": name, "temperature": temperature, "ops_per_step": total,
                 "by_site": per_step}
            )  # fmt: skip
            top = ", ".join(f"{s} {n:.0f}" for s, n in list(per_step.items())[: args.top])
            table.append([name, temperature, total, top])
    print_table(
        f"eager ops per step outside the graphed forwards ({label}, CPU, N = {args.num_drafts}, "
        f"{args.requests} requests)",
        ["engine", "T", "ops/step", "top call sites (ops/step)"],
        table,
    )
    if args.time:
        # (a drafting step's host time too: on a large target it lies between the synchronous
        # steps, the GPU idle)
        timed = {
            k: engines[k] for k in ("AR, async decode", "DFlash N = 0, async decode", "DFlash")
        }
        rows = []
        for temperature in (0.0, 1.0):
            us = host_step_us(timed, temperature, args.time_steps, args.passes)
            ar = us["AR, async decode"]
            for name, t in us.items():
                rows.append([name, temperature, t, t - ar])
                results.setdefault("host_us", []).append(
                    {"engine": name, "temperature": temperature, "us_per_step": t}
                )
        print_table(
            f"host time a step, graph replays skipped ({label}, CPU, {torch.get_num_threads()} "
            f"threads, median of {args.passes} x {args.time_steps} steps)",
            ["engine", "T", "us/step", "over AR"],
            rows,
        )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
