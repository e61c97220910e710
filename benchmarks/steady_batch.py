"""Decode throughput at a steady batch: B requests that start together and all generate the
same number of tokens (ignore_eos), so every step runs B requests. Plain decoding next to
DFlash with the default draft length ("auto": N chosen each step), DFlash drafting at every
batch size (`num_speculative_tokens_by_batch` None) and DFlash with no drafts from
`--stop-batch` running requests on ({B: 0}: plain decode steps while the drafter keeps its
context), the engines taking turns over `--repeats` passes (median tok/s).

    .venv/bin/python benchmarks/steady_batch.py [--batches 1 4 16] [--max-tokens 48]
        [--stop-batch 4] [--repeats 2] [--model DIR|GGUF] [--draft default|DIR] [--threads N]
        [--json F]

No --model: the embedded SmolLM2-135M-Instruct (and --draft default, its drafter). Prompts are
short open-chat questions ("Tell me about X."), greedy.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import hardware, now, print_table  # noqa: E402
from blockdraft import LLM, SamplingParams  # noqa: E402

TOPICS = [
    "the history of Rome", "baking bread", "transistors", "autumn leaves", "black holes",
    "the French revolution", "machine learning", "coffee brewing", "volcanoes",
    "the stock market", "jazz music", "photosynthesis", "chess openings", "the moon landing",
    "electric cars", "honey bees",
]  # fmt: skip


def throughput(llm: LLM, prompts: list[str], max_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = now()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (now() - t0)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--stop-batch", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft", default="default")
    ap.add_argument("--json", default=None)
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (unset: the default)")
    args = ap.parse_args(argv)
    if min(args.batches) < 1 or args.stop_batch < 1 or args.repeats < 1:
        raise SystemExit("batches, --stop-batch and repeats must be >= 1")
    model = {"model": args.model} if args.model else {}
    spec = {"method": "dflash", "model": args.draft}
    every = {**spec, "num_speculative_tokens_by_batch": None}
    stop = {**spec, "num_speculative_tokens_by_batch": {args.stop_batch: 0}}
    model["num_threads"] = args.threads
    engines = {
        "AR": LLM(**model, speculative_config=None),
        "DFlash auto (default)": LLM(**model, speculative_config=spec),
        "DFlash": LLM(**model, speculative_config=every),
        f"DFlash, none from {args.stop_batch}": LLM(**model, speculative_config=stop),
    }
    rows, results = [], []
    for batch in tqdm(args.batches, desc="batches"):
        prompts = [f"Tell me about {TOPICS[i % len(TOPICS)]}." for i in range(batch)]
        rates: dict[str, list[float]] = {name: [] for name in engines}
        for llm in engines.values():  # warm-up: first compiles and allocations
            throughput(llm, prompts, 4)
        for _ in range(args.repeats):
            for name, llm in engines.items():
                rates[name].append(throughput(llm, prompts, args.max_tokens))
        tok_s = {name: statistics.median(r) for name, r in rates.items()}
        results.append({"batch": batch, "tok_s": tok_s, "tok_s_by_pass": rates})
        values = list(tok_s.values())  # AR first
        rows.append([batch, *values, *(v / values[0] for v in values[1:])])
    names = list(engines)
    print_table(
        f"steady batch, {args.max_tokens} greedy tokens a request, median of {args.repeats}",
        ["batch"] + [f"{n} tok/s" for n in names] + [f"{n} / AR" for n in names[1:]],
        rows,
    )
    out = {"hardware": hardware(), "date": datetime.date.today().isoformat(),
           "args": vars(args), "results": results}  # fmt: skip
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
