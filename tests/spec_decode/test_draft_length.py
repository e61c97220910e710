"""The acceptance-aware draft-length chooser (blockdraft/spec_decode/draft_length.py) on
synthetic step-cost tables and acceptance streams: it picks 0 when drafts never land, the most
when they always do, finds its way back through probes, and otherwise maximises the batch's
expected tokens per second."""

from __future__ import annotations

import collections
import dataclasses
import math
import random
from types import SimpleNamespace

import pytest
import torch

from blockdraft.spec_decode import draft_length
from blockdraft.spec_decode.draft_length import (
    ALPHA_BINS,
    CALIBRATION_STEPS,
    DECODE_RECHECK_SPACING,
    DECODE_TIMING_STRIDE,
    DRAFT_RETIME_SPACING,
    IDLE_AGE_STEPS,
    IDLE_DECAY,
    MAX_PROBE_FLOOR,
    MAX_PROBE_INTERVAL,
    MIN_DRAFT_GAIN,
    PROBE_BUDGET,
    PROBE_INTERVAL,
    PROBE_SPAN,
    RECALIBRATE_BUDGET,
    RECALIBRATE_INTERVAL,
    RETIME_CHECK_STRIDE,
    STEADY_AFTER,
    AcceptanceEstimate,
    DraftLengthChooser,
    expected_tokens,
)
from blockdraft.spec_decode.draft_schedule import DraftSchedule
from blockdraft.spec_decode.step_costs import COST_WINDOW, CostPrior, StepCostModel

NUM_SPEC = 7


def py_random(rng: torch.Generator) -> random.Random:
    return random.Random(int(torch.randint(0, 2**31, (1,), generator=rng)))


def adaptive_schedule(num_spec: int = NUM_SPEC) -> DraftSchedule:
    """Every N in 0..num_spec at every batch size (no cap)."""
    return DraftSchedule((1,), (num_spec,), tuple(range(num_spec + 1)))


def set_drafter_prior(chooser: DraftLengthChooser, alpha: float, weight: float = 1e6) -> None:
    """The drafter's engine-wide history (greedy and sampled alike): `weight` observations at
    `alpha`."""
    chooser.prior_accepted = [alpha * weight] * 2
    chooser.prior_rejected = [(1 - alpha) * weight] * 2


def chooser_with_costs(
    r: random.Random, batches: range, overhead: float, per_row: float
) -> DraftLengthChooser:
    """A chooser whose every (batch, N) step was timed: decode(b) * (1 + overhead * (N > 0) +
    per_row * b * N), decode(b) random."""
    chooser = DraftLengthChooser.for_device(adaptive_schedule(), "cpu")
    for b in batches:
        decode = r.uniform(0.01, 0.05) * (1 + 0.1 * b)
        for n in range(NUM_SPEC + 1):
            chooser.record_step(b, n, decode * (1 + overhead * (n > 0) + per_row * b * n))
    return chooser


def estimate_at(chooser: DraftLengthChooser, alpha: float) -> AcceptanceEstimate:
    """A request whose alpha is known (a posterior concentrated there, as after many verifies):
    its expected tokens at each N are E(alpha, N) on the chooser's grid."""
    e = AcceptanceEstimate()
    e.alpha_bin = round(alpha * ALPHA_BINS)
    e.expected = list(chooser.expected[e.alpha_bin])
    return e


def accepted_run(r: random.Random, alpha: float, num_drafts: int) -> int:
    """Drafts accepted by a verify when each is accepted with probability alpha in turn."""
    k = 0
    while k < num_drafts and r.random() < alpha:
        k += 1
    return k


def run(
    chooser: DraftLengthChooser,
    estimates: list[AcceptanceEstimate],
    alphas: list[float],
    r: random.Random,
    steps: int,
) -> list[int]:
    """`steps` engine steps: each chooses N for the batch, the drafts proposed at a step are
    verified (observed) at the next one, and a uniform step (verifies and proposes N) is timed
    at the cost table's value, as in the engine."""
    return run_by_step(chooser, estimates, [alphas] * steps, r)


def run_by_step(
    chooser: DraftLengthChooser,
    estimates: list[AcceptanceEstimate],
    alphas_by_step: list[list[float]],
    r: random.Random,
) -> list[int]:
    """`run` with each step's own acceptance rates."""
    chosen, pending, batch = [], 0, len(estimates)
    for alphas in alphas_by_step:
        n = chooser.choose(estimates, batch)
        for e, alpha in zip(estimates, alphas, strict=True):
            if pending:
                chooser.observe(e, accepted_run(r, alpha, pending), pending)
        if n == pending:
            chooser.record_step(batch, n, chooser.costs.cost(batch, n))
        chosen.append(n)
        pending = n
    return chosen


def test_zero_when_drafts_never_land_and_probes_back_off(rng) -> None:
    r = py_random(rng)
    batch = r.randint(1, 8)
    chooser = chooser_with_costs(r, range(1, 9), r.uniform(0.1, 0.4), r.uniform(0.01, 0.3))
    estimates = [AcceptanceEstimate() for _ in range(batch)]
    # Doubling up to MAX_PROBE_INTERVAL, or further where the probe budget's floor says so
    # (a probe's loss is at most its cost over a decode step's): the run sees a few probes at
    # the widest spacing (at a 0.5% budget the floor may pass 500 steps).
    floor = math.ceil(
        (chooser.costs.cost(batch, 1) / chooser.costs.cost(batch, 0) - 1) / PROBE_BUDGET
    )
    widest = max(MAX_PROBE_INTERVAL, min(floor, MAX_PROBE_FLOOR))
    chosen = run(chooser, estimates, [0.0] * batch, r, 350 + 3 * widest)
    assert sum(chosen[20:]) > 0  # probes
    settled = chosen[50:]
    probes = [i for i, n in enumerate(settled) if n]
    assert all(settled[i] == 1 for i in probes), "a probe drafts the smallest N"
    gaps = [b - a for a, b in zip(probes, probes[1:], strict=False)]
    assert gaps == sorted(gaps), gaps
    assert MAX_PROBE_INTERVAL <= gaps[-1] <= max(MAX_PROBE_INTERVAL, floor + 1), (gaps, floor)
    assert len(probes) <= 10
    # Shrunk towards the drafter-wide estimate (PRIOR_WEIGHT observations), which keeps a share
    # of its fresh start.
    assert all(e.alpha_bin <= ALPHA_BINS // 5 for e in estimates)


def test_expensive_probes_stay_within_their_budget(rng) -> None:
    """Where a probe step costs about two decode steps (the CPU), probes after the first that
    finds nothing are PROBE_BUDGET's interval apart at least: their extra time stays within
    the budget of plain decoding's."""
    r = py_random(rng)
    batch = r.randint(1, 4)
    chooser = chooser_with_costs(r, range(1, 5), r.uniform(0.8, 1.2), r.uniform(0.0, 0.05))
    estimates = [AcceptanceEstimate() for _ in range(batch)]
    floor = math.ceil(
        (chooser.costs.cost(batch, 1) / chooser.costs.cost(batch, 0) - 1) / PROBE_BUDGET
    )
    # Long enough for three gaps at the floor (at a 0.5% budget ~200-250 steps here).
    chosen = run(chooser, estimates, [0.0] * batch, r, 100 + 3 * min(floor, MAX_PROBE_FLOOR))
    # Past the fresh prior's drafts and the first probe after them (PROBE_INTERVAL later).
    probes = [i for i, n in enumerate(chosen) if n and i > 4 * PROBE_INTERVAL]
    gaps = [b - a for a, b in zip(probes, probes[1:], strict=False)]
    # The floor counts a probe's expected loss at the estimates, which never reach 0 here (the
    # drafter-wide prior keeps a share of its start): a little under the cost it really pays
    # once they settle; the first gap, while they still fall, up to a quarter under it.
    assert len(gaps) > 1 and min(gaps[1:]) >= 0.9 * min(floor, MAX_PROBE_INTERVAL), (floor, gaps)
    assert gaps[0] >= 0.6 * min(floor, MAX_PROBE_INTERVAL), (floor, gaps)
    extra = sum(
        chooser.costs.cost(batch, n) / chooser.costs.cost(batch, 0) - 1 for n in chosen[probes[0] :]
    )
    assert extra <= PROBE_BUDGET * len(chosen[probes[0] :]) + 2.5  # + the last probe's own


@pytest.mark.parametrize("budget", [PROBE_BUDGET, 2 * PROBE_BUDGET])  # floors under MAX_PROBE_FLOOR
def test_probe_cost_is_measured_over_its_span_and_spaces_the_probes(rng, budget: float) -> None:
    """A probe is not a uniform step: the engine's step times around it (the step that chose
    it, the probe, its verify, the pipeline's refill) are its cost. Where they add up to
    several decode steps more (a GPU's host-bound probe) while the uniform-step table says a
    probe is nearly free, the probes end up spaced by the measured cost: further apart than
    MAX_PROBE_INTERVAL, and the span's slow decode steps do not enter decode's cost."""
    r = py_random(rng)
    batch = r.randint(1, 3)
    # Uniform steps where drafting is cheap (1.05 decode steps for any N)...
    chooser = chooser_with_costs(r, range(1, 4), 0.05, 0.0)
    chooser.probe_budget = budget
    decode = chooser.costs.cost(batch, 0)
    # ... but a probe's span runs at these multiples of a decode step: 4.9 decode steps extra.
    span = [1.0, 3.5, 2.2, 1.6, 1.6][:PROBE_SPAN]
    extra = sum(span) - PROBE_SPAN
    estimates = [AcceptanceEstimate() for _ in range(batch)]
    chosen, pending, left = [], 0, []
    for _ in range(3000):
        n = chooser.choose(estimates, batch)
        for e in estimates:
            if pending:
                chooser.observe(e, 0, pending)
        if n and not left and chooser.probe_timing is not None:  # a probe: its span
            left = list(span)
        scale = left.pop(0) if left else 1.0
        chunks = [SimpleNamespace(num_drafts=pending, token_ids=[0] * (pending + 1))] * batch
        chooser.record_if_uniform(chunks, n, decode * scale)
        chosen.append(n)
        pending = n
    assert chooser.costs.cost(batch, 0) == pytest.approx(decode)
    assert chooser.probe_cost(batch, 1) == pytest.approx(extra * decode)
    probes = [i for i, n in enumerate(chosen) if n]
    gaps = [b - a for a, b in zip(probes, probes[1:], strict=False)]
    # Alpha never quite reaches 0 (the prior keeps a share of its start): a probe commits a
    # little more than a decode step, so the floor is a little under extra / budget.
    assert gaps[-1] > MAX_PROBE_INTERVAL and gaps[-1] >= 0.9 * extra / budget, gaps
    assert gaps[-1] <= 1.1 * extra / budget + 1, gaps  # and no further
    tail = chosen[probes[-3] :]
    assert sum(1 for n in tail if n) * extra <= 1.2 * budget * len(tail) + extra


def test_a_probe_is_priced_only_against_a_timed_decode_step(rng) -> None:
    """A probe's span is compared with as many decode steps: before any was timed at its
    bucket (the prior's unit is no time at all) the span is not kept."""
    r = py_random(rng)
    batch, decode = r.randint(1, 16), r.uniform(0.001, 0.01)
    chooser = DraftLengthChooser.for_device(adaptive_schedule(), "cuda")
    chunks = [SimpleNamespace(num_drafts=0, token_ids=[0])] * batch
    for timed in (False, True):
        if timed:
            chooser.record_step(batch, 0, decode)
        chooser.probe_timing = (batch, PROBE_SPAN, 0.0)
        for _ in range(PROBE_SPAN):
            chooser.record_if_uniform(chunks, 0, 2 * decode)
        assert chooser.probe_timing is None
        assert bool(chooser.probe_extra) == timed
    assert chooser.probe_cost(batch, 1) == pytest.approx(PROBE_SPAN * decode)


def test_only_steady_uniform_steps_are_timed(rng) -> None:
    """The plain steps right after a verify are uniform by their rows, not by their time (async
    decode's first plain step launches two, the next only reads one back): they are not
    timed, so decode's cost stays the steady one while the batch alternates between drafting
    and plain steps, and is timed once STEADY_AFTER uniform steps have passed."""
    r = py_random(rng)
    batch, steady = r.randint(1, 16), r.uniform(0.001, 0.01)
    chooser = DraftLengthChooser.for_device(adaptive_schedule(), "cuda")

    def step(verified: int, proposed: int, seconds: float) -> None:
        chunk = SimpleNamespace(num_drafts=verified, token_ids=[0] * (verified + 1))
        chooser.record_if_uniform([chunk] * batch, proposed, seconds)

    for _ in range(20):  # draft, verify, two refill steps (2.1x and 0.4x steady), draft...
        step(0, 3, 4 * steady)
        step(3, 0, 2 * steady)
        step(0, 0, 2.1 * steady)
        step(0, 0, 0.4 * steady)
    assert not chooser.costs.has(batch, 0) and not chooser.costs.has(batch, 3)
    step(0, 3, 4 * steady)
    step(3, 0, 2 * steady)
    for i in range(STEADY_AFTER + 1):
        step(0, 0, steady)
        assert chooser.costs.has(batch, 0) == (i == STEADY_AFTER)
    assert chooser.costs.cost(batch, 0) == steady
    for _ in range(STEADY_AFTER + 1):  # steady drafting is timed the same way
        step(3, 3, 3 * steady)
    assert chooser.costs.cost(batch, 3) == 3 * steady


def test_a_long_plain_decode_run_is_timed_at_a_stride(rng) -> None:
    """A run of plain decode steps is timed step by step until its cost window is full, then
    one step in DECODE_TIMING_STRIDE (each timing is host time on a small target); a steady
    drafting run is timed every step."""
    r = py_random(rng)
    batch = r.randint(1, 16)
    chooser = DraftLengthChooser.for_device(adaptive_schedule(), "cuda")
    timed: list[tuple[int, float]] = []
    chooser.record_step = lambda b, n, seconds: timed.append((n, seconds))
    chunk = SimpleNamespace(num_drafts=0, token_ids=[0])
    run_length = STEADY_AFTER + COST_WINDOW + r.randint(3, 6) * DECODE_TIMING_STRIDE
    times = [r.uniform(0.001, 0.01) for _ in range(run_length)]
    for seconds in times:
        chooser.record_if_uniform([chunk] * batch, 0, seconds)
    counts = range(1, run_length + 1)  # the uniform run's count at each step
    expected = [
        (0, t)
        for count, t in zip(counts, times, strict=True)
        if count > STEADY_AFTER
        and (count <= STEADY_AFTER + COST_WINDOW or count % DECODE_TIMING_STRIDE == 0)
    ]
    assert timed == expected
    assert len(expected) < COST_WINDOW + run_length // DECODE_TIMING_STRIDE + 1
    timed.clear()
    drafting = SimpleNamespace(num_drafts=3, token_ids=[0] * 4)
    for seconds in times:
        chooser.record_if_uniform([drafting] * batch, 3, seconds)
    assert timed == [(3, t) for t in times[STEADY_AFTER:]]


def test_most_drafts_when_they_always_land(rng) -> None:
    r = py_random(rng)
    batch = r.randint(1, 8)
    chooser = chooser_with_costs(r, range(1, 9), r.uniform(0.1, 0.5), r.uniform(0.005, 0.05))
    estimates = [AcceptanceEstimate() for _ in range(batch)]
    chosen = run(chooser, estimates, [1.0] * batch, r, 40)
    # At the fresh prior (alpha 0.6) an expensive drafter may not pay yet: the first probe's
    # full acceptance must then lift the batch to the largest N within a few steps.
    settled = PROBE_INTERVAL + 4
    assert chosen[settled:] == [NUM_SPEC] * (40 - settled), chosen
    assert all(e.alpha_bin == ALPHA_BINS for e in estimates)


def test_recovers_after_probes_when_text_becomes_predictable(rng) -> None:
    r = py_random(rng)
    batch = r.randint(1, 4)
    chooser = chooser_with_costs(r, range(1, 5), r.uniform(0.1, 0.3), r.uniform(0.01, 0.1))
    estimates = [AcceptanceEstimate() for _ in range(batch)]
    probes = [i for i, n in enumerate(run(chooser, estimates, [0.0] * batch, r, 300)) if n]
    assert probes[-1] - probes[-2] > PROBE_INTERVAL  # backed off
    interval = chooser.probe_interval
    assert interval > PROBE_INTERVAL
    # The probe due next may still double the interval (the batch's estimates only move at its
    # verify); the one after it finds them risen.
    steps = min(2 * interval, interval + MAX_PROBE_INTERVAL) + 20 * PROBE_INTERVAL + 20
    chosen = run(chooser, estimates, [1.0] * batch, r, steps)
    first = next(i for i, n in enumerate(chosen) if n)
    assert first <= interval and chosen[first] == 1  # the next probe
    # Drafting the most for 10 steps in a row at least (RECALIBRATE_INTERVAL steps later,
    # plain decoding is timed again).
    assert ",".join([str(NUM_SPEC)] * 10) in ",".join(map(str, chosen)), chosen
    assert chooser.probe_interval == PROBE_INTERVAL
    # After the probe, N at most doubles a step until the largest is reached.
    drafted = [n for n in chosen[first:] if n]
    ramp = drafted[: drafted.index(NUM_SPEC) + 1]
    assert all(b <= 2 * a for a, b in zip(ramp, ramp[1:], strict=False)), ramp
    assert len(set(ramp)) >= 3, ramp  # 1, then at least 2, then 4 on the way to 7


def test_one_lucky_probe_buys_no_jump_to_the_largest_n(rng) -> None:
    """A batch at N = 0 whose probe's draft lands (drafts otherwise rarely do) drafts at
    most twice the probe's N next, not the largest N one verify's estimate would pay for."""
    r = py_random(rng)
    chooser = chooser_with_costs(r, range(1, 2), 0.0, 0.0)  # free drafts: N = 7 pays
    one = [AcceptanceEstimate()]
    chosen = run(chooser, one, [0.0], r, 200)  # the prior learns that drafts never land
    # Plain decoding by now, but for a probe (one may fall on the last steps).
    assert chosen[-10:].count(0) >= 9 and one[0].alpha_bin < ALPHA_BINS // 8, chosen[-10:]
    while chooser.choose(one, 1) == 0:  # until the next probe
        pass
    chooser.observe(one[0], 1, 1)  # its one draft lands
    alpha = one[0].alpha_bin / ALPHA_BINS
    unlimited = max(range(NUM_SPEC + 1), key=lambda n: rate(chooser, [alpha], 1, n))
    assert unlimited > 2  # what the estimate alone would draft
    assert chooser.choose(one, 1) == 2


def test_a_ramp_moved_to_a_coarser_cap_drafts_its_smallest_n() -> None:
    """A ramp from a 1-draft probe whose batch grows to where only 0, 3 or 7 drafts are
    allowed drafts 3 (not 0, nor 7 at once), then 7: each step the next allowed N up when none
    lies within twice the last."""
    chooser = trusted_chooser(0.95, explore=False)
    chooser.record_step(32, 0, 0.01)  # decode timed: no calibration steps
    chooser.ramp = 1
    sure = estimate_at(chooser, 1.0)
    assert chooser.choose([sure] * 32, 32) == 3
    assert chooser.choose([sure] * 32, 32) == 7
    assert chooser.ramp == 0  # done: 7 needed no cap


def brute_force(chooser: DraftLengthChooser, alphas: list[float], batch: int) -> float:
    """The best expected tokens per second over every allowed N, at exact alphas, drafting
    only where it gains MIN_DRAFT_GAIN over plain decoding."""
    allowed = chooser.schedule.allowed(chooser.schedule.num_drafts(batch))
    return max(rate(chooser, alphas, batch, n) for n in allowed)


def rate(chooser: DraftLengthChooser, alphas: list[float], batch: int, n: int) -> float:
    tokens = sum(expected_tokens(a, n) for a in alphas)
    return tokens / chooser.costs.cost(batch, n) / (1 + MIN_DRAFT_GAIN * (n > 0))


def test_choice_maximises_expected_tokens_per_second(rng) -> None:
    """On random cost tables and per-request alphas (set through the estimate), the chosen N
    is within the alpha grid's rounding of the best rate, and never a probe here; the rates
    `expected_rates` reports are the ones the choice maximises."""
    r = py_random(rng)
    for _ in range(200):
        chooser = chooser_with_costs(r, range(1, 17), r.uniform(0, 1), r.uniform(0, 0.5))
        batch = r.randint(1, 16)
        estimates = [
            estimate_at(chooser, r.randint(0, ALPHA_BINS) / ALPHA_BINS) for _ in range(batch)
        ]
        alphas = [e.alpha_bin / ALPHA_BINS for e in estimates]
        weighed = chooser.expected_rates(estimates, batch)  # what choose compares, unchosen
        n = chooser.choose(estimates, batch)
        assert rate(chooser, alphas, batch, n) == pytest.approx(
            brute_force(chooser, alphas, batch), rel=1e-9
        )
        allowed = chooser.schedule.allowed(chooser.schedule.num_drafts(batch))
        assert set(weighed) == set(allowed) and weighed[n] == max(weighed.values())
        assert all(weighed[m] == pytest.approx(rate(chooser, alphas, batch, m)) for m in allowed)


def test_estimate_converges_to_the_acceptance_rate(rng) -> None:
    """alpha from truncated runs (the MLE, not accepted / drafted) tracks each request's own
    acceptance rate, whatever N its verifies used."""
    r = py_random(rng)
    chooser = DraftLengthChooser.for_device(adaptive_schedule(), "cpu")
    for _ in range(30):
        alpha, e = r.uniform(0.05, 0.95), AcceptanceEstimate()
        estimates = []
        for _ in range(400):
            n = r.randint(1, NUM_SPEC)
            chooser.observe(e, accepted_run(r, alpha, n), n)
            estimates.append(e.alpha_bin / ALPHA_BINS)
        # The estimate is shrunk towards the engine-wide prior (PRIOR_WEIGHT observations
        # against ~5 verifies of memory), itself lagging the requests before: up to ~0.11 off
        # at the ends of the range.
        assert sum(estimates[100:]) / 300 == pytest.approx(alpha, abs=0.14)


def test_calibrates_plain_decode_at_each_new_bucket() -> None:
    """A batch bucket met for the first time decodes (N = 0) for CALIBRATION_STEPS steps unless
    its decode steps were timed (CUDA's prior: drafting pays at once after them)."""
    chooser = DraftLengthChooser.for_device(adaptive_schedule(), "cuda")
    one = [AcceptanceEstimate()]
    assert [chooser.choose(one, 1) for _ in range(CALIBRATION_STEPS)] == [0] * CALIBRATION_STEPS
    assert chooser.choose(one, 1) > 0  # the prior trusts a fresh drafter
    chooser.record_step(2, 0, 0.01)
    assert chooser.choose(one * 3, 3) > 0  # bucket 2-3: decode timed
    assert chooser.choose(one * 4, 4) == 0  # bucket 4-7: new
    chooser.record_step(3, 0, 0.01)  # a batch that decodes needs no calibration
    assert all(chooser.choose(one * 3, 3) for _ in range(RECALIBRATE_INTERVAL - 1))


@pytest.mark.parametrize("alpha", [0.3, 0.95])
def test_recalibrates_plain_decode_as_often_as_the_budget_allows(alpha: float) -> None:
    """A drafting batch times plain decoding again after RECALIBRATE_INTERVAL steps, or after
    as many as keep the calibration's lost rate within RECALIBRATE_BUDGET when drafting wins
    by much (a good drafter's batch recalibrates less often than a marginal one's)."""
    chooser = DraftLengthChooser.for_device(adaptive_schedule(), "cuda")
    set_drafter_prior(chooser, alpha)
    one = [AcceptanceEstimate()]
    assert [chooser.choose(one, 1) for _ in range(CALIBRATION_STEPS)] == [0] * CALIBRATION_STEPS
    rates = chooser.expected_rates(one, 1)
    best = max(rates, key=rates.get)
    assert best > 0, rates
    lost = CALIBRATION_STEPS * (1 - rates[0] / rates[best]) / RECALIBRATE_BUDGET
    interval = max(RECALIBRATE_INTERVAL, lost)
    chosen = [chooser.choose(one, 1) for _ in range(3 * math.ceil(interval))]
    starts = [i for i, n in enumerate(chosen) if n == 0 and (i == 0 or chosen[i - 1])]
    assert all(chosen[i : i + CALIBRATION_STEPS] == [0] * CALIBRATION_STEPS for i in starts)
    assert chosen.count(0) == len(starts) * CALIBRATION_STEPS
    gaps = [b - a for a, b in zip([-CALIBRATION_STEPS, *starts], starts, strict=False)]
    assert len(gaps) >= 2 and all(gap == math.ceil(interval) for gap in gaps), (gaps, interval)
    assert (interval > RECALIBRATE_INTERVAL) == (alpha > 0.5), (alpha, interval)


def test_times_decode_again_when_a_drafting_step_was_cheaper(rng) -> None:
    """A decode time taken in a slow stretch (no cheaper than the drafting steps timed after
    it) is taken again once it has stood DECODE_RECHECK_SPACING steps, then at doubling
    spacings while each new one is no cheaper either; with the calm time back, drafts that
    barely land stop, and the spacing starts over."""
    r = py_random(rng)
    chooser = DraftLengthChooser.for_device(adaptive_schedule(), "cpu")
    alpha = r.uniform(0.25, 0.35)
    set_drafter_prior(chooser, alpha)
    one = [AcceptanceEstimate(sampled=True)]
    decode = r.uniform(0.02, 0.05)
    assert [chooser.choose(one, 1) for _ in range(CALIBRATION_STEPS)] == [0] * CALIBRATION_STEPS
    allowed = chooser.allowed_by_cap[chooser.schedule.num_drafts(1)]
    for n in allowed[1:]:  # every N's drafting steps timed calm
        for _ in range(COST_WINDOW):
            chooser.record_step(1, n, (1.5 + 0.05 * n) * decode)
    spacing = DECODE_RECHECK_SPACING
    for _ in range(3):
        for _ in range(COST_WINDOW):  # timed in a stretch 2.5x slower
            chooser.record_step(1, 0, 2.5 * decode)
        timed_at = chooser.num_steps
        while (n := chooser.choose(one, 1)) > 0:  # decode looks dear: drafting pays on paper
            chooser.record_step(1, n, (1.5 + 0.05 * n) * decode)  # calm drafting steps
        assert chooser.num_steps - timed_at == spacing
        rest = [chooser.choose(one, 1) for _ in range(CALIBRATION_STEPS - 1)]
        assert rest == [0] * (CALIBRATION_STEPS - 1)
        spacing = min(2 * spacing, RECALIBRATE_INTERVAL)
    for _ in range(COST_WINDOW // 2 + 1):  # calm at last
        chooser.record_step(1, 0, decode)
    assert chooser.costs.cost(1, 0) == decode
    assert all(chooser.choose(one, 1) == 0 for _ in range(PROBE_INTERVAL - 1))
    assert chooser.decode_recheck_spacing
    chooser.record_step(1, 1, 1.5 * decode)  # a drafting step dearer than decode again
    assert not chooser.decode_suspect and not chooser.decode_recheck_spacing


@pytest.mark.parametrize("alpha", [0.3, 0.9])
def test_rechecks_a_slow_decode_time_only_where_decode_could_win(rng, alpha: float) -> None:
    """Once decode was timed calm, a later slow time is taken again only if decode at that
    calm time would beat the drafting chosen: a good drafter's batch drafts on."""
    r = py_random(rng)
    chooser = DraftLengthChooser.for_device(adaptive_schedule(), "cpu")
    set_drafter_prior(chooser, alpha)
    one = [AcceptanceEstimate(sampled=True)]
    decode = r.uniform(0.02, 0.05)
    assert [chooser.choose(one, 1) for _ in range(CALIBRATION_STEPS)] == [0] * CALIBRATION_STEPS
    for _ in range(COST_WINDOW):
        chooser.record_step(1, 0, decode)
    for n in chooser.allowed_by_cap[chooser.schedule.num_drafts(1)][1:]:
        for _ in range(COST_WINDOW):
            chooser.record_step(1, n, (1.5 + 0.05 * n) * decode)
    for _ in range(COST_WINDOW):  # a slow stretch
        chooser.record_step(1, 0, 2.5 * decode)
    chosen = []
    while len(chosen) < 2 * DECODE_RECHECK_SPACING and (n := chooser.choose(one, 1)) > 0:
        chooser.record_step(1, n, (1.5 + 0.05 * n) * decode)
        chosen.append(n)
    if alpha < 0.5:
        assert len(chosen) == DECODE_RECHECK_SPACING - 1  # then decode is timed again
    else:
        assert len(chosen) == 2 * DECODE_RECHECK_SPACING


def test_cost_model_prior_scaling_and_clipping(rng) -> None:
    r = py_random(rng)
    prior = CostPrior(drafter_overhead=r.uniform(0, 1), per_row=r.uniform(0, 1))
    model = StepCostModel(prior)
    batch, decode = r.randint(1, 64), r.uniform(0.001, 0.1)
    assert model.cost(batch, 3) == prior(batch, 3)  # nothing timed: decode-step units
    model.record(batch, 0, decode)
    # Untimed N: the prior's ratio times the bucket's timed decode step.
    assert model.cost(batch, 5) == pytest.approx(decode * prior(batch, 5))
    assert model.cost(batch, 0) == decode
    model.record(batch, 0, 100 * decode)  # an outlier: the median ignores it
    assert model.cost(batch, 0) == decode
    for _ in range(COST_WINDOW // 2 + 1):  # a lasting change: followed within a few steps
        model.record(batch, 0, 2 * decode)
    assert model.cost(batch, 0) == 2 * decode
    other = 2 * batch + 1  # another bucket: its own unit
    assert model.cost(other, 0) == prior(other, 0)


def test_posterior_expected_tokens_average_e_over_the_beta_posterior(rng) -> None:
    """A verified request's expected tokens at each N are E(alpha, N) averaged over its
    Beta(a, b) posterior (checked against quadrature), at least E at the posterior's mean (E is
    convex in alpha), and computed only when a choice needs them."""
    r = py_random(rng)
    chooser = DraftLengthChooser.for_device(adaptive_schedule(), "cuda")
    e = AcceptanceEstimate()
    for _ in range(r.randint(1, 6)):
        chooser.observe(e, r.randint(0, NUM_SPEC), NUM_SPEC)
    assert e.expected == []  # an engine with N pinned never needs them
    a, b = e.posterior
    grid = torch.linspace(0, 1, 200_001, dtype=torch.float64)[1:-1]
    log_pdf = (a - 1) * grid.log() + (b - 1) * (1 - grid).log()
    log_pdf -= math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)
    weights = log_pdf.exp() * (grid[1] - grid[0])
    tokens, _ = chooser._batch_view([e])
    for n in range(NUM_SPEC + 1):
        e_n = sum(grid**k for k in range(n + 1))
        assert tokens[n] == pytest.approx(float((weights * e_n).sum()), rel=2e-3)
        assert tokens[n] >= expected_tokens(a / (a + b), n) - 1e-12
    assert e.expected == tokens


def test_greedy_and_sampled_requests_have_their_own_prior(rng) -> None:
    """Sampled requests whose drafts never land lower sampled requests' engine-wide estimate,
    not greedy ones': a fresh greedy request still drafts where a fresh sampled one does not
    (one shared estimate kept greedy requests from drafting after sampled ones)."""
    r = py_random(rng)
    chooser = chooser_with_costs(r, range(1, 2), 0.3, 0.05)
    alpha = r.uniform(0.6, 0.9)
    for _ in range(300):  # greedy requests' verifies, then many more of sampled ones'
        chooser.observe(AcceptanceEstimate(), accepted_run(r, alpha, 3), 3)
    for _ in range(r.randint(300, 600)):
        chooser.observe(AcceptanceEstimate(sampled=True), 0, 3)
    assert chooser.prior_alpha() == pytest.approx(alpha, abs=0.1)
    assert chooser.prior_alpha(sampled=True) < 0.05
    assert chooser.choose([AcceptanceEstimate()], 1) > 0
    assert chooser.choose([AcceptanceEstimate(sampled=True)], 1) == 0
    # A batch of both: its tokens at N are each kind's own.
    both = [AcceptanceEstimate(), AcceptanceEstimate(sampled=True)]
    rates = chooser.expected_rates(both, 2)
    greedy = expected_tokens(round(chooser.prior_alpha() * ALPHA_BINS) / ALPHA_BINS, 3)
    sampled = expected_tokens(round(chooser.prior_alpha(True) * ALPHA_BINS) / ALPHA_BINS, 3)
    cost = chooser.step_cost(2, 3) * (1 + MIN_DRAFT_GAIN)
    assert rates[3] == pytest.approx((greedy + sampled) / cost)


def test_greedy_and_sampled_batches_have_their_own_step_costs(rng) -> None:
    """A batch with a sampled request is priced from the steps of such batches, a greedy one
    from greedy steps: where sampled steps make drafting 3x a decode step and greedy ones 1.2x,
    at the same alpha a greedy batch drafts and a sampled one does not, whichever kind's steps
    were timed last (one table for both priced one kind's drafting with the other's times)."""
    r = py_random(rng)
    chooser = DraftLengthChooser.for_device(adaptive_schedule(), "cuda")
    alpha = r.uniform(0.45, 0.55)
    set_drafter_prior(chooser, alpha)
    decode = r.uniform(0.5e-3, 2e-3)
    drafting = {False: 1.2, True: 3.0}  # a drafting step, in decode steps of its kind
    for sampled in r.sample([False, True], 2):
        chooser.costs.sampled = sampled
        for n in range(NUM_SPEC + 1):
            scale = (1.25 if sampled else 1.0) * (drafting[sampled] if n else 1.0)
            chooser.record_step(1, n, decode * scale)
    for sampled in [r.random() < 0.5 for _ in range(6)]:
        n = chooser.choose([AcceptanceEstimate(sampled=sampled)], 1)
        assert (n == 0) == sampled
        assert chooser.step_cost(1, 1) == pytest.approx(
            decode * (1.25 if sampled else 1.0) * drafting[sampled]
        )


def test_cap_from_the_schedule_bounds_the_choice(rng) -> None:
    """'auto' on the CPU: the chooser never drafts from AUTO_CPU_STOP_BATCH requests on, and
    picks among 0..N below it."""
    r = py_random(rng)
    chooser = DraftLengthChooser.for_device(DraftSchedule.resolve("auto", 2, "cpu"), "cpu")
    always = estimate_at(chooser, 1.0)
    for _ in range(20):
        batch = r.randint(1, 40)
        n = chooser.choose([always] * batch, batch)
        assert n == 0 if batch >= 4 else n in (0, 2)


def test_fresh_drafter_is_drafted_once_decode_is_timed() -> None:
    """Before any drafting step is timed, the prior prices verify rows (dearer on one CPU thread
    than on two, and a row on the CPU dearer than on a GPU): at a fresh drafter's alpha (0.6)
    drafting pays on each, so the first step after decode's calibration drafts, at the N that
    maximises expected tokens per prior cost."""
    one = [AcceptanceEstimate()]
    one_thread, two, cuda = (CostPrior.for_device(*d) for d in (("cpu", 1), ("cpu", 2), ("cuda",)))
    assert one_thread.per_row > two.per_row > cuda.per_row
    assert all(one_thread(1, n) > two(1, n) for n in range(1, NUM_SPEC + 1))
    for device, threads in (("cpu", 1), ("cpu", 2), ("cuda", 2)):
        chooser = DraftLengthChooser.for_device(adaptive_schedule(), device, threads)
        chosen = [chooser.choose(one, 1) for _ in range(CALIBRATION_STEPS + 1)]
        prior = chooser.costs.prior
        best = max(range(NUM_SPEC + 1), key=lambda n: expected_tokens(0.6, n) / prior(1, n))
        assert chosen == [0] * CALIBRATION_STEPS + [best] and best > 0, (device, threads, chosen)


def run_timed(
    chooser: DraftLengthChooser,
    alphas: list[float],
    r: random.Random,
    steps: int,
    seconds: dict[int, float],  # the true cost of a uniform step at each N
) -> list[int]:
    """`run`, with every step's wall time given to `record_if_uniform` as the engine does: a
    uniform step (verifies and proposes N) costs seconds[N], a step changing N the mean of the
    two."""
    estimates = [AcceptanceEstimate() for _ in alphas]
    chosen, pending = [], 0
    for _ in range(steps):
        n = chooser.choose(estimates, len(alphas))
        for e, alpha in zip(estimates, alphas, strict=True):
            if pending:
                chooser.observe(e, accepted_run(r, alpha, pending), pending)
        chunk = SimpleNamespace(num_drafts=pending, token_ids=[0] * (pending + 1))
        wall = seconds[n] if n == pending else (seconds[n] + seconds[pending]) / 2
        chooser.record_if_uniform([chunk] * len(alphas), n, wall)
        chosen.append(n)
        pending = n
    return chosen


def trusted_chooser(alpha: float, explore: bool = True) -> DraftLengthChooser:
    """'auto' on CUDA (0, 3 or 7 drafts at 32 requests) with a drafter history at `alpha`;
    `explore` False: its prior's explore_margin 0."""
    chooser = DraftLengthChooser.for_device(DraftSchedule.resolve("auto", 15, "cuda"), "cuda")
    set_drafter_prior(chooser, alpha, 100)
    if not explore:
        chooser.costs.prior = dataclasses.replace(chooser.costs.prior, explore_margin=0.0)
    return chooser


def test_explores_a_draft_length_the_prior_prices_close_to_the_best(rng) -> None:
    """Where 3 drafts cost much less than the prior's straight line says (a 27B verify of
    32 x 4 rows still reads weights, of 32 x 8 computes), the chooser, once its pick (7) is
    timed, drafts 3 for a few steps, times it and keeps it, exploring it once. Without
    exploring it would stay at 7."""
    r = py_random(rng)
    batch, decode = 32, r.uniform(0.01, 0.03)
    seconds = {0: decode, 3: 1.4 * decode, 7: 2.5 * decode}
    alphas = [r.uniform(0.82, 0.9) for _ in range(batch)]
    chooser = trusted_chooser(0.86)
    assert chooser.schedule.allowed(chooser.schedule.num_drafts(batch)) == (0, 3, 7)
    chosen = run_timed(chooser, alphas, r, 80, seconds)
    assert 3 not in chosen[: chosen.index(7)]  # the prior's pick first
    assert chosen[-30:] == [3] * 30, chosen  # (no re-timing of 7 on the GPU's prior)
    assert chooser.explored == {(chooser.costs.bucket(batch), 3)}
    chosen = run_timed(trusted_chooser(0.86, explore=False), alphas, r, 80, seconds)
    assert 3 not in chosen and chosen[-30:] == [7] * 30, chosen


@pytest.mark.parametrize("retime", [True, False])
def test_times_again_a_draft_length_timed_in_a_slow_stretch(rng, monkeypatch, retime) -> None:
    """A drafter that agrees: the largest N pays most, but its two timed steps fell in a burst
    of load (2.5x) while the N below it was timed calm. The chooser takes the largest again
    once its timing has stood DRAFT_RETIME_SPACING steps, and keeps it; without re-timing it
    would stay one short of it for good."""
    if not retime:
        monkeypatch.setattr(draft_length, "DRAFT_RETIME_SPACING", 10**9)
    r = py_random(rng)
    chooser = DraftLengthChooser.for_device(adaptive_schedule(), "cpu")
    set_drafter_prior(chooser, 0.97)
    decode = r.uniform(0.01, 0.05)
    seconds = {n: decode * chooser.costs.prior(1, n) for n in range(NUM_SPEC + 1)}
    for n in range(1, NUM_SPEC):  # timed calm, a full window each
        for _ in range(COST_WINDOW):
            chooser.record_step(1, n, seconds[n])
    for _ in range(2):
        chooser.record_step(1, NUM_SPEC, 2.5 * seconds[NUM_SPEC])
    chosen = run_timed(chooser, [0.97], r, 120, seconds)  # its 2 slow steps timed at step 0
    if retime:
        first = chosen.index(NUM_SPEC)  # choose() counts from 1: index + 1 steps have stood
        assert DRAFT_RETIME_SPACING <= first + 1 < DRAFT_RETIME_SPACING + RETIME_CHECK_STRIDE
        assert chosen[first:] == [NUM_SPEC] * (120 - first), chosen
    else:
        assert NUM_SPEC not in chosen and chosen[-20:] == [NUM_SPEC - 1] * 20, chosen


def test_no_exploration_where_the_prior_prices_an_n_far_below_the_best(rng) -> None:
    """Drafts that nearly always land make 7 drafts worth far more than 3 at the prior's costs:
    3 is never drafted, and step costs that match the prior leave the choice at 7."""
    r = py_random(rng)
    chooser = trusted_chooser(0.99)
    batch, decode = 32, r.uniform(0.01, 0.03)
    seconds = {n: decode * chooser.costs.prior(batch, n) for n in (0, 3, 7)}
    chosen = run_timed(chooser, [0.99] * batch, r, 60, seconds)
    assert 3 not in chosen and chosen[-20:] == [7] * 20, chosen
    assert not chooser.explored


def test_no_exploration_on_the_cpu(rng) -> None:
    """The CPU's prior is a fit of its measured steps and every N up to the cap is allowed:
    the chooser drafts the N it prices best, exploring none."""
    assert CostPrior.for_device("cpu", 1).explore_margin == 0.0
    assert CostPrior.for_device("cpu", 2).explore_margin == 0.0
    assert CostPrior.for_device("cuda").explore_margin > 0.0
    r = py_random(rng)
    chooser = DraftLengthChooser.for_device(adaptive_schedule(), "cpu")
    decode = r.uniform(0.01, 0.03)
    seconds = {n: decode * (1.0 + 0.1 * n) for n in range(NUM_SPEC + 1)}
    # Drafts that always land: the estimate, and so the best N, stays put (at 0.95 a run of
    # rejections may make 6 the best for a step), and a CPU that explored would try 6.
    chosen = run_timed(chooser, [1.0], r, 60, seconds)
    assert not chooser.explored and chosen[-20:] == [NUM_SPEC] * 20, chosen


def test_a_measured_probe_prices_drafting_steps_not_yet_timed(rng) -> None:
    """On a GPU the prior prices a drafting step at ~1.36 decode steps; where the probes' spans
    measured drafting as dear (a host-bound GPU: ~2 decode steps a drafting step) and no
    drafting step was timed, requests of middling acceptance must not draft on the prior's
    word: an untimed N > 0 costs at least a decode step plus half a probe's extra. A timed N
    is priced by its time. (The fresh drafter's first drafts, before any probe, are timed at
    what drafting costs there.)"""
    r = py_random(rng)
    chooser = DraftLengthChooser.for_device(adaptive_schedule(), "cuda")
    decode = r.uniform(0.5e-3, 2e-3)
    span = [1.0, 3.5, 2.2, 1.6, 1.6][:PROBE_SPAN]  # a probe's span, in decode steps
    nothing = [AcceptanceEstimate()]  # drafts that never land: it probes, and times the probes
    pending, left = 0, []
    for _ in range(200):
        n = chooser.choose(nothing, 1)
        if pending:
            chooser.observe(nothing[0], 0, pending)
        if n and not left and chooser.probe_timing is not None:  # a probe: its span
            left = list(span)
        chunks = [SimpleNamespace(num_drafts=pending, token_ids=[0] * (pending + 1))]
        steps = left.pop(0) if left else (2.0 if n else 1.0)
        chooser.record_if_uniform(chunks, n, decode * steps)
        pending = n
    extra = chooser.measured_probe_cost(1)
    assert extra == pytest.approx((sum(span) - PROBE_SPAN) * decode)
    middling = estimate_at(chooser, 0.45)
    untimed = [n for n in range(1, NUM_SPEC + 1) if not chooser.costs.has(1, n)]
    assert 1 in untimed  # the probes' N: never a uniform step
    rates = chooser.expected_rates([middling], 1)
    assert all(chooser.step_cost(1, n) >= decode + extra / 2 for n in untimed)
    assert max(rates, key=rates.get) == 0, rates
    # The prior alone would have drafted.
    fresh = DraftLengthChooser.for_device(adaptive_schedule(), "cuda")
    fresh.record_step(1, 0, decode)
    prior_rates = fresh.expected_rates([middling], 1)
    assert max(prior_rates, key=prior_rates.get) > 0, prior_rates
    # A drafting step timed cheap is priced by its time.
    chooser.record_step(1, 1, 1.1 * decode)
    assert chooser.step_cost(1, 1) == pytest.approx(1.1 * decode)
    timed = chooser.expected_rates([middling], 1)
    assert timed[1] > timed[0], timed


def posterior_mean(e: AcceptanceEstimate) -> float:
    a, b = e.posterior
    return a / (a + b)


@pytest.mark.parametrize("idle_decay", [IDLE_DECAY, 1.0])
def test_a_request_stopped_by_a_poor_stretch_drafts_again_without_a_probe(
    rng, monkeypatch, idle_decay: float
) -> None:
    """A request whose last verifies found nothing (a poor stretch of its text) stops drafting;
    while it decodes, those counts decay (IDLE_DECAY a step) back towards the drafter's
    engine-wide estimate, good here, so it drafts again by itself before a probe would come;
    with no decay its belief stays where the poor stretch left it."""
    monkeypatch.setattr(draft_length, "IDLE_DECAY", idle_decay)
    r = py_random(rng)
    chooser = chooser_with_costs(r, range(1, 2), r.uniform(0.6, 0.8), 0.02)
    alpha = r.uniform(0.7, 0.8)
    set_drafter_prior(chooser, alpha, 50)  # other requests' verifies: drafts land
    one = [AcceptanceEstimate()]
    for _ in range(r.randint(6, 8)):  # the poor stretch: nothing lands, N = 7 each verify
        chooser.observe(one[0], 0, NUM_SPEC)
    assert chooser.choose(one, 1) == 0
    after_stretch = posterior_mean(one[0])
    chooser.probe_interval = 10**6  # no probe within the test
    chosen = [chooser.choose(one, 1) for _ in range(60)]
    if idle_decay < 1:
        first = next(i for i, n in enumerate(chosen) if n)
        assert first < 40 and chosen[first] > 1, chosen
        assert posterior_mean(one[0]) > after_stretch  # on its way back to the prior's
    else:
        assert not any(chosen) and posterior_mean(one[0]) == after_stretch, chosen


def test_what_an_idle_stretchs_probes_find_does_not_decay(rng) -> None:
    """Only the counts from before the batch's idle stretch decay at its steps: a probe's
    find during the stretch stays (bar the usual decay at later verifies), and the verify of
    the drafts before the stretch, read back after it began, decays with the rest."""
    r = py_random(rng)
    chooser = chooser_with_costs(r, range(1, 2), r.uniform(0.8, 1.2), 0.02)
    set_drafter_prior(chooser, 0.01, 100)  # drafts rarely land: the batch will not draft
    one = [AcceptanceEstimate()]
    chooser.observe(one[0], 0, 3)
    assert chooser.choose(one, 1) == 0  # the idle stretch begins
    chooser.observe(one[0], 0, 3)  # the last drafting step's verify, read back late
    before = one[0].rejected
    for _ in range(IDLE_AGE_STEPS):
        assert chooser.choose(one, 1) == 0
    assert one[0].rejected == pytest.approx(before * IDLE_DECAY**IDLE_AGE_STEPS)
    while (probe := chooser.choose(one, 1)) == 0:  # to the stretch's first probe
        pass
    landed = r.randint(1, probe)
    chooser.observe(one[0], landed, probe)
    stale = one[0].rejected - (landed < probe)
    for _ in range(8 * IDLE_AGE_STEPS):
        if chooser.choose(one, 1):  # another probe: leave its verify unread
            chooser.probe_timing = None
    assert one[0].accepted == pytest.approx(landed)
    assert one[0].rejected == pytest.approx(
        (landed < probe) + stale * IDLE_DECAY ** (8 * IDLE_AGE_STEPS)
    )


def test_a_ramp_after_a_probe_doubles_at_most_till_the_largest_n() -> None:
    """After a probe, N at most doubles a step (or takes the next allowed N up) till it
    reaches the largest allowed, even where one step's N needed no cap: 3 drafts, 3 again,
    then 7 (not 15 at once), then 15."""
    chooser = trusted_chooser(0.95, explore=False)  # 0, 3, 7 or 15 drafts at batch 1
    chooser.record_step(1, 0, 0.01)  # decode timed: no calibration steps
    chooser.ramp = 3  # a probe of 3 drafts
    middling, sure = estimate_at(chooser, 0.33), estimate_at(chooser, 1.0)
    rates = chooser.expected_rates([middling], 1)
    assert max(rates, key=rates.get) == 3, rates
    assert chooser.choose([middling], 1) == 3
    assert [chooser.choose([sure], 1) for _ in range(3)] == [7, 15, 15]
    assert chooser.ramp == 0


def idle_request(
    r: random.Random, overhead: float, prior: float = 0.01
) -> tuple[DraftLengthChooser, list[AcceptanceEstimate]]:
    """A batch-1 chooser whose drafter's history puts alpha at `prior` (drafts rarely land: the
    batch will not draft), with no probe within a test, and its one request, verified once
    with nothing accepted."""
    chooser = chooser_with_costs(r, range(1, 2), overhead, 0.02)
    set_drafter_prior(chooser, prior, 100)
    chooser.probe_interval = 10**6
    one = [AcceptanceEstimate()]
    chooser.observe(one[0], 0, 3)
    return chooser, one


def test_a_long_idle_stretch_leaves_decayed_estimates_alone(rng) -> None:
    """Once the counts from before an idle stretch have decayed away, its later steps leave
    each request's posterior and expected tokens as they are (no work a step for nothing)."""
    r = py_random(rng)
    chooser, one = idle_request(r, r.uniform(0.8, 1.2))
    early = [chooser.choose(one, 1) for _ in range(IDLE_AGE_STEPS + 1)]
    assert early == [0] * (IDLE_AGE_STEPS + 1) and one[0].rejected < 1.0  # decaying
    for _ in range(100 * IDLE_AGE_STEPS):
        chooser.choose(one, 1)
    posterior, expected = one[0].posterior, one[0].expected
    assert [chooser.choose(one, 1) for _ in range(4 * IDLE_AGE_STEPS)] == [0] * 4 * IDLE_AGE_STEPS
    assert one[0].posterior == posterior and one[0].expected is expected


def stretch_run(chooser: DraftLengthChooser, r: random.Random, batch: int, steps: int) -> list[int]:
    """`steps` steps of `batch` requests whose text alternates stretches the drafter gets right
    (alpha 0.95, 30-60 steps) and wrong (alpha 0, 150-250 steps), as `run` runs them."""
    estimates = [AcceptanceEstimate(sampled=r.random() < 0.5) for _ in range(batch)]
    alphas, good = [], False
    while len(alphas) < steps:
        good = not good
        alpha, length = (0.95, r.randint(30, 60)) if good else (0.0, r.randint(150, 250))
        alphas += [[alpha] * batch] * length
    return run_by_step(chooser, estimates, alphas[:steps], r)


def test_an_idle_batch_left_unweighed_chooses_as_weighing_would(rng, monkeypatch) -> None:
    """Between the steps that age or probe, a batch the last choice left idle, whose
    estimates no verify has moved since, gets N = 0 without being weighed: the same choices
    as weighing every step, where the step costs stand still."""
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))
    batch = int(torch.randint(1, 5, (1,), generator=rng))
    weighed = collections.Counter()

    def choices(quiet: bool) -> list[int]:
        r = random.Random(seed)
        chooser = chooser_with_costs(r, range(1, 5), r.uniform(0.5, 0.8), r.uniform(0.01, 0.03))
        if not quiet:
            monkeypatch.setattr(chooser, "_quiet_step", lambda: False)
        view = chooser._batch_view

        def counted(*args, **kwargs):
            weighed[quiet] += 1
            return view(*args, **kwargs)

        monkeypatch.setattr(chooser, "_batch_view", counted)
        return stretch_run(chooser, r, batch, 800)

    quiet, every_step = choices(True), choices(False)
    assert quiet == every_step
    idle = quiet.count(0)
    assert idle >= 100 and sum(n > 1 for n in quiet) >= 20, quiet  # idles and drafts
    # Weighed at the idle steps that age or probe (1 in IDLE_AGE_STEPS), at the first after a
    # choice that drafted and after a verify (a probe's), and no more.
    assert weighed[False] - weighed[True] >= 0.25 * idle, (weighed, idle)


def test_an_idle_batch_is_weighed_again_after_a_verify_or_a_slower_decode(rng) -> None:
    """A verify read back during an idle stretch (a probe's) is weighed at the next step,
    and decode steps timed slower within IDLE_AGE_STEPS steps: either may make drafting pay."""
    r = py_random(rng)
    chooser, one = idle_request(r, r.uniform(0.3, 0.6))
    for _ in range(2 * IDLE_AGE_STEPS):
        assert chooser.choose(one, 1) == 0
    while (chooser.idle_steps + 1) % IDLE_AGE_STEPS == 0:  # the next step must not age
        assert chooser.choose(one, 1) == 0
    assert chooser.quiet is not None
    for _ in range(20):  # a stretch of text the drafter gets right, all at once
        chooser.observe(one[0], NUM_SPEC, NUM_SPEC)
    assert chooser.choose(one, 1) > 0
    # Another idle batch, then plain decoding timed 20x slower.
    chooser, one = idle_request(r, r.uniform(0.3, 0.6), prior=0.3)
    for _ in range(2 * IDLE_AGE_STEPS):
        assert chooser.choose(one, 1) == 0
    assert chooser.quiet is not None
    for _ in range(COST_WINDOW):
        chooser.record_step(1, 0, 20 * chooser.costs.cost(1, 0))
    assert any(chooser.choose(one, 1) for _ in range(IDLE_AGE_STEPS))
