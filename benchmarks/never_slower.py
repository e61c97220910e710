"""The default draft length against plain decoding where drafts rarely land, with the cost of
keeping a drafter that never drafts beside them.

Three engines on the same target take turns over `--repeats` passes (median): plain decoding,
a speculative engine pinned to N = 0 (`num_speculative_tokens_by_batch` {1: 0}: what keeping
a drafter costs by itself) and the default (`"auto"`: N chosen each step from acceptance and
step costs). Each pass chats the same prompts one at a time, first for one token (the
prefill, whose drafter context the speculative engines write too) and then for `--max-tokens`.

    .venv/bin/python benchmarks/never_slower.py [--sets aime2025 mtbench] [--num-prompts 3]
        [--max-tokens 64] [--temperature 1] [--repeats 5] [--threads N] [--json F]
        [--probe-budget 0.01 0.005] [--fixed 15 7]

`--fixed N...` adds engines that draft N every step (`num_speculative_tokens_by_batch` None):
where the drafter is good the default should match the best of them. `--trace F` writes, for
each engine that chooses its N, every timed step: the N chosen, the chooser's inputs when that
N differs from the step before's (`conc_probe.weighed`), and the step times it was handed; and
prints how often each N was chosen. For telling why the default drafts or not on a machine
(tracing adds host time to every step: read its rates from a run without it).

No --model: the embedded SmolLM2-135M-Instruct and its shipped drafter. Prompts: the first
`--num-prompts` of each `blockdraft bench` set named.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from collections import Counter
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import add_turn_taking_args, hardware, print_table  # noqa: E402
from benchmarks.conc_probe import weighed  # noqa: E402
from blockdraft import LLM, SamplingParams  # noqa: E402
from blockdraft.bench import (  # noqa: E402
    PROMPT_SETS,
    chat_pass,
    load_prompt_set,
)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--sets", nargs="+", choices=sorted(PROMPT_SETS), default=["aime2025", "mtbench"]
    )
    ap.add_argument("--num-prompts", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument(
        "--probe-budget", type=float, nargs="*", default=[],
        help="also the default at each of these probe budgets (the chooser's PROBE_BUDGET, "
        "the share of plain decoding's time its probes may lose), taking turns with the rest",
    )  # fmt: skip
    ap.add_argument(
        "--fixed", type=int, nargs="*", default=[],
        help="also engines drafting this many tokens every step, taking turns with the rest",
    )  # fmt: skip
    ap.add_argument("--trace", default=None, help="a JSON file for the choosers' steps")
    add_turn_taking_args(ap)
    args = ap.parse_args(argv)
    if min(args.num_prompts, args.max_tokens, args.repeats) < 1:
        raise SystemExit("--num-prompts, --max-tokens and --repeats must be >= 1")
    if args.temperature < 0:
        raise SystemExit("--temperature must be >= 0")
    if any(not 0 < b <= 1 for b in args.probe_budget):
        raise SystemExit("--probe-budget values must be in (0, 1]")
    if any(n < 1 for n in args.fixed):
        raise SystemExit("--fixed values must be >= 1")
    common = {"model": args.model, "num_threads": args.threads}
    auto = {"method": "dflash", "model": args.draft}
    never = {**auto, "num_speculative_tokens_by_batch": {1: 0}}
    engines = {
        "AR": LLM(speculative_config=None, **common),
        "never drafting": LLM(speculative_config=never, **common),
        "default": LLM(speculative_config=auto, **common),
    }
    for budget in args.probe_budget:
        llm = LLM(speculative_config=auto, **common)
        llm.engine.draft_length.probe_budget = budget
        engines[f"default, probe budget {budget:g}"] = llm
    for n in args.fixed:
        fixed = {**auto, "num_speculative_tokens": n, "num_speculative_tokens_by_batch": None}
        engines[f"N = {n} every step"] = LLM(speculative_config=fixed, **common)
    prompts = [p for name in args.sets for p in load_prompt_set(name, args.num_prompts)]
    seeded = {"temperature": args.temperature, "seed": 0}
    prefill = SamplingParams(max_tokens=1, **seeded)
    whole = SamplingParams(max_tokens=args.max_tokens, **seeded)
    for llm in engines.values():  # warm-up
        chat_pass(llm, prompts[:1], SamplingParams(max_tokens=4, **seeded))
    traces = {name: trace_choices(llm) for name, llm in engines.items()} if args.trace else {}
    traces = {name: steps for name, steps in traces.items() if steps is not None}
    passes: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
    steps = dict.fromkeys(engines, 0)  # decode steps over all passes
    verifies: dict[str, list[int]] = {name: [] for name in engines}
    for _ in tqdm(range(args.repeats), desc="passes"):
        for name, llm in engines.items():
            prefill_s, _, _ = chat_pass(llm, prompts, prefill)
            seconds, tokens, lengths = chat_pass(llm, prompts, whole)
            passes[name].append((prefill_s / len(prompts), tokens / seconds))
            # the first token of each request comes from its prefill
            steps[name] += tokens - len(prompts) - sum(lengths) + len(lengths)
            verifies[name] += lengths
    ar = statistics.median(r for _, r in passes["AR"])
    rows, result = [], {"hardware": hardware(), "date": str(datetime.date.today()), "rows": []}
    for name, runs in passes.items():
        prefill_ms = statistics.median(p for p, _ in runs) * 1e3
        rate = statistics.median(r for _, r in runs)
        drafting = len(verifies[name]) / max(steps[name], 1)
        tau = sum(verifies[name]) / len(verifies[name]) if verifies[name] else 0.0
        rows.append([
            name, f"{prefill_ms:.1f}", f"{rate:.2f}", f"{rate / ar:.3f}", f"{drafting:.1%}",
            f"{tau:.2f}" if tau else "-",
        ])  # fmt: skip
        chooser = engines[name].engine.draft_length
        adaptive = chooser is not None and chooser.schedule.is_adaptive
        result["rows"].append({
            "engine": name, "prefill_ms": prefill_ms, "tok_s": rate, "vs_ar": rate / ar,
            "drafting_steps": drafting, "tau": tau,
            "probe_budget": chooser.probe_budget if adaptive else None,
        })  # fmt: skip
    print_table(
        f"{' + '.join(args.sets)}, {len(prompts)} prompts x {args.max_tokens} tokens, "
        f"T = {args.temperature:g}, median of {args.repeats} passes ({hardware()})",
        ["engine", "prefill ms a prompt", "tok/s", "vs AR", "steps drafting", "tau"],
        rows,
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.trace:
        for name, steps in traces.items():
            counts = Counter(step["n"] for step in steps)
            print(f"{name}: N chosen {dict(sorted(counts.items()))} over {len(steps)} steps")
        Path(args.trace).write_text(json.dumps(traces))
    return result


def trace_choices(llm: LLM) -> list[dict] | None:
    """The steps of an engine that chooses its N, recorded from now on (None: a pinned N):
    each {"n", "weighed" (when N changed), "timed": [[batch, N, ms, pipelined], ...]}."""
    engine = llm.engine
    chooser = engine.draft_length
    if chooser is None or not chooser.schedule.is_adaptive:
        return None
    steps: list[dict] = []
    choose, record = chooser.choose, chooser.record_if_uniform

    def traced_choose(estimates: object, batch: int) -> int:
        inputs = weighed(engine)
        n = choose(estimates, batch)
        changed = not steps or steps[-1]["n"] != n
        steps.append({"n": n, "weighed": inputs if changed else None, "timed": []})
        return n

    def traced_record(chunks: list, n: int, seconds: float, pipelined: bool = True) -> None:
        if steps:
            steps[-1]["timed"].append([len(chunks), n, seconds * 1e3, pipelined])
        record(chunks, n, seconds, pipelined)

    # Instance attributes over the methods (the engine calls them through the chooser).
    chooser.choose, chooser.record_if_uniform = traced_choose, traced_record
    return steps


if __name__ == "__main__":
    main()
