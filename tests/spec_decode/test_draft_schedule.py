"""Draft tokens by batch size (speculative_config num_speculative_tokens_by_batch): the schedule
itself, its validation, and an engine whose batch crosses the threshold mid-run staying exactly
the target's greedy output while the number of drafts per step changes."""

from pathlib import Path

import pytest
import torch
from test_dflash_lossless import run_counting_readbacks

from blockdraft import LLM, SamplingParams
from blockdraft.config import SpeculativeConfig
from blockdraft.engine.cuda_graphs import default_batch_sizes
from blockdraft.kernels.forward_context import PAD_SLOT_ID
from blockdraft.spec_decode.draft_schedule import DraftSchedule, bucket_of, default_num_drafts

# N = 7 while fewer than 3 requests run, N = 3 from 3 on.
SCHEDULE = {1: 7, 3: 3}


def random_prompt(target: Path, length: int, rng: torch.Generator) -> list[int]:
    import json

    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    return torch.randint(4, vocab, (length,), generator=rng).tolist()


def scheduled(drafter: Path, by_batch: object, n: int | None = 7) -> dict:
    cfg = {"method": "dflash", "model": str(drafter), "num_speculative_tokens_by_batch": by_batch}
    if n is not None:
        cfg["num_speculative_tokens"] = n
    return cfg


@pytest.mark.parametrize(
    "by_batch, message",
    [
        ({}, "must be a non-empty dict"),
        ("fast", "must be a non-empty dict"),
        ([(1, 3)], "must be a non-empty dict"),
        ({0: 3}, "keys are batch sizes"),
        ({"24": 3}, "keys are batch sizes"),
        ({True: 3}, "keys are batch sizes"),
        ({4: -1}, r"\[4\] must be a number of draft tokens >= 0"),
        ({4: 2.5}, r"\[4\] must be a number of draft tokens >= 0"),
        ({4: False}, r"\[4\] must be a number of draft tokens >= 0"),
        ({1: 7, 8: 9}, r"\[8\] = 9 exceeds num_speculative_tokens \(7\)"),
    ],
)
def test_bad_schedules_name_the_problem(by_batch, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig("d", num_speculative_tokens=7, num_speculative_tokens_by_batch=by_batch)
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.coerce(scheduled(Path("d"), by_batch))


def test_schedule_beyond_the_drafters_block_fails_at_load(pairs) -> None:
    """Without num_speculative_tokens, N defaults to the drafter's block_size - 1 (at most 3 on
    the CPU): the schedule is checked against it once the drafter's config is read."""
    target, drafter = pairs["random"]
    with pytest.raises(ValueError, match=r"\[4\] = 16 exceeds num_speculative_tokens \(3\)"):
        LLM(str(target), speculative_config=scheduled(drafter, {4: 16}, n=None))
    with pytest.raises(ValueError, match=r"\[4\] = 16 exceeds num_speculative_tokens \(15\)"):
        LLM(str(target), speculative_config=scheduled(drafter, {4: 16}, n=15))


@pytest.mark.parametrize("block_size", [2, 3, 8, 16])
def test_default_num_drafts_by_device(block_size: int) -> None:
    assert default_num_drafts(block_size, "cuda") == block_size - 1
    assert default_num_drafts(block_size, "cpu") == min(block_size - 1, 3)


def test_cpu_engine_drafts_three_by_default_and_stays_lossless(pairs, rng) -> None:
    """On the CPU an unset num_speculative_tokens means at most 3 drafts a step, chosen among
    0-3 (an explicit N is kept), and the output is the target's."""
    target, drafter = pairs["agreeing"]
    prompts = [random_prompt(target, n, rng) for n in (3, 9)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ar = LLM(str(target)).generate(prompts, params, use_tqdm=False)
    spec = {"method": "dflash", "model": str(drafter)}
    llm = LLM(str(target), speculative_config=spec, num_threads=2)
    assert llm.engine.num_spec == 3 and llm.engine.draft_schedule.all_num_drafts == [0, 1, 2, 3]
    out = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ar]
    assert max(k for o in out for k in o.spec_accept_lengths) == 4  # 3 drafts + the target's
    explicit = LLM(str(target), speculative_config=scheduled(drafter, None, n=15))
    assert explicit.engine.num_spec == 15


def reference_num_drafts(by_batch: dict[int, int], n: int, batch: int) -> int:
    keys = [k for k in by_batch if k <= batch]
    return by_batch[max(keys)] if keys else n


def test_schedule_lookup_and_graph_buckets_on_random_schedules(rng) -> None:
    """N for every batch size is the value of the largest key not above it (N below the
    smallest key); the graph buckets of each N are exactly the buckets its batch sizes use."""
    for _ in range(50):
        n = int(torch.randint(1, 16, (1,), generator=rng))
        num_keys = int(torch.randint(1, 5, (1,), generator=rng))
        keys = torch.randint(1, 80, (num_keys,), generator=rng).tolist()
        by_batch = {k: int(torch.randint(0, n + 1, (1,), generator=rng)) for k in keys}
        max_num_seqs = int(torch.randint(1, 100, (1,), generator=rng))
        schedule = DraftSchedule.resolve(by_batch, n, "cpu")
        sizes = default_batch_sizes(max_num_seqs)
        batches = range(1, max_num_seqs + 1)
        for batch in batches:
            assert schedule.num_drafts(batch) == reference_num_drafts(by_batch, n, batch)
        for num_drafts in set(schedule.num_drafts(b) for b in batches):
            used = {bucket_of(b, sizes) for b in batches if schedule.num_drafts(b) == num_drafts}
            assert schedule.graph_batch_sizes(num_drafts, sizes) == sorted(used), by_batch


@pytest.mark.parametrize("n", [3, 7, 15])
def test_auto_schedule_by_device(n: int) -> None:
    """'auto': N chosen from acceptance, at most 7 from 24 requests on CUDA (among a few N with
    graphs) and none from 4 on the CPU (among all); None: fixed."""
    cuda = DraftSchedule.resolve("auto", n, "cuda")
    cpu = DraftSchedule.resolve("auto", n, "cpu")
    off = DraftSchedule.resolve(None, n, "cuda")
    assert off.is_fixed and not off.is_adaptive and off.num_drafts(512) == n
    assert off.allowed(n) == (n,)
    assert [cuda.num_drafts(b) for b in (1, 23, 24, 512)] == [n, n, min(n, 7), min(n, 7)]
    assert cuda.is_adaptive and not cuda.is_fixed
    assert cuda.all_num_drafts == sorted({0, min(n, 3), min(n, 7), n})
    assert cuda.allowed(min(n, 7)) == tuple(sorted({0, min(n, 3), min(n, 7)}))
    assert [cpu.num_drafts(b) for b in (1, 3, 4, 512)] == [n, n, 0, 0]
    assert cpu.all_num_drafts == list(range(n + 1)) and cpu.allowed(0) == (0,)
    sizes = default_batch_sizes(64)  # every N up to the cap has graphs where it may be chosen
    if n > 7:  # only below 24 requests
        assert cuda.graph_batch_sizes(n, sizes) == [1, 2, 4, 8, 16, 24]
    assert cuda.graph_batch_sizes(min(n, 3), sizes) == sizes


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_no_drafts_from_a_batch_size_on(pairs, rng, temperature: float) -> None:
    """N = 0 from 3 running requests on: no request proposes while 3 or more run (plain
    decode steps; the drafter still writes its context), drafting resumes once fewer run, and
    greedy output is the target's; sampled requests run to their lengths, seeded alike."""
    target, drafter = pairs["agreeing"]
    lengths = torch.randint(1, 30, (5,), generator=rng).tolist()
    prompts = [random_prompt(target, m, rng) for m in lengths]
    params = [
        SamplingParams(temperature=temperature, max_tokens=m, ignore_eos=True, seed=i)
        for i, m in enumerate((4, 7, 12, 30, 41))
    ]
    llm = LLM(str(target), speculative_config=scheduled(drafter, {3: 0}, n=4))
    assert llm.engine.draft_schedule.all_num_drafts == [0, 4]
    proposals = spy_drafts_by_batch(llm)
    written = spy_context_rows(llm)
    sd = llm.generate(prompts, params, use_tqdm=False)
    assert proposals and all(running < 3 and n == 4 for running, n in proposals), proposals
    # Every token fed to the target left its features in the drafter's context, drafting or
    # not: each request's prompt and all its output tokens but the last (a last verify may
    # also commit up to N drafts that max_tokens then cuts from the output).
    fed = sum(len(p) + len(s.outputs[0].token_ids) - 1 for p, s in zip(prompts, sd, strict=True))
    assert fed <= sum(written) <= fed + 4 * len(prompts), (sum(written), fed)
    for s, p in zip(sd, params, strict=True):
        assert len(s.outputs[0].token_ids) == p.max_tokens
    # Drafting resumed after the no-draft steps: the last two requests were verified.
    assert all(s.spec_accept_lengths for s in sd[3:])
    if temperature == 0:
        ar = LLM(str(target)).generate(prompts, params, use_tqdm=False)
        assert [s.outputs[0].token_ids for s in sd] == [a.outputs[0].token_ids for a in ar]
        # "agreeing" drafter: runs of more than one token came from verified drafts.
        assert max(max(s.spec_accept_lengths) for s in sd[3:]) > 1


def spy_drafts_by_batch(llm: LLM) -> list[tuple[int, int]]:
    """(requests running, drafts proposed per request) for every propose step."""
    engine, seen = llm.engine, []
    original = engine.proposer.propose

    def spy(*args, **kwargs):
        tokens, probs = original(*args, **kwargs)
        seen.append((engine.num_running, tokens.shape[1]))
        return tokens, probs

    engine.proposer.propose = spy
    return seen


@pytest.mark.parametrize("kind", ["random", "agreeing"])
def test_greedy_lossless_while_the_batch_shrinks_across_the_threshold(pairs, kind, rng) -> None:
    """Six requests finish at different lengths: N is 3 while three or more run and 7 once
    fewer do, and the output is the target's own."""
    target, drafter = pairs[kind]
    lengths = torch.randint(1, 30, (6,), generator=rng).tolist()
    prompts = [random_prompt(target, m, rng) for m in lengths]
    params = [
        SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (5, 9, 14, 22, 31, 44)
    ]
    ar = LLM(str(target)).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(target), speculative_config=scheduled(drafter, SCHEDULE))
    proposals = spy_drafts_by_batch(llm)
    sd = llm.generate(prompts, params, use_tqdm=False)
    for a, s in zip(ar, sd, strict=True):
        assert s.outputs[0].token_ids == a.outputs[0].token_ids
        assert 1 + sum(s.spec_accept_lengths) == len(s.outputs[0].token_ids)
    assert all(n == (3 if running >= 3 else 7) for running, n in proposals), proposals
    stats = llm.engine.spec_stats
    assert set(stats.drafts_by_num_tokens) == {3, 7}, stats.summary()
    assert stats.num_draft_tokens == sum(n * c for n, c in stats.drafts_by_num_tokens.items())
    assert "drafts by N" in stats.summary()
    if kind == "agreeing":  # runs longer than 1+3 can only come from verifies of 7 drafts
        assert max(max(o.spec_accept_lengths) for o in sd) > 4


def spy_context_rows(llm: LLM) -> list[int]:
    """Rows (not PAD) of every drafter context K/V write."""
    drafter, counts = llm.engine.proposer.drafter, []
    original = drafter.write_context

    def spy(features, positions, slot_mapping):
        counts.append(int((slot_mapping != PAD_SLOT_ID).sum()))
        return original(features, positions, slot_mapping)

    drafter.write_context = spy
    return counts


def spy_truncated_verifies(llm: LLM) -> list[int]:
    """Requests per step that verify fewer drafts than they hold."""
    scheduler, counts = llm.engine.scheduler, []
    original = scheduler.schedule

    def spy():
        chunks = original()
        counts.append(sum(1 for c in chunks if c.num_drafts and c.num_drafts < c.seq.num_drafts))
        return chunks

    scheduler.schedule = spy
    return counts


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_requests_joining_mix_draft_counts_and_stay_lossless(
    pairs, monkeypatch, rng, temperature: float
) -> None:
    """Two short requests propose 7 drafts each; a third arrives and the second's verify no
    longer fits the budget of 12 (8 + 8 rows), so it keeps its 7 drafts while the first, now
    one of three running, proposes 3: the next step verifies 3 for both (the second its first
    3, and accepts them). Greedy, the second's output is the target's; sampled (draft
    probabilities sliced too), it runs to its length; every step reads the device back once."""
    target, drafter = pairs["agreeing"]
    prompts = {
        "x": random_prompt(target, 3, rng),
        "y": random_prompt(target, 4, rng),
        "z": random_prompt(target, 40, rng),
    }
    params = {
        "x": SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
        "y": SamplingParams(temperature=temperature, max_tokens=25, ignore_eos=True, seed=7),
        "z": SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    }
    arrivals = {0: [(r, prompts[r], params[r]) for r in "xy"]}
    arrivals[1] = [("z", prompts["z"], params["z"])]
    kw = dict(max_num_batched_tokens=12)
    llm = LLM(str(target), speculative_config=scheduled(drafter, SCHEDULE), **kw)
    truncated = spy_truncated_verifies(llm)
    outs = run_counting_readbacks(llm.engine, arrivals, monkeypatch)
    assert truncated[:3] == [0, 0, 1], truncated  # y verifies 3 of its 7 drafts at step 2
    assert set(llm.engine.spec_stats.drafts_by_num_tokens) == {3, 7}
    assert len(outs["y"].outputs[0].token_ids) == 25
    if temperature == 0:  # the agreeing drafter's first 3 drafts (of 7) are all accepted
        assert outs["y"].spec_accept_lengths[0] == 4, outs["y"].spec_accept_lengths
    ar = LLM(str(target), **kw)
    for rid in "xyz" if temperature == 0 else "xz":
        want = ar.generate([prompts[rid]], params[rid], use_tqdm=False)[0].outputs[0].token_ids
        assert outs[rid].outputs[0].token_ids == want, rid
