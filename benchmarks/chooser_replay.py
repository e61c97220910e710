"""The GPU's default draft length on the shipped drafter's real acceptance, on the CPU: the CPU
engine drafts and verifies with the embedded SmolLM2-135M and its drafter, but its chooser is
the one a CUDA engine builds (N from 0, 3, 7, 15; the GPU's cost prior) and the step times it
is handed are `chooser_sim`'s host-bound GPU step model instead of the CPU's. Prints, per pass
over the prompts, the tokens per unit of model time against plain decoding's (one unit a
token), the share of steps drafting, the mean acceptance length and the steps at each N. For
telling a chooser's choices on real text (acceptance that varies within and between requests)
from what a noisy machine's timings make of them.

    .venv/bin/python benchmarks/chooser_replay.py [--sets aime2025 mtbench] [--num-prompts 3]
        [--max-tokens 128] [--temperature 1] [--passes 2]

Prompts: the first `--num-prompts` of each `blockdraft bench` set named (the bench extras).
"""

from __future__ import annotations

import argparse
import random
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.chooser_sim import StepClock  # noqa: E402
from benchmarks.common import print_table  # noqa: E402
from blockdraft import LLM, SamplingParams  # noqa: E402
from blockdraft.bench import PROMPT_SETS, load_prompt_set  # noqa: E402
from blockdraft.spec_decode.draft_length import DraftLengthChooser  # noqa: E402
from blockdraft.spec_decode.draft_schedule import DraftSchedule  # noqa: E402

BLOCK_DRAFTS = 15  # the shipped drafter's block of 16


class ModelClock:
    """Hands the chooser `chooser_sim`'s step time for each step instead of the CPU's, and
    counts the steps of a pass."""

    def __init__(self, chooser: DraftLengthChooser, seed: int) -> None:
        self.record = chooser.record_if_uniform
        self.clock = StepClock(random.Random(seed))
        self.reset()

    def reset(self) -> None:
        self.elapsed, self.steps = 0.0, Counter()

    def __call__(
        self, chunks: list, num_drafts: int, seconds: float, pipelined: bool = True
    ) -> None:
        t = self.clock.step(num_drafts)
        self.elapsed += t
        self.steps[num_drafts] += 1
        self.record(chunks, num_drafts, t * 1e-3, pipelined)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sets", nargs="+", default=["aime2025", "mtbench"], choices=PROMPT_SETS)
    p.add_argument("--num-prompts", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--passes", type=int, default=2)
    args = p.parse_args(argv)
    if min(args.num_prompts, args.max_tokens, args.passes) < 1:
        raise SystemExit("--num-prompts, --max-tokens and --passes must be >= 1")
    if args.temperature < 0:
        raise SystemExit("--temperature must be >= 0")
    prompts = [q for s in args.sets for q in load_prompt_set(s, args.num_prompts)]
    llm = LLM(
        device="cpu",
        speculative_config={
            "method": "dflash",
            "model": "default",
            "num_speculative_tokens": BLOCK_DRAFTS,
        },
    )
    engine = llm.engine
    schedule = DraftSchedule.resolve("auto", BLOCK_DRAFTS, "cuda")
    chooser = engine.draft_length = DraftLengthChooser.for_device(schedule, "cuda")
    clock = chooser.record_if_uniform = ModelClock(chooser, seed=0)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=0)
    rows = []
    for n in range(args.passes):
        clock.reset()
        tokens, lengths = 0, []
        for prompt in prompts:
            out = llm.chat([{"role": "user", "content": prompt}], params, use_tqdm=False)[0]
            tokens += len(out.outputs[0].token_ids)
            lengths += out.spec_accept_lengths
        steps = sum(clock.steps.values())
        rows.append({
            "pass": n,
            "vs_plain": tokens / clock.elapsed,
            "drafting_steps": 1 - clock.steps[0] / steps,
            "tau": sum(lengths) / len(lengths) if lengths else 0.0,
            "steps_by_n": dict(sorted(clock.steps.items())),
        })  # fmt: skip
    print_table(
        f"the GPU's default draft length on the shipped drafter's acceptance "
        f"({', '.join(args.sets)}, {len(prompts)} prompts x {args.max_tokens} tokens, "
        f"T = {args.temperature:g}; model step times)",
        ["pass", "vs plain decoding", "steps drafting", "tau", "steps by N"],
        [[r["pass"], f"{r['vs_plain']:.3f}", f"{r['drafting_steps']:.1%}", f"{r['tau']:.2f}",
          r["steps_by_n"]] for r in rows],
    )  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
