"""Held-out evaluation of a drafter: the acceptance length our engine really gets with it."""

from __future__ import annotations

import gc
from pathlib import Path

import torch


def block_acceptance_length(accuracy: list[float]) -> float:
    """Expected tokens per draft step if drafts at block offset k are right with probability
    accuracy[k-1] given the earlier ones were: 1 + sum_k prod_{j<=k} acc_j."""
    tau, run = 1.0, 1.0
    for acc in accuracy:
        run *= acc
        tau += run
    return tau


def evaluate_acceptance(
    model: str | None,
    drafter_dir: str | Path,
    prompts: list[list[int]],  # prompt token ids
    *,
    max_tokens: int = 256,
    num_speculative_tokens: int | None = None,
    device: str = "auto",
    dtype: str = "auto",
    max_num_seqs: int = 64,
) -> float:
    """Greedy generation of every prompt by the engine with `drafter_dir` as speculator;
    returns the mean acceptance length (accepted drafts + 1 per verify step) from
    `engine.spec_stats`."""
    from blockdraft.llm import LLM
    from blockdraft.sampling_params import SamplingParams

    if not prompts:
        raise ValueError("no evaluation prompts")
    # The drafter's full N at every batch size ("auto" would draft fewer, or none on the CPU,
    # at large batches): this measures the drafter, not a serving schedule.
    spec: dict = {
        "method": "dflash",
        "model": str(drafter_dir),
        "num_speculative_tokens_by_batch": None,
    }
    if num_speculative_tokens:
        spec["num_speculative_tokens"] = num_speculative_tokens
    max_model_len = max(len(p) for p in prompts) + max_tokens + 1
    block = 16
    per_seq = -(-(max_model_len + 64) // block)
    seqs = min(max_num_seqs, len(prompts))
    if device != "cpu" and torch.cuda.is_available():
        torch.cuda.empty_cache()  # the trainer's cached blocks would hide free memory
    llm = LLM(
        model,
        speculative_config=spec,
        device=device,
        dtype=dtype,
        max_model_len=max_model_len,
        max_num_seqs=seqs,
        block_size=block,
        num_kv_blocks=per_seq * seqs,
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        llm.generate([list(p) for p in prompts], params, use_tqdm=False)
        return llm.engine.spec_stats.mean_acceptance_length
    finally:
        del llm
        gc.collect()
