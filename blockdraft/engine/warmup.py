"""Start-up compiles of the Triton kernel variants that eager steps launch.

A Triton kernel compiles on the first launch of each variant: its constexprs (tile sizes picked
by row count and context length, split-K or not, PDL or not) and its pointers' alignment.
Capturing the CUDA graphs compiles the variants of the uniform steps; eager steps pick theirs
launch by launch: a prefill chunk, the short tail a prefix-cache hit leaves to compute, a
batch mixing decodes with a prefill chunk, the drafter's context write after a prefill. The
first launch of a variant in the middle of serving stalls its step, and every request in it,
for the compile: 1.7-2.3 s per prefix-cache hit's tail on an H200 (the benchmarks' GSM8K
figures of our AR mode fell 2.5x from it). So the engine runs, once at start, the eager steps
that reach those variants: one request of each query length a launch tells apart (every
length up to the skinny GEMM's 16 rows, then attention's larger tiles) over cached contexts on
either side of the split-K and key-tile thresholds, and batches of one-row decodes; each is
sampled as a completing chunk is, and on a DFlash engine followed by its context write and
drafts of each N the engine may pick. The first request samples at a temperature with every
filter on, and a verify's rejection sampling (of each N) runs once on dummy logits: the
sampler's kernels are launched outside the graphs too (their first compile stalled a first
sampled request by 1.05 s).

The requests write K/V into blocks of the pool before any request owns them: nothing is
registered in the prefix cache, and the blocks are overwritten when allocated.
"""

from __future__ import annotations

import torch

from blockdraft.engine.model_runner import ModelRunner
from blockdraft.engine.scheduler import ScheduledChunk
from blockdraft.engine.sequence import Sequence
from blockdraft.runtime.sampling_cache import sampling_tensors
from blockdraft.sampling_params import SamplingParams
from blockdraft.spec_decode.draft_launch import DraftLauncher
from blockdraft.spec_decode.draft_schedule import DraftSchedule
from blockdraft.spec_decode.rejection_sampler import rejection_sample

# Query lengths of the warm-up requests: each row count the skinny GEMMs' M buckets and
# attention's query tiles can tell apart (1-16), then larger prefill chunks, whose query tiles
# (16-64 rows of (token, head) pairs) depend on the GQA group.
QUERY_LENS = (*range(1, 17), 24, 48, 96)
# Cached contexts: none, either side of split-K's 512 keys and 32-key tiles' 256 keys a
# program (blockdraft.kernels.triton_attention), and the longest a request can have.
CONTEXT_LENS = (0, 384, 768)
# Batches of one-row decodes: the skinny GEMM's M buckets past one row (2, 3-4, 5-8, 9-16),
# launched with PDL by an eager decode (enforce_eager, or a batch no graph was captured for).
DECODE_BATCHES = (2, 3, 5, 9)


def warmup_shapes(max_model_len: int, max_num_seqs: int) -> list[tuple[int, int, int]]:
    """(requests, query length, cached context length) of each warm-up step, contexts cut to
    fit."""
    contexts = (*CONTEXT_LENS, max_model_len)
    shapes = [(1, q, min(c, max_model_len - q)) for q in QUERY_LENS for c in contexts]
    shapes += [(b, 1, min(c, max_model_len - 1)) for b in DECODE_BATCHES for c in contexts]
    return list(dict.fromkeys(s for s in shapes if s[0] <= max_num_seqs and s[1] <= max_model_len))


@torch.inference_mode()
def warm_up_eager_steps(
    runner: ModelRunner,
    draft_launcher: DraftLauncher | None,
    draft_schedule: DraftSchedule | None,  # its Ns: every N drafts may be proposed with
    max_model_len: int,
    max_num_seqs: int,
    lookahead: int,  # rows past the last token a step may write (DFlash's block)
) -> None:
    """Runs the warm-up steps (see the module doc), each read back as the engine reads its
    steps. The requests of a step share their blocks: the K/V they write is never read."""
    num_drafts = draft_schedule.all_num_drafts if draft_schedule else []
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    sampled = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, min_p=0.05, max_tokens=1)
    for i, (num_seqs, q, ctx) in enumerate(warmup_shapes(max_model_len, max_num_seqs)):
        params = sampled if i == 0 else greedy
        table = list(range(-(-(ctx + q + lookahead) // runner.block_size)))
        chunks = []
        for _ in range(num_seqs):
            seq = Sequence("warmup", None, [0] * (ctx + q), params, seed=0, max_tokens=1)
            seq.block_table = table
            chunks.append(ScheduledChunk(seq, ctx, [0] * q, 0))
        step = runner.launch(chunks)
        if draft_launcher is not None:
            # Each N's drafter block has its own row count ("auto" picks N step by step).
            for n in num_drafts:
                draft_launcher.launch(step.target_step(), n)
        runner.finish(step)
    if draft_launcher is not None:
        # Writes the context N = 0 deferred: into the warm-up's own blocks, before any request.
        draft_launcher.write_deferred()
    for n in num_drafts if draft_launcher is not None else []:
        if n:
            probe = Sequence("warmup", None, [0], sampled, seed=0, max_tokens=1)
            _warm_up_rejection_sampling(probe, runner.model.cfg.vocab_size, n, runner.device)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)


def _warm_up_rejection_sampling(
    seq: Sequence, vocab: int, num_drafts: int, device: torch.device
) -> None:
    """One verify of N uniform drafts on zero logits, sampled with `seq`'s parameters (its
    tokens are dropped)."""
    st = sampling_tensors([seq], [1], device)
    logits = torch.zeros(1, num_drafts + 1, vocab, device=device)  # [R, N+1, V]
    drafts = torch.zeros(1, num_drafts, dtype=torch.int64, device=device)
    probs = torch.full((1, num_drafts, vocab), 1.0 / vocab, device=device)
    rejection_sample(logits, drafts, probs, st)
