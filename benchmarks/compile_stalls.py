"""Triton compiles in the middle of serving, request by request.

A Triton kernel compiles on the first launch of each variant; a compile inside a step stalls
that step (1.7-2.3 s on an H200 host). The engine compiles its CUDA graphs' variants when
capturing them and its eager steps' variants in a warm-up (blockdraft/engine/warmup.py). This
sends batch-1 requests of several lengths (random weights of the default target's shapes,
`load_format="dummy"`), then the same prompts twice more with a changed end, so that the
prefix cache leaves short tails to compute (where the stalls were found), then sampled ones;
it prints each request's time and the kernels compiled during it.

    python benchmarks/compile_stalls.py [--drafter] [--no-warmup] [--max-tokens 96]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import (  # noqa: E402
    SMOLLM2_135M,
    TritonCompileLog,
    print_table,
    write_dummy_drafter,
)
from blockdraft import LLM, SamplingParams  # noqa: E402
from blockdraft.engine.llm_engine import LLMEngine  # noqa: E402

PROMPT_LENS = (56, 96, 87, 140, 179, 600, 1100)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--drafter", action="store_true", help="DFlash with a random drafter")
    p.add_argument("--no-warmup", action="store_true", help="skip the engine's warm-up")
    p.add_argument("--max-tokens", type=int, default=96)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("compile_stalls.py needs a CUDA device (the CPU runs no Triton kernel)")
    if args.no_warmup:
        LLMEngine.warm_up = lambda self: None
    log = TritonCompileLog()
    tmp = Path(tempfile.mkdtemp())
    target = tmp / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(SMOLLM2_135M))
    spec = None
    if args.drafter:
        drafter = write_dummy_drafter(tmp / "drafter", SMOLLM2_135M, with_weights=False)
        spec = {
            "method": "dflash", "model": str(drafter), "num_speculative_tokens": 15,
            "num_speculative_tokens_by_batch": None, "synthetic_acceptance_rate": 0.6,
        }  # fmt: skip
    llm = LLM(str(target), load_format="dummy", max_model_len=2048, speculative_config=spec)
    engine = llm.engine
    print(f"loaded in {engine.load_time_s:.1f} s: CUDA graphs {engine.capture_time_s:.1f} s, "
          f"warm-up {engine.warmup_time_s:.1f} s")  # fmt: skip

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40_000, (n,), generator=g).tolist() for n in PROMPT_LENS]
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=32, seed=1)
    jobs = [(f"pass {k}", greedy, p[: len(p) - 3 * k] + p[: 3 * k]) for k in range(3)
            for p in prompts]  # fmt: skip
    jobs += [("sampled", sampled, p[:-5]) for p in prompts[:3]]
    rows, late = [], 0
    for i, (label, params, prompt) in enumerate(jobs):
        with log.timed(str(i)):
            t0 = time.perf_counter()
            llm.generate(prompt, params, use_tqdm=False)
            torch.cuda.synchronize()
            ms = (time.perf_counter() - t0) * 1e3
        kernels = [k for phase, k, _ in log.events if phase == str(i)]
        late += len(kernels) if i >= len(prompts) else 0
        rows.append([label, len(prompt), ms, len(kernels), ", ".join(kernels) or "-"])
    print_table("requests (batch 1)", ["pass", "prompt", "ms", "compiles", "kernels"], rows)
    print(f"\ncompiles after the first pass: {late}")


if __name__ == "__main__":
    main()
