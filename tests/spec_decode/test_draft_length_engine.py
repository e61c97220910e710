"""An engine whose draft length changes from step to step inside each request ("auto", and a
chooser replaced by random picks) stays lossless: greedy output is the target's own, sampled
tokens follow the target's distribution; the steps' N are counted in SpecDecodeStats."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest
import torch

from blockdraft import LLM, SamplingParams
from blockdraft.spec_decode.draft_launch import DeferredContext
from blockdraft.spec_decode.draft_length import CALIBRATION_STEPS, INITIAL_ALPHA

from sampling_checks import assert_same_token_law, seeded_samples
from spies import spy_context_writes

NUM_SPEC = 7


def random_prompts(target: Path, rng: torch.Generator, count: int) -> list[list[int]]:
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    lengths = torch.randint(1, 30, (count,), generator=rng).tolist()
    return [torch.randint(4, vocab, (n,), generator=rng).tolist() for n in lengths]


def auto_llm(drafter: Path, target: Path, **kw) -> LLM:
    """num_speculative_tokens_by_batch left at "auto": N chosen each step in 0..NUM_SPEC."""
    spec = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": NUM_SPEC}
    return LLM(str(target), speculative_config=spec, **kw)


def choose_randomly(llm: LLM, rng: torch.Generator) -> list[int]:
    """Replaces the engine's chooser by a random N in 0..NUM_SPEC each step (past the CPU's
    batch-size cap: any N is lossless); returns the picks."""
    r, picks = random.Random(int(torch.randint(0, 2**31, (1,), generator=rng))), []

    rounds: list[int] = []

    def choose(estimates, batch: int) -> int:
        # Shuffled rounds of every N, so a short run still sees them all (independent draws
        # missed some N often enough to fail the variety checks below).
        if not rounds:
            rounds.extend(r.sample(range(NUM_SPEC + 1), NUM_SPEC + 1))
        picks.append(rounds.pop())
        return picks[-1]

    llm.engine.draft_length.choose = choose
    return picks


SETUPS = {
    "plain": {},
    "chunked-prefill": dict(max_num_batched_tokens=20),
    "preemption": dict(block_size=4, num_kv_blocks=30, max_model_len=80),
}


@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("kind", ["random", "agreeing"])
def test_greedy_lossless_with_random_n_each_step(pairs, kind: str, setup: str, rng) -> None:
    target, drafter = pairs[kind]
    prompts = random_prompts(target, rng, 5)
    params = [
        SamplingParams(temperature=0, max_tokens=int(m), ignore_eos=True)
        for m in torch.randint(5, 40, (5,), generator=rng)
    ]
    ar = LLM(str(target), **SETUPS[setup]).generate(prompts, params, use_tqdm=False)
    llm = auto_llm(drafter, target, **SETUPS[setup])
    picks = choose_randomly(llm, rng)
    sd = llm.generate(prompts, params, use_tqdm=False)
    assert [s.outputs[0].token_ids for s in sd] == [a.outputs[0].token_ids for a in ar]
    stats = llm.engine.spec_stats
    assert sum(stats.steps_by_num_drafts.values()) == len(picks)
    assert stats.steps_by_num_drafts == {n: picks.count(n) for n in set(picks)}
    assert len(stats.drafts_by_num_tokens) > 2, stats.summary()  # N changed inside requests
    assert all(len(o.outputs[0].token_ids) == p.max_tokens for o, p in zip(sd, params, strict=True))
    if kind == "agreeing" and setup != "preemption":
        assert max(max(o.spec_accept_lengths) for o in sd) > 4


def test_sampling_is_lossless_with_random_n_each_step(pairs, rng) -> None:
    """Seeded samples of the first tokens agree between plain decoding and speculation whose N
    changes every step (two-sample chi-square on the tokens that come from verifies)."""
    target, drafter = pairs["random"]
    prompt, num = [5, 17, 33, 8], 2000
    kw = dict(max_num_seqs=512, max_model_len=32)
    ar = seeded_samples(LLM(str(target), **kw), prompt, num, top_k=6, max_tokens=4)
    llm = auto_llm(drafter, target, **kw)
    picks = choose_randomly(llm, rng)
    sd = seeded_samples(llm, prompt, num, top_k=6, max_tokens=4)
    assert len(set(picks)) > 2 and llm.engine.spec_stats.num_drafts > 0
    assert_same_token_law(ar, sd, (1, 2, 3))


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_auto_drafts_the_most_for_an_agreeing_drafter(pairs, rng, temperature: float) -> None:
    """The real chooser, one request: a drafter that agrees with the target gets the most
    drafts after the plain-decode calibration, and greedy output is the target's. (Two or more
    requests on the CPU, or one on one CPU thread, start at N = 0 from the cost prior and reach
    the most through probes: two threads here.)"""
    target, drafter = pairs["agreeing"]
    prompts = random_prompts(target, rng, 1)
    params = SamplingParams(temperature=temperature, max_tokens=160, ignore_eos=True, seed=3)
    llm = auto_llm(drafter, target, num_threads=2)
    assert llm.engine.draft_length is not None
    sd = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.engine.spec_stats
    # Calibration: the prefill step and the decode steps that time N = 0; step times are
    # measured, so a noisy timing may cost a few more (the suite runs a test per core: one
    # beside this engine's two threads cost four in one run of six).
    assert stats.steps_by_num_drafts.get(0, 0) <= CALIBRATION_STEPS + 5, stats.summary()
    # The most, or one short of it: each N is timed while it runs, and an N timed in a slow
    # moment (a test beside this one) may stay priced above its neighbour (6 steps to 17).
    assert max(stats.steps_by_num_drafts, key=stats.steps_by_num_drafts.get) >= NUM_SPEC - 1
    assert "steps by chosen N" in stats.summary()
    # Its verifies taught the engine-wide estimate of its own kind of request only.
    chooser, sampled = llm.engine.draft_length, temperature > 0
    assert chooser.prior_alpha(sampled) > 0.9
    assert chooser.prior_alpha(not sampled) == pytest.approx(INITIAL_ALPHA)
    if temperature == 0:
        ar = LLM(str(target)).generate(prompts, params, use_tqdm=False)
        assert [s.outputs[0].token_ids for s in sd] == [a.outputs[0].token_ids for a in ar]
        assert stats.mean_acceptance_length > 6


def test_auto_stops_drafting_for_a_drafter_that_never_lands(pairs, rng) -> None:
    """The real chooser with a random drafter (its drafts almost never accepted): after a few
    verifies the steps are plain decodes, but for rare probes; the output is the target's."""
    target, drafter = pairs["random"]
    prompt = random_prompts(target, rng, 1)
    params = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)
    llm = auto_llm(drafter, target, max_model_len=256)
    sd = llm.generate(prompt, params, use_tqdm=False)
    ar = LLM(str(target), max_model_len=256).generate(prompt, params, use_tqdm=False)
    assert sd[0].outputs[0].token_ids == ar[0].outputs[0].token_ids
    steps = llm.engine.spec_stats.steps_by_num_drafts
    drafting = sum(c for n, c in steps.items() if n)
    # The engine-wide prior (0.6 for a fresh drafter) keeps the first ~20 steps drafting, and
    # step times are measured: at least three plain decodes for each drafting step.
    assert steps[0] > 3 * drafting, llm.engine.spec_stats.summary()


def choose_in_runs(llm: LLM, r: random.Random) -> list[int]:
    """Replaces the engine's chooser by runs of N = 0 (2 to 8 steps) between steps that draft
    a random N; returns the picks."""
    picks: list[int] = []
    plan: list[int] = []

    def choose(estimates, batch: int) -> int:
        if not plan:
            plan.extend([0] * r.randint(2, 8) + [r.randint(1, NUM_SPEC)] * r.randint(1, 3))
        picks.append(plan.pop(0))
        return picks[-1]

    llm.engine.draft_length.choose = choose
    return picks


def count_calls(obj: object, name: str) -> list[int]:
    """Wraps obj.name to count its calls; returns the list it appends a 1 to at each. Not
    `spies.count_calls`: monkeypatch's undo would delete the wrapper from an engine that
    `LLM.shutdown` already emptied (a replaced LLM is shut down when collected)."""
    calls, method = [], getattr(obj, name)

    def spy(*args, **kwargs):
        calls.append(1)
        return method(*args, **kwargs)

    setattr(obj, name, spy)
    return calls


def written_drafter_cache(llm: LLM) -> list[torch.Tensor]:
    """The drafter's K/V caches with the rows still deferred written (as the next launch
    writes them, before any read of their blocks)."""
    llm.engine.draft_launcher.write_deferred()
    layers = llm.engine.proposer.drafter.attention_layers
    return [c.clone() for a in layers for c in (a.key_cache, a.value_cache)]


def assert_deferred_run_equals_eager_run(deferred: tuple, eager: tuple) -> None:
    """(picks, acceptance lengths, drafter caches) of a run deferring its context at N = 0
    and of one writing it every step: the same random N, at least 6 zeros, and the same
    outcome."""
    (picks, accepted, caches), (eager_picks, eager_accepted, eager_caches) = deferred, eager
    assert picks == eager_picks and picks.count(0) > 5
    assert accepted == eager_accepted
    for got, expected in zip(caches, eager_caches, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


# Two requests at a time in a pool that reuses the blocks of finished ones for the next.
DEFERRED_SETUPS = {
    **SETUPS,
    "arrivals": dict(max_num_seqs=2, block_size=4, num_kv_blocks=30, max_model_len=80),
    # At most 3 rows deferred: written whenever the next step's would not fit.
    "bounded": SETUPS["plain"],
}


@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "async-decode"])
@pytest.mark.parametrize("setup", ["plain", "preemption", "arrivals", "bounded"])
def test_deferred_context_equals_eager_context(pairs, rng, setup: str, pipelined: bool) -> None:
    """The drafter context K/V that steps at N = 0 defer (written in one pass when drafting
    resumes, the batch changes or blocks were freed), also when those steps are launched one
    ahead (async decode), leaves the same drafter cache and acceptance as writing it at every
    step, also where a finished request's blocks pass to the next one; the same random N
    sequence drives both runs."""
    target, drafter = pairs["random"]  # the agreeing drafter ignores its context
    prompts = random_prompts(target, rng, 4)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))
    runs = []
    for defer in (True, False):
        llm = auto_llm(drafter, target, **DEFERRED_SETUPS[setup], async_decode=pipelined and defer)
        llm.engine.draft_launcher.defer_context = defer
        if setup == "bounded":
            llm.engine.draft_launcher.max_deferred_rows = 3
        picks = choose_in_runs(llm, random.Random(seed))
        ahead = count_calls(llm.engine, "decode_ahead_launched")  # N = 0 steps launched ahead
        out = llm.generate(prompts, params, use_tqdm=False)
        assert (len(ahead) > 0) == (pipelined and defer)
        runs.append((picks, [o.spec_accept_lengths for o in out], written_drafter_cache(llm)))
    assert_deferred_run_equals_eager_run(*runs)


@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "async-decode"])
@pytest.mark.parametrize("ring", ["roomy", "wrapping"])
def test_context_the_decode_graphs_keep_equals_eager_context(
    pairs, rng, monkeypatch, ring: str, pipelined: bool
) -> None:
    """With decode graphs (eager twins here) the features of steps at N = 0 wait in the feature
    ring, copied there by the graphs themselves, not by the host: the drafter cache and
    acceptance equal writing every step's context at once, also with a ring so small that it
    wraps many times (14 rows; the rows are written before a replay could overwrite them) and
    a batch that pads its graph (3 requests replay the graph of 4)."""
    target, drafter = pairs["random"]
    prompts = random_prompts(target, rng, 3)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))
    runs = []
    for defer in (True, False):
        llm = auto_llm(drafter, target, async_decode=pipelined and defer)
        engine, launcher = llm.engine, llm.engine.draft_launcher
        launcher.defer_context = defer
        if ring == "wrapping":
            launcher.max_deferred_rows = 6  # a ring of 6 + 8 rows (the largest graph's batch)
        engine.capture_graphs([1, 2, 4, 8])
        launcher.max_deferred_rows = None  # only the ring's room bounds the rows waiting
        picks = choose_in_runs(llm, random.Random(seed))
        kept: list[type] = []  # how each decode step's features were kept

        def spy(self, features, *args, add_rows=DeferredContext.add_decode_rows, kept=kept):
            kept.append(type(features))
            return add_rows(self, features, *args)

        monkeypatch.setattr(DeferredContext, "add_decode_rows", spy)
        out = llm.generate(prompts, params, use_tqdm=False)
        monkeypatch.undo()
        if defer:
            feature_ring = launcher.feature_ring
            assert kept and set(kept) == {int}, kept  # every decode step's rows in the ring
            laps = feature_ring.num_written / feature_ring.capacity
            assert laps > 3 if ring == "wrapping" else 0 < laps < 1, laps
        else:
            assert launcher.feature_ring is None and not kept
        runs.append((picks, [o.spec_accept_lengths for o in out], written_drafter_cache(llm)))
    assert_deferred_run_equals_eager_run(*runs)


@pytest.mark.parametrize("pool", ["roomy", "reused"])
def test_finished_requests_deferred_context_waits_until_its_blocks_pass_on(
    pairs, rng, pool: str
) -> None:
    """Two requests one after the other, every step at N = 0: the first one's deferred drafter
    context is not written when it finishes (a later write of many rows costs what one does),
    only once the second request takes a block it lies in (a pool of 20 blocks), and the
    cache ends as writing every step leaves it."""
    target, drafter = pairs["random"]
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    prompts = [torch.randint(4, vocab, (n,), generator=rng).tolist() for n in (20, 29)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    # 20 blocks: the first request holds at least 12 (with the drafts' lookahead), the
    # second needs more than the 8 it leaves untouched.
    kw = dict(block_size=4, max_model_len=60, num_kv_blocks=64 if pool == "roomy" else 20)
    ar = LLM(str(target), **kw).generate(prompts, params, use_tqdm=False)
    runs = []
    for defer in (True, False):
        llm = auto_llm(drafter, target, **kw)
        engine = llm.engine
        engine.draft_launcher.defer_context = defer
        engine.draft_length.choose = lambda estimates, batch: 0
        writes = spy_context_writes(llm)
        builds = count_calls(engine.draft_launcher.proposer, "prepare_inputs")
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
        assert [o.outputs[0].token_ids for o in outs] == [a.outputs[0].token_ids for a in ar]
        if defer:
            # Drafter inputs for the prefills only: a plain decode step's rows are kept from
            # the host's positions and slots.
            assert len(builds) == len(prompts), builds
            # A request's rows: its prompt's, then one a decode step (the last token is not fed).
            rows = [len(p) + params.max_tokens - 1 for p in prompts]
            if pool == "roomy":
                assert writes == [] and engine.draft_launcher.deferred.num_rows == sum(rows)
            else:  # once: when the second request (growing) takes a block of the first's
                assert len(writes) == 1 and rows[0] < writes[0] < sum(rows), writes
        runs.append(written_drafter_cache(llm))
    for got, expected in zip(*runs, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("setup", ["plain", "chunked-prefill", "preemption"])
def test_steps_at_n0_launched_ahead_keep_greedy_output(pairs, rng, setup: str) -> None:
    """Async decode in a speculative engine: its runs of N = 0 steps are launched one ahead, as
    plain decoding's are, between steps that draft. Greedy output is the target's, with
    requests of different lengths, one stopped by a stop token while the step after it was in
    flight, chunked prefill and preemption; the pool is whole afterwards."""
    target, drafter = pairs["random"]
    prompts = random_prompts(target, rng, 5)
    params = [
        SamplingParams(temperature=0, max_tokens=int(m), ignore_eos=True)
        for m in torch.randint(10, 40, (5,), generator=rng)
    ]
    ar_llm = LLM(str(target), **SETUPS[setup])
    first = ar_llm.generate(prompts[:1], params[:1], use_tqdm=False)[0].outputs[0].token_ids
    params[0].stop_token_ids = [first[7]]  # stops request 0 at that token's first occurrence
    ar = ar_llm.generate(prompts, params, use_tqdm=False)
    assert len(ar[0].outputs[0].token_ids) <= 8
    llm = auto_llm(drafter, target, **SETUPS[setup], async_decode=True)
    picks = choose_in_runs(llm, random.Random(int(torch.randint(0, 2**31, (1,), generator=rng))))
    ahead = count_calls(llm.engine, "decode_ahead_launched")  # N = 0 steps launched ahead
    sd = llm.generate(prompts, params, use_tqdm=False)
    assert [s.outputs[0].token_ids for s in sd] == [a.outputs[0].token_ids for a in ar]
    assert [s.outputs[0].finish_reason for s in sd] == [a.outputs[0].finish_reason for a in ar]
    assert ahead and llm.engine.spec_stats.num_drafts > 0 and picks.count(0) > len(ahead)
    engine = llm.engine
    assert engine.decode_pipeline.inflight is None
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_steps_at_n0_launched_ahead_keep_the_sampled_tokens(pairs, rng) -> None:
    """Seeded sampling, N in runs with zeros: the engine that launches its N = 0 steps ahead
    (async decode) samples the very tokens of the one that does not, drafts included (every
    draw is seeded by request and position), and both follow plain decoding's law."""
    target, drafter = pairs["random"]  # its drafts (and so the residual draws) follow its context
    prompt, num = random_prompts(target, rng, 1)[0], 600
    kw = dict(max_num_seqs=num, max_model_len=64)
    # Runs of zeros long enough to launch steps ahead after the prefill (4 steps of 600
    # prompts; a run's first decode step waits for the verify before it), between drafting
    # steps of random N.
    r = random.Random(int(torch.randint(0, 2**31, (1,), generator=rng)))
    cycle = [0] * 8 + [r.randint(1, NUM_SPEC), r.randint(1, NUM_SPEC)]
    runs = []
    for pipelined in (False, True):
        llm = auto_llm(drafter, target, **kw, async_decode=pipelined)
        picks: list[int] = []

        def choose(estimates, batch: int, picks=picks) -> int:
            picks.append(cycle[len(picks) % len(cycle)])
            return picks[-1]

        llm.engine.draft_length.choose = choose
        ahead = count_calls(llm.engine, "decode_ahead_launched")  # N = 0 steps launched ahead
        runs.append(seeded_samples(llm, prompt, num, top_k=6, max_tokens=12))
        assert (len(ahead) > 0) == pipelined and 0 < picks.count(0) < len(picks)
    assert runs[0] == runs[1]
    ar = seeded_samples(LLM(str(target), **kw), prompt, num, top_k=6, max_tokens=12)
    assert_same_token_law(ar, runs[1], (3, 7, 11))


def test_a_drained_pipelines_last_step_is_no_cost_sample(pairs, rng) -> None:
    """Async decode: the last N = 0 step launched ahead before a drafting step launches none
    after it (the pipeline drains); it overlapped the step before, so its time is not taken as
    a plain decode step's cost. Every N = 0 sample comes from a step that kept the
    pipeline full, and drains did happen."""
    target, drafter = pairs["random"]
    prompts = random_prompts(target, rng, 3)
    # 80 tokens: at 40 a run took as few as 3 plain-decode cost samples, and now and then none.
    params = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    llm = auto_llm(drafter, target, async_decode=True)
    chooser = llm.engine.draft_length
    choose_in_runs(llm, random.Random(int(torch.randint(0, 2**31, (1,), generator=rng))))
    calls: list[tuple[int, bool]] = []  # (N, pipelined) of each step the chooser was given
    samples: list[tuple[int, bool]] = []  # (N, that step's pipelined) of each cost sample
    record_if_uniform, record_step = chooser.record_if_uniform, chooser.record_step

    def spy_step_time(chunks, num_drafts, seconds, pipelined=True) -> None:
        calls.append((num_drafts, pipelined))
        record_if_uniform(chunks, num_drafts, seconds, pipelined)

    def spy_sample(batch, num_drafts, seconds) -> None:
        samples.append((num_drafts, calls[-1][1]))
        record_step(batch, num_drafts, seconds)

    chooser.record_if_uniform, chooser.record_step = spy_step_time, spy_sample
    llm.generate(prompts, params, use_tqdm=False)
    assert (0, False) in calls  # drains
    assert any(n == 0 for n, _ in samples)
    assert all(pipelined for _, pipelined in samples), samples


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_step_is_timed_from_the_end_of_the_one_before(pairs, rng, pipelined: bool) -> None:
    """The host's time between steps counts in each step's cost: a caller that spends `gap`
    seconds before every step (as one that waits for the device would, while the step launched
    ahead runs) makes every cost sample at least `gap`; timed from the step's own start, a
    step launched ahead read back at once looked free and the batch stopped drafting."""
    target, drafter = pairs["random"]
    prompts = random_prompts(target, rng, 3)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    llm = auto_llm(drafter, target, async_decode=pipelined)
    chooser, engine = llm.engine.draft_length, llm.engine
    choose_in_runs(llm, random.Random(int(torch.randint(0, 2**31, (1,), generator=rng))))
    samples: list[float] = []
    record_step, step = chooser.record_step, engine.step
    gap = 0.02

    def spy_sample(batch, num_drafts, seconds) -> None:
        samples.append(seconds)
        record_step(batch, num_drafts, seconds)

    def step_after_a_gap() -> list:
        time.sleep(gap)
        return step()

    chooser.record_step, engine.step = spy_sample, step_after_a_gap
    llm.generate(prompts, params, use_tqdm=False)
    assert samples and min(samples) >= gap, samples
    # Idle after its last request (a server waiting): the wait is no step's cost.
    assert engine.last_step_end is None
