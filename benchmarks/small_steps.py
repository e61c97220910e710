"""Step costs of the default target (SmolLM2-135M shapes): where a small model's speculative
step goes.

On an 8B target a step is weight reads; on the 135M default target the GPU finishes a forward
in well under a millisecond and the step is bound by the host: launches, Python bookkeeping
and the readback. This times the AR step and the DFlash step (synthetic acceptance, so the
weights can be random: `load_format="dummy"` from the shapes alone) at a few N and batch
sizes, and with `--profile` splits the batch-1 steps into GPU busy time, launches (eager
kernels and graph replays, counted on the host) and the host's own time by Python function.

    python benchmarks/small_steps.py [--steps 50] [--num-drafts 15 7 3] [--profile] [--json F]

`--num-drafts 0` adds a speculative engine that never drafts (`num_speculative_tokens_by_batch`
{1: 0}): its steps are plain decode steps plus whatever keeping a drafter costs, so it should
cost what AR does. `--profile-batch B` profiles the steps of B requests instead of one.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import (  # noqa: E402
    SMOLLM2_135M,
    TritonCompileLog,
    device_kernels,
    hardware,
    now,
    print_table,
    start_requests,
    stop_requests,
)
from blockdraft import LLM  # noqa: E402

DEFAULT_DRAFTER = Path(__file__).resolve().parent.parent / "blockdraft/assets/smollm2_135m_dflash"


def model_dirs(tmp: Path, target_cfg: dict, drafter_dir: Path) -> tuple[Path, Path]:
    """A target directory holding only config.json, and a copy of the drafter's config.json
    (so that `load_format="dummy"` makes both on the device)."""
    target, drafter = tmp / "target", tmp / "drafter"
    target.mkdir()
    drafter.mkdir()
    (target / "config.json").write_text(json.dumps(target_cfg))
    shutil.copy(drafter_dir / "config.json", drafter / "config.json")
    return target, drafter


def step_ms(
    llm: LLM,
    prompt: list[int],
    batch: int,
    steps: int,
    passes: int,
    log: TritonCompileLog,
    label: str,
    temperature: float = 0.0,
) -> tuple[list[float], float]:
    """(ms per step of each pass, tokens per step and request) over `passes` passes of `steps`
    steps of `batch` requests; kernels first specialised in pass i are logged as "label pass i"."""
    start_requests(llm, prompt, batch, temperature, warm_steps=5)
    running = list(llm.engine.scheduler.running)
    before = sum(s.num_output_tokens for s in running)
    times = []
    for i in range(passes):
        with log.timed(f"{label} batch {batch} pass {i + 1}"):
            t0 = now()
            for _ in range(steps):
                llm.engine.step()
            times.append((now() - t0) / steps * 1e3)
    tokens = sum(s.num_output_tokens for s in running) - before
    stop_requests(llm, batch)
    return times, tokens / (steps * passes) / batch


def profile_step(
    llm: LLM, prompt: list[int], steps: int, top: int, temperature: float = 0.0, batch: int = 1
) -> dict:
    """GPU busy ms, launches per step (eager kernels, graph replays, copies, syncs), the host's
    top Python functions by own time and blockdraft's functions by cumulative time, over `steps`
    steps of `batch` requests."""
    from torch.profiler import ProfilerActivity, profile

    start_requests(llm, prompt, batch, temperature, warm_steps=5)
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            llm.engine.step()
    kernel_us = sum(e.self_device_time_total for e in device_kernels(prof))
    count = {e.key: e.count for e in prof.key_averages()}
    profiler = cProfile.Profile()
    t0 = now()
    profiler.enable()
    for _ in range(steps):
        llm.engine.step()
    profiler.disable()
    wall_ms = (now() - t0) * 1e3 / steps
    stop_requests(llm, batch)
    stats = pstats.Stats(profiler)
    own = sorted(
        ((v[2], f"{Path(k[0]).stem}:{k[2]}") for k, v in stats.stats.items()), reverse=True
    )  # v[2]: total time spent in the function itself, v[3]: with its callees
    ours = sorted(
        ((v[3], f"{Path(k[0]).stem}:{k[2]}") for k, v in stats.stats.items()
         if "/blockdraft/" in k[0]), reverse=True,
    )  # fmt: skip
    return {
        "gpu_busy_ms": kernel_us / 1e3 / steps,
        "kernel_launches": count.get("cudaLaunchKernel", 0) / steps,
        "graph_launches": count.get("cudaGraphLaunch", 0) / steps,
        "memcpys": (count.get("cudaMemcpyAsync", 0)) / steps,
        "syncs": sum(n for k, n in count.items() if "Synchronize" in k) / steps,
        "wall_ms_under_cprofile": wall_ms,
        "host_top": [(name, t * 1e3 / steps) for t, name in own[:top]],
        "blockdraft_cumulative": [(name, t * 1e3 / steps) for t, name in ours[: 2 * top]],
    }


def free_device_memory() -> None:
    """After `del llm`: returns the engine's device memory before the next one is made."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--passes", type=int, default=2, help="timed passes per row (first: cold)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--num-drafts", type=int, nargs="+", default=[15, 7, 3])
    p.add_argument("--accept", type=float, default=0.55, help="synthetic acceptance rate")
    p.add_argument("--temperature", type=float, default=0.0, help="requests' temperature (seeded)")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--profile", action="store_true", help="split the steps of --profile-batch")
    p.add_argument("--profile-batch", type=int, default=1)
    p.add_argument("--top", type=int, default=12, help="host functions listed")
    p.add_argument("--device", default="auto")
    p.add_argument("--target-config", default=None, help="JSON config (default: SmolLM2-135M)")
    p.add_argument("--drafter", default=str(DEFAULT_DRAFTER), help="drafter dir (config read)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    target_cfg = (
        json.loads(Path(args.target_config).read_text()) if args.target_config else SMOLLM2_135M
    )
    tmp = Path(tempfile.mkdtemp())
    target, drafter = model_dirs(tmp, target_cfg, Path(args.drafter))
    max_len = min(2048, target_cfg["max_position_embeddings"])
    kw = dict(device=args.device, load_format="dummy", max_model_len=max_len, seed=0)
    span = min(1000, target_cfg["vocab_size"] - 10)
    prompt = [(17 * i) % span + 10 for i in range(args.prompt_len)]
    results: dict = {
        "hardware": hardware(), "date": time.strftime("%Y-%m-%d"), "accept": args.accept,
        "temperature": args.temperature, "rows": [], "profiles": {},
    }  # fmt: skip
    engines: list[tuple[str, int, dict]] = [("AR", 0, {})]
    for n in args.num_drafts:
        spec = {
            "method": "dflash",
            "model": str(drafter),
            "num_speculative_tokens": n or 15,
            "num_speculative_tokens_by_batch": {1: 0} if n == 0 else None,
            "synthetic_acceptance_rate": args.accept,
        }
        engines.append(("DFlash", n, {"speculative_config": spec}))  # fmt: skip
    table, ar_ms = [], {}
    log = TritonCompileLog()
    for name, n, extra in engines:
        llm = LLM(str(target), **kw, **extra)
        label = f"{name} N={n}" if extra else name
        for batch in args.batches:
            times, tokens = step_ms(
                llm, prompt, batch, args.steps, args.passes, log, label, args.temperature
            )
            ms = times[-1]  # the last pass: steady
            ar_ms.setdefault(batch, ms)
            ratio = ms / ar_ms[batch]
            results["rows"].append(
                {
                    "engine": name,
                    "num_drafts": n,
                    "batch": batch,
                    "step_ms": ms,
                    "step_ms_by_pass": times,
                    "tokens_per_step": tokens,
                    "step_cost_ratio": ratio,
                }
            )
            table.append([label, batch, times[0], ms, ratio, tokens, tokens / ratio])
        del llm
        free_device_memory()
    # Profiles only after every engine is timed: the profiler leaves CUPTI attached to the
    # process when it stops (pytorch/pytorch#144455), and what runs after it runs slower (a
    # never-drafting engine timed after AR's profile: 1.14 ms a step on an H100, 0.70 without).
    for name, n, extra in engines if args.profile else []:
        llm = LLM(str(target), **kw, **extra)
        label = f"{name} N={n}" if extra else name
        results["profiles"][label] = profile_step(
            llm, prompt, args.steps, args.top, args.temperature, args.profile_batch
        )
        del llm
        free_device_memory()
    for label, prof in results["profiles"].items():
        print_table(
            f"{label}, batch {args.profile_batch}: host time by function (ms per step; own, "
            "and blockdraft's with callees)",
            ["function", "own ms", "blockdraft function", "cumulative ms"],
            [[*a, *b] for a, b in zip(prof["host_top"], prof["blockdraft_cumulative"],
                                      strict=False)],
        )  # fmt: skip
    results["compiles"] = [
        {"phase": phase, "kernel": kernel, "signature": sig} for phase, kernel, sig in log.events
    ]
    if log.events:
        print_table(
            "Triton kernels first specialised inside timed passes (each one a compile)",
            ["phase", "kernel", "specialisation"],
            [[c["phase"], c["kernel"], c["signature"][-150:]] for c in results["compiles"]],
        )  # fmt: skip
    if results["profiles"]:
        print_table(
            f"batch-{args.profile_batch} step split (per step)",
            ["engine", "GPU busy ms", "kernel launches", "graph launches", "memcpys", "syncs",
             "wall ms (cProfile on)"],
            [[label, p["gpu_busy_ms"], p["kernel_launches"], p["graph_launches"], p["memcpys"],
              p["syncs"], p["wall_ms_under_cprofile"]] for label, p in results["profiles"].items()],
        )  # fmt: skip
    print_table(
        f"step cost, {results['hardware']} (synthetic acceptance {args.accept}, "
        f"T = {args.temperature})",
        ["engine", "batch", "pass 1 ms", "step ms", "÷ AR step", "tokens/step", "speedup"],
        table,
    )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
