"""A drafter with and without its token map: batch-1 tok/s and tau at a fixed draft length.

Three engines on the same target take turns over `--repeats` passes (median tok/s): plain
decoding, the drafter drafting from its token map ("auto": the map its directory ships), and
the same drafter over the whole vocabulary (`token_map` None). Each pass chats the same prompts
one at a time (greedy), so tau is the same in every pass.

    .venv/bin/python benchmarks/token_map_bench.py [--num-drafts 3] [--max-tokens 96]
        [--repeats 5] [--threads N] [--draft default|DIR] [--model DIR|GGUF] [--json F]

No --model: the embedded SmolLM2-135M-Instruct and its shipped drafter (16,384 of 49,152
tokens). Prompts: the first two GSM8K problems, the first HumanEval task and the first MT-Bench
question (`blockdraft bench`'s sets).
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

from benchmarks.common import add_turn_taking_args, hardware, print_table  # noqa: E402
from blockdraft import LLM, SamplingParams  # noqa: E402
from blockdraft.bench import chat_pass, load_prompt_set  # noqa: E402


def one_pass(llm: LLM, prompts: list[str], params: SamplingParams) -> tuple[float, float]:
    """tok/s over the prompts, one at a time, and tau (0 without a drafter)."""
    seconds, tokens, lengths = chat_pass(llm, prompts, params)
    return tokens / seconds, (sum(lengths) / len(lengths) if lengths else 0.0)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-drafts", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    add_turn_taking_args(ap)
    args = ap.parse_args(argv)
    if min(args.num_drafts, args.max_tokens, args.repeats) < 1:
        raise SystemExit("--num-drafts, --max-tokens and --repeats must be >= 1")
    common = {"model": args.model, "num_threads": args.threads}

    def spec(token_map: str | None) -> dict:
        return {
            "method": "dflash",
            "model": args.draft,
            "num_speculative_tokens": args.num_drafts,
            "num_speculative_tokens_by_batch": None,
            "token_map": token_map,
        }

    engines = {
        "AR": LLM(speculative_config=None, **common),
        "token map": LLM(speculative_config=spec("auto"), **common),
        "whole vocabulary": LLM(speculative_config=spec(None), **common),
    }
    drafter = engines["token map"].engine.proposer.drafter.cfg
    if drafter.draft_vocab_size is None:
        raise SystemExit(f"drafter {args.draft} ships no token map (token_map.pt)")
    prompts = load_prompt_set("gsm8k", 2) + load_prompt_set("humaneval", 1)
    prompts += load_prompt_set("mtbench", 1)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    for llm in engines.values():  # warm-up
        one_pass(llm, prompts[:1], params)
    passes: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
    for _ in tqdm(range(args.repeats), desc="passes"):
        for name, llm in engines.items():
            passes[name].append(one_pass(llm, prompts, params))
    ar = statistics.median(r for r, _ in passes["AR"])
    rows, result = [], {"hardware": hardware(), "date": str(datetime.date.today()), "rows": []}
    for name, runs in passes.items():
        rate = statistics.median(r for r, _ in runs)
        tau = runs[0][1]
        rows.append([name, f"{rate:.2f}", f"{rate / ar:.3f}", f"{tau:.3f}" if tau else "-"])
        result["rows"].append({"engine": name, "tok_s": rate, "vs_ar": rate / ar, "tau": tau})
    print_table(
        f"N = {args.num_drafts}, {drafter.draft_vocab_size:,} of {drafter.body.vocab_size:,} "
        f"tokens, {len(prompts)} prompts x {args.max_tokens} tokens, median of {args.repeats}",
        ["engine", "tok/s", "vs AR", "tau"],
        rows,
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
