"""Draft length chosen each step from how well the drafter is doing ("auto").

A step that drafts N tokens per request commits, for a request whose drafts are each accepted
with probability alpha (independently, the first rejection ending the run), on average
E(alpha, N) = 1 + alpha + ... + alpha^N = (1 - alpha^(N+1)) / (1 - alpha) tokens at its next
verify, and costs cost(b, N) seconds for a batch of b. The chooser picks, among the N the
draft schedule allows at this batch size (0 included), the one that maximises the batch's
expected tokens per second, sum_i E(alpha_i, N) / cost(b, N). N stays one value per step: the
verify and the drafter's block are uniform (one CUDA graph per 1+N).

- alpha per request (`AcceptanceEstimate`): its verifies' likelihood is that of truncated
  geometric runs, alpha^accepted (1 - alpha)^rejections (accepted / drafted would underestimate
  alpha: a run stopped by a rejection says nothing about the drafts after it), so with a Beta
  prior centred on the drafter's running engine-wide estimate (PRIOR_WEIGHT observations) its
  posterior is Beta(accepted + prior, rejections + prior), counts decayed at each verify and,
  those from before the batch stopped drafting, at its idle steps (IDLE_DECAY: a poor stretch
  of text is not the whole request; what the idle stretch's probes find is kept). A request's
  expected tokens at N are E(alpha, N) averaged over that posterior, not E at its mean: E is
  convex in alpha, and a request whose few last verifies were short is not yet known to be a
  poor one (a request with alpha 0.7 drafted on ~70% of its steps when judged by its mean, ~95%
  by the posterior; `benchmarks/chooser_sim.py`). A request not verified yet has the
  engine-wide estimate's E. Greedy and sampled requests keep separate engine-wide estimates:
  the same drafter lands ~2.7 tokens a verify on maths at T = 0 and ~1.5 on chat at T = 1, and
  one shared estimate, pulled down by sampled requests, kept a greedy request from drafting
  at all until a probe reached it (`blockdraft bench`: its T = 0 sets after the T = 1 warm-up
  never drafted on an H100).
- cost(b, N) (`StepCostModel`): the wall time of the engine's uniform steps (every request
  verifies N and proposes N; no prefill), each from the end of the step before it (the engine's
  `_step_seconds`: the host's time between steps is part of the cost, and a caller's wait for
  the device cannot make a step launched ahead look free), the median of the last few per
  (power-of-two batch bucket, N): step times are only ever inflated (a cold cache, a noisy
  neighbour), so a median ignores the outliers and follows a real change within a few steps.
  An N not measured yet at a bucket is scaled from the measured ones by the analytic prior
  1 + drafter_overhead + per_row * b * N (in decode steps), and one not timed where probes
  were, at least at a decode step plus half a probe's measured extra (`step_cost`). Plain
  decode (N = 0) is timed for a few steps when a bucket is first met and again while the batch
  drafts, every RECALIBRATE_INTERVAL steps or further apart where drafting wins by so much that
  a stale decode time could not change the choice (`_recalibration_due`), so the comparison
  with speculation rests on this machine's current times, not on the prior. A decode time no
  cheaper than a drafting step timed since was taken in a slow stretch (a step that verifies
  and drafts does all a decode step does): it is taken again, at widening intervals while the
  stretch lasts (DECODE_RECHECK_SPACING), if decode at the fastest this engine timed it could
  beat drafting (a good drafter's batch drafts on). Decode is timed rarely and drafting steps
  every step, so without this one calibration in a burst of load kept open chat at T = 1
  drafting for hundreds of steps (2 CPU threads beside a competing process: decode timed at
  102 ms against a calm 37, drafting steps timed calm at 53, for 470 steps).
- exploring: the chooser only times the N it drafts, so an N that the prior prices a little
  worse than the best is drafted for a few steps once per batch bucket, once the best is
  timed, to be timed too (on a GPU: `step_costs.CUDA_EXPLORE_MARGIN`). For the same reason an
  N timed long ago (DRAFT_RETIME_SPACING) is drafted for as many steps again when the prior,
  scaled from the chosen N's timing, prices it above the chosen N (on the CPU, whose prior is a
  fit of measured steps): one timed in a slow stretch would otherwise stay dearer than its
  neighbours for good.
- probing: alpha only moves at verifies, so a batch at N = 0 drafts the smallest allowed N for
  one step every `probe_interval` steps. The interval doubles at each probe that finds the
  batch's mean alpha no higher than its lowest since the previous probe (text that stays
  unpredictable pays ever less for probes), and returns to PROBE_INTERVAL when it rose (a
  request becoming predictable needs a few probes to lift its estimate) or once drafting pays
  again; either way it is never shorter than what keeps the probes' expected loss (their cost
  in decode steps less the tokens they commit) within PROBE_BUDGET of plain decoding's time.
  After a probe, N at most doubles a step (from the probe's) until it reaches the largest allowed:
  one verify is the whole evidence of a request's estimate then (one accepted draft lifts a
  prior alpha of 0.3 to 0.53), and the largest N costs the most when that evidence was luck (on
  2 CPU threads 3 drafts cost 1.9 decode steps; open chat, alpha ~0.28, took three such steps
  after a probe whose one draft landed).
  A probe is never a uniform step (it proposes without verifying, the next verifies without
  proposing, and with async decode the pipeline drains and refills around them), so its cost
  is measured as such: the wall time of the PROBE_SPAN steps from the one that chose it, less
  as many decode steps (the median of the last few probes per bucket). On an H100 with
  SmolLM2-135M a probe of 3 drafts cost ~4 decode steps that way, where the uniform-step prior
  said 1.4.

Everything here runs on the host each step over plain floats: no tensor, no device sync.
The choice lags the readback by one step (drafts are proposed before the step's tokens are
read back), and any N is lossless: the verify takes whatever the drafter proposed.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from blockdraft.spec_decode.draft_schedule import DraftSchedule
from blockdraft.spec_decode.step_costs import COST_WINDOW, CostPrior, StepCostModel, lower_median

# alpha is looked up on this grid (ALPHA_BINS + 1 values in [0, 1]) so a step sums a table.
ALPHA_BINS = 64
# Per-request decay of the accepted / rejected counts at each verify (~5 verifies of memory).
REQUEST_DECAY = 0.8
# While its batch drafts nothing (probes aside), a request's counts from before that idle
# stretch also decay by IDLE_DECAY a step, applied every IDLE_AGE_STEPS steps: its acceptance
# moves along its text (maths: formulas, then prose), and a belief frozen at a poor stretch's
# low kept it from drafting into the next good stretch until a probe reached it, so it drifts
# back to the drafter's engine-wide prior. What the stretch's probes found does not decay (bar
# the usual decay at each verify): decaying it too erased what widely spaced probes found, and a
# request whose text turned predictable after a long unpredictable stretch, the prior learnt
# low meanwhile, never drafted again. `chooser_sim --seeds 60`, before -> after: maths-like
# stretches 1.078 -> 1.102x plain decoding, T = 1-like 0.975 -> 0.972x, a good drafter and
# drafts that never land unchanged; `--shape device-bound`: T = 1-like 1.134 -> 1.148x. On the
# shipped drafter's real acceptance (`chooser_replay`, 2 passes) within the passes' spread: T = 0
# 1.099 / 1.090x (1.079 / 1.101x before), T = 1 0.969 / 0.995x (0.973 / 0.993x). Each decay
# recomputes the requests' expected tokens: an idle step's choice at batch 16 7.6 -> 15.8 us
# while the stale counts last (every 8 steps: 12.1 us, maths-like 1.094x), ~100 idle steps.
IDLE_DECAY = 0.95
IDLE_AGE_STEPS = 4
# Counts from before the stretch below this (in observations, against the prior's PRIOR_WEIGHT)
# are left as they are: a long stretch's steps then cost the choice nothing more.
STALE_NEGLIGIBLE = 0.01
# The engine-wide estimate's decay per verify, and its starting point: a fresh drafter is
# trusted enough to be tried (its first verifies then set the prior).
PRIOR_DECAY = 0.99
INITIAL_ALPHA = 0.6
INITIAL_PRIOR_WEIGHT = 10.0
# Weight of the engine-wide prior in a request's estimate, in observations (accepts + rejects):
# with ~5 verifies of memory, 2 let two short runs of a good request stop its drafting
# (`chooser_sim`, alpha 0.7 at batch 1: 1.50x plain decoding with 4, 1.47x with 2, judged over
# the posterior; 1.41x / 1.35x judged at its mean).
PRIOR_WEIGHT = 4.0
# The expected rate gain over plain decoding that a step must promise to draft at all.
MIN_DRAFT_GAIN = 0.03
# A uniform step is timed only after STEADY_AFTER uniform steps of the same batch and N: the
# first steps after a change of N are uniform by their rows but not by their time (with async
# decode the first plain step after a verify launches two steps and the next only reads one
# back: 2.3 and 0.4 ms around a steady 1.1 on an H200 at batch 16, enough to make decode look
# twice as dear and drafting pay where it did not).
STEADY_AFTER = 2
# Plain-decode steps run the first time a batch bucket is met (the first one after a change of
# N is not uniform, so this times CALIBRATION_STEPS - 1 - STEADY_AFTER), and how many steps a
# bucket drafts at least before they are timed again.
CALIBRATION_STEPS = 6
RECALIBRATE_INTERVAL = 256
# Calibrating again may lose at most this share of the drafting batch's time: its steps run at
# plain decoding's rate where drafting's was due, so the interval is at least CALIBRATION_STEPS
# * (1 - plain rate / drafting rate) / RECALIBRATE_BUDGET steps. Where drafting wins 4x (27B
# shape at p = 0.8 on an H100) that is ~900 steps: every 256, the default ran at 4.00x plain
# decoding against fixed N = 15's 4.10x, now 4.05x (`chooser_sim --shape device-bound
# --requests 6 --tokens 512`, alpha 0.8; a 512-token request with a recalibration in it lost
# 3.5%). Where drafting barely pays, a stale decode time can flip the choice, and 256 holds.
RECALIBRATE_BUDGET = 0.005
# A decode time no cheaper than a drafting step timed since is taken again once it has stood
# this many steps, then twice as many while each new one is no cheaper either (a slow stretch
# that lasts is not chased every few steps), up to RECALIBRATE_INTERVAL; a drafting step timed
# dearer than decode resets it.
DECODE_RECHECK_SPACING = 16
# A drafting N is timed only while it is drafted, so one timed in a slow stretch stays priced
# above the N chosen instead for as long as the engine runs (2 CPU threads beside a test on the
# other core: an agreeing drafter settled on N = 6 over the largest, 7, timed in a burst of
# load in 2 steps). A drafting N timed in fewer steps than the cost window holds, whose timing
# has stood this many steps, is taken again (EXPLORE_STEPS steps of it) when the prior, scaled
# from the chosen N's timing, prices it above the chosen N: one N at a time per bucket, this
# many steps apart. Each re-timing adds to the N's window, so an N is taken again at most twice
# per bucket. Only where the prior is a fit of measured steps (`CostPrior.retime`: the CPU's).
DRAFT_RETIME_SPACING = 16
# Due re-timings are looked for every this many steps (the look weighs every timed N: host
# time on every drafting step of a small target otherwise).
RETIME_CHECK_STRIDE = 4
PROBE_INTERVAL = 8
MAX_PROBE_INTERVAL = 128
# Steps whose wall time a probe changes: the one that chose it (async decode launches nothing
# ahead of it), the probe, its verify, and the two that refill the decode pipeline.
PROBE_SPAN = 5
# The budget may space probes further than the doubling does, up to this.
MAX_PROBE_FLOOR = 1024
# Probes may lose at most this share of plain decoding's time: the interval is at least (cost of
# the probe step / a decode step - its expected tokens) / PROBE_BUDGET (a probe costing ~1.4
# decode steps that commits 1.4 tokens loses nothing; one of 2 steps that commits 1.0 is kept
# 200 steps apart). At batch 1 on a host-bound GPU, T = 1, the default lost ~3% to a
# never-drafting engine (H100, SmolLM2). `benchmarks/chooser_sim.py` (60 seeds of 6 requests;
# 20 of 30), 1% -> 0.5%: T = 1-like serving 0.967 -> 0.975x plain decoding (0.982 -> 0.989x),
# drafts that never land 0.976 -> 0.982x (0.986 -> 0.992x), maths-like stretches 1.074 ->
# 1.078x (1.087 both), a good drafter 1.487 -> 1.489x; 0.25% cost the stretches 1% over 30
# requests. On the H100, 1% -> 0.5% moved T = 1 serving by +0.3% (within its noise).
PROBE_BUDGET = 0.005
# Once the best N is timed, an allowed N still priced by the prior alone is drafted for
# EXPLORE_STEPS steps (enough for STEADY_AFTER untimed ones and a timed one) when the prior puts
# it within the prior's `explore_margin` of the best rate and above plain decoding's: once per
# batch bucket and N (step_costs.CUDA_EXPLORE_MARGIN on a GPU, none on the CPU).
EXPLORE_STEPS = STEADY_AFTER + 3
# A run of plain decode steps is timed step by step until the cost window is full, then every
# DECODE_TIMING_STRIDE-th step: a steady idle batch's decode time moves slowly, and on a small
# host-bound target each timing (the window, its median, the chooser's bookkeeping) cost ~10 us
# of a ~1 ms step on an H200's host (~15 us on a 2-vCPU one, ~6 with the stride).
DECODE_TIMING_STRIDE = 8


class AcceptanceEstimate:
    """One request's decayed counts of accepted drafts and of rejections (a verify that stopped
    before its last draft), its posterior Beta(a, b) and posterior mean alpha on the ALPHA_BINS
    grid (-1: never verified), and its expected tokens a verify commits at each N
    (`posterior_expected_tokens`; empty until a choice needs them after a verify: an engine
    whose N is pinned never computes them)."""

    __slots__ = (
        "sampled", "accepted", "rejected", "posterior", "alpha_bin", "expected",
        "idle_accepted", "idle_rejected", "idle_stretch",
    )  # fmt: skip

    def __init__(self, sampled: bool = False) -> None:
        self.sampled = sampled  # the request samples (T > 0): its prior is sampled requests'
        self.accepted = 0.0
        self.rejected = 0.0
        self.posterior = (0.0, 0.0)
        self.alpha_bin = -1
        self.expected: list[float] = []
        # The part of the counts gathered by probes during idle stretch `idle_stretch` of its
        # batch (kept while the counts from before the stretch decay: IDLE_DECAY).
        self.idle_accepted = 0.0
        self.idle_rejected = 0.0
        self.idle_stretch = -1


def expected_tokens(alpha: float, num_drafts: int) -> float:
    """Tokens a verify of N i.i.d. drafts commits on average (accepted drafts + 1)."""
    if alpha >= 1.0:
        return num_drafts + 1.0
    return (1.0 - alpha ** (num_drafts + 1)) / (1.0 - alpha)


def posterior_expected_tokens(a: float, b: float, top: int) -> list[float]:
    """E(alpha, N) for N = 0..top averaged over alpha ~ Beta(a, b): sum over k <= N of
    E[alpha^k] = prod_{i < k} (a + i) / (a + b + i)."""
    out, moment = [1.0], 1.0
    for i in range(top):
        moment *= (a + i) / (a + b + i)
        out.append(out[-1] + moment)
    return out


@dataclass
class DraftLengthChooser:
    """N per step for an engine; `choose` before each step's drafts are proposed, `observe`
    for each verify read back, `record_step` with each uniform step's wall time."""

    schedule: DraftSchedule
    costs: StepCostModel
    probe_interval: int = PROBE_INTERVAL
    # The share of plain decoding's time probes may lose (PROBE_BUDGET; benchmarks vary it).
    probe_budget: float = PROBE_BUDGET
    # The drafter's engine-wide decayed counts, of greedy requests' verifies and of sampled
    # ones' ([greedy, sampled]): the prior of each kind of request's alpha.
    prior_accepted: list[float] = field(
        default_factory=lambda: [INITIAL_ALPHA * INITIAL_PRIOR_WEIGHT] * 2
    )
    prior_rejected: list[float] = field(
        default_factory=lambda: [(1 - INITIAL_ALPHA) * INITIAL_PRIOR_WEIGHT] * 2
    )
    steps_since_drafting: int = 0
    # The batch's idle stretches (N = 0 chosen for want of gain; probes do not end one): how
    # many began, and the steps the current one has lasted (-1: drafting).
    idle_stretches: int = 0
    idle_steps: int = -1
    # Whether the current idle stretch probed yet: the verifies read back before its first
    # probe are of the drafting before it (the readback lags the choice), not its probes'.
    probed_in_stretch: bool = False
    # The batch's lowest mean alpha bin since the last probe (-1: no probe yet).
    alpha_bin_since_probe: float = -1.0
    num_steps: int = 0  # `choose` calls
    calibrating: dict[int, int] = field(default_factory=dict)  # bucket -> decode steps left
    decode_timed_at: dict[int, int] = field(default_factory=dict)  # bucket -> step
    # Buckets whose timed decode step is no cheaper than a timed drafting step there (a decode
    # time taken in a slow stretch), and bucket -> the steps a decode time must have stood
    # before it is taken again for that (DECODE_RECHECK_SPACING, doubling at each recheck).
    decode_suspect: set[int] = field(default_factory=set)
    decode_recheck_spacing: dict[int, int] = field(default_factory=dict)
    # (bucket, N > 0) -> the step its last timing was taken; bucket -> the step of its last
    # re-timing (DRAFT_RETIME_SPACING).
    draft_timed_at: dict[tuple[int, int], int] = field(default_factory=dict)
    retimed_at: dict[int, int] = field(default_factory=dict)
    # The uniform steps in a row so far: (batch, N, how many).
    uniform_run: tuple[int, int, int] = (0, 0, 0)
    # The probe being timed: (batch, steps of its span left, seconds so far); None: none.
    probe_timing: tuple[int, int, float] | None = None
    # bucket -> the last few probes' extra seconds over as many decode steps as their span
    probe_extra: dict[int, deque[float]] = field(default_factory=dict)
    # bucket -> their lower median, kept at each probe (`step_cost` reads it every step)
    probe_measured: dict[int, float] = field(default_factory=dict)
    # (bucket, N) explored already, and the exploration under way: (batch, N, steps left).
    explored: set[tuple[int, int]] = field(default_factory=set)
    exploring: tuple[int, int, int] | None = None
    # The last N of a ramp after a probe (0: no ramp): the next drafting N is at most twice it.
    ramp: int = 0
    # The batch (its estimates, in order) that the last weighed choice left idle; None when
    # that choice drafted or a verify has moved an estimate since. Till the next step that
    # ages or probes, the same batch stays at N = 0 unweighed (`_quiet_step`).
    quiet: tuple[AcceptanceEstimate, ...] | None = None
    # expected[bin][N]: E(bin / ALPHA_BINS, N) for N up to the schedule's largest.
    expected: list[list[float]] = field(init=False)
    allowed_by_cap: dict[int, tuple[int, ...]] = field(init=False)

    def __post_init__(self) -> None:
        top = max(self.schedule.all_num_drafts)
        self.expected = [
            [expected_tokens(b / ALPHA_BINS, n) for n in range(top + 1)]
            for b in range(ALPHA_BINS + 1)
        ]
        self.allowed_by_cap = {
            cap: self.schedule.allowed(cap) for cap in set(self.schedule.num_drafts_at)
        }

    @classmethod
    def for_device(
        cls, schedule: DraftSchedule, device_type: str, num_threads: int = 2
    ) -> DraftLengthChooser:
        """`num_threads`: the CPU's torch threads (the step costs' prior depends on them)."""
        return cls(schedule, StepCostModel(CostPrior.for_device(device_type, num_threads)))

    def prior_alpha(self, sampled: bool = False) -> float:
        """The engine-wide estimate of greedy (or sampled) requests' alpha."""
        accepted = self.prior_accepted[sampled]
        return accepted / (accepted + self.prior_rejected[sampled])

    def observe(self, estimate: AcceptanceEstimate, num_accepted: int, num_drafts: int) -> None:
        """A verify of `num_drafts` drafts accepted `num_accepted` of them."""
        rejected = 1.0 if num_accepted < num_drafts else 0.0
        self.quiet = None
        estimate.accepted = REQUEST_DECAY * estimate.accepted + num_accepted
        estimate.rejected = REQUEST_DECAY * estimate.rejected + rejected
        if self.idle_steps >= 0 and self.probed_in_stretch:  # kept from the idle decay
            if estimate.idle_stretch != self.idle_stretches:
                estimate.idle_stretch = self.idle_stretches
                estimate.idle_accepted = estimate.idle_rejected = 0.0
            estimate.idle_accepted = REQUEST_DECAY * estimate.idle_accepted + num_accepted
            estimate.idle_rejected = REQUEST_DECAY * estimate.idle_rejected + rejected
        kind = estimate.sampled
        self.prior_accepted[kind] = PRIOR_DECAY * self.prior_accepted[kind] + num_accepted
        self.prior_rejected[kind] = PRIOR_DECAY * self.prior_rejected[kind] + rejected
        a, b = self._set_posterior(estimate)
        estimate.alpha_bin = round(a / (a + b) * ALPHA_BINS)

    def _set_posterior(self, estimate: AcceptanceEstimate) -> tuple[float, float]:
        """Beta(a, b) from the request's counts and its kind's engine-wide prior."""
        prior = self.prior_alpha(estimate.sampled)
        a = estimate.accepted + PRIOR_WEIGHT * prior
        b = estimate.rejected + PRIOR_WEIGHT * (1.0 - prior)
        estimate.posterior, estimate.expected = (a, b), []
        return a, b

    def _age(self, estimate: AcceptanceEstimate, age: float) -> None:
        """IDLE_DECAY on the counts from before the batch's idle stretch; the mean's bin stays
        its last verify's (the probes' back-off reads what verifies found, not the drift)."""
        kept_accepted = kept_rejected = 0.0
        if estimate.idle_stretch == self.idle_stretches:
            kept_accepted, kept_rejected = estimate.idle_accepted, estimate.idle_rejected
        stale_accepted = estimate.accepted - kept_accepted
        stale_rejected = estimate.rejected - kept_rejected
        if stale_accepted + stale_rejected < STALE_NEGLIGIBLE:
            return  # decayed away already: the posterior (and its expected tokens) stand
        estimate.accepted = stale_accepted * age + kept_accepted
        estimate.rejected = stale_rejected * age + kept_rejected
        self._set_posterior(estimate)

    def record_step(self, batch: int, num_drafts: int, seconds: float) -> None:
        """A uniform step of `batch` requests, each verifying and proposing `num_drafts`."""
        self.costs.record(batch, num_drafts, seconds)
        bucket = self.costs.bucket(batch)
        measured = self.costs.measured
        if not num_drafts:
            self.decode_timed_at[bucket] = self.num_steps
            self.decode_suspect.discard(bucket)
            return
        self.draft_timed_at[(bucket, num_drafts)] = self.num_steps
        if measured.get((bucket, 0), 0.0) >= measured[(bucket, num_drafts)]:
            # A step that verifies and drafts does all a decode step does and more.
            self.decode_suspect.add(bucket)
        else:
            self.decode_recheck_spacing.pop(bucket, None)

    def record_if_uniform(
        self, chunks: list, num_drafts: int, seconds: float, pipelined: bool = True
    ) -> None:
        """A step's wall time (every step's, in order), kept when the step was uniform (no
        prefill; every chunk verified and proposed `num_drafts`) and steady (STEADY_AFTER
        uniform steps of its batch and N before it): only then is it cost(batch, N), and of a
        long plain decode run only one step in DECODE_TIMING_STRIDE once its window is full.
        The steps of a probe's span time the probe instead. `pipelined=False`: a step launched
        ahead that launched none after it (async decode's pipeline drains before a drafting
        step or when a request finishes): it overlapped the step before by however long the
        host worked or waited in between, so its time says more about the caller than about a
        plain decode step (0.2-0.5 ms against a steady 25.6 on an H100, 27B shape, under a
        benchmark that synced the device before each step)."""
        if self.probe_timing is not None:
            self._time_probe(seconds)
            self.uniform_run = (0, 0, 0)
            return
        if not all(
            c.num_drafts == num_drafts and len(c.token_ids) == num_drafts + 1 for c in chunks
        ):
            self.uniform_run = (0, 0, 0)
            return
        batch, n, count = self.uniform_run
        count = count + 1 if (batch, n) == (len(chunks), num_drafts) else 1
        self.uniform_run = (len(chunks), num_drafts, count)
        if count <= STEADY_AFTER or not pipelined:
            return
        if not num_drafts and count > STEADY_AFTER + COST_WINDOW and count % DECODE_TIMING_STRIDE:
            return
        self.record_step(len(chunks), num_drafts, seconds)

    def _time_probe(self, seconds: float) -> None:
        batch, left, total = self.probe_timing
        total += seconds
        if left > 1:
            self.probe_timing = (batch, left - 1, total)
            return
        self.probe_timing = None
        if not self.costs.has(batch, 0):  # nothing to compare with yet
            return
        bucket = self.costs.bucket(batch)
        window = self.probe_extra.setdefault(bucket, deque(maxlen=COST_WINDOW))
        window.append(max(total - PROBE_SPAN * self.costs.cost(batch, 0), 0.0))
        self.probe_measured[bucket] = lower_median(window)

    def measured_probe_cost(self, batch: int) -> float | None:
        """A probe's extra seconds over plain decoding at this bucket, the median of the last
        few measured; None before any."""
        return self.probe_measured.get(self.costs.bucket(batch))

    def probe_cost(self, batch: int, probe: int) -> float:
        """A probe's extra seconds over plain decoding: measured, else the uniform steps'
        cost(b, N) - cost(b, 0)."""
        measured = self.measured_probe_cost(batch)
        if measured is not None:
            return measured
        return self.costs.cost(batch, probe) - self.costs.cost(batch, 0)

    def step_cost(self, batch: int, num_drafts: int) -> float:
        """cost(b, N) as `choose` weighs it (`step_costs`)."""
        return self.step_costs(batch, (num_drafts,))[num_drafts]

    def step_costs(self, batch: int, allowed: Iterable[int]) -> dict[int, float]:
        """cost(b, N) as `choose` weighs it, for each allowed N: timed, else the prior's, and for
        N > 0 not timed at this bucket at least a decode step plus half a measured probe's
        extra. A probe's span holds two drafting steps (the probe proposes, the next verifies),
        and drafting steps are only timed once STEADY_AFTER of them ran in a row, which short
        drafting runs never do: at batch 1 on a host-bound GPU the prior's 1.36 decode steps a
        drafting step stood against ~2 real ones for as long as the engine ran, and requests
        whose drafts rarely land kept drafting after each lucky verify. (One pass over the
        bucket's state: `choose` runs every step, on the host of a small target's ~1 ms step.)"""
        costs = self.costs
        bucket = costs.bucket(batch)
        unit = costs.unit.get(bucket, 1.0)
        probe = self.probe_measured.get(bucket)
        decode = costs.measured.get((bucket, 0), unit)  # the prior prices N = 0 at one unit
        out = {}
        for n in allowed:
            cost = costs.measured.get((bucket, n))
            if cost is None:
                cost = unit * costs.prior(batch, n)
                if n and probe is not None:
                    cost = max(cost, decode + probe / 2)
            out[n] = cost
        return out

    def choose(self, estimates: Iterable[AcceptanceEstimate], batch: int) -> int:
        """N for the drafts proposed now by a batch of `batch` requests (their estimates)."""
        self.num_steps += 1
        cap = self.schedule.num_drafts(batch)
        allowed = self.allowed_by_cap[cap]
        if len(allowed) == 1:
            return allowed[0]
        estimates = tuple(estimates)
        if estimates == self.quiet and self._quiet_step():
            return 0
        self.quiet = None
        # The batch's kind picks its step costs (StepCostModel.sampled), for this choice and
        # for the timing of the step it launches (a step launched ahead before that timing
        # runs the same requests: the same kind).
        self.costs.sampled = any(e.sampled for e in estimates)
        if self._calibrating(batch):
            return 0
        if (explored := self._continue_exploring(batch, allowed)) is not None:
            return explored
        idle = self.idle_steps
        aged = self._ages_counts()
        tokens, mean_bin = self._batch_view(estimates, IDLE_DECAY**IDLE_AGE_STEPS if aged else 1.0)
        rates = self._rates(tokens, batch, allowed)
        best = max(allowed, key=lambda n: (rates[n], -n))
        if rates[best] <= 0.0:
            best = 0
        if best:
            self.idle_steps = -1
            if self._recalibration_due(batch, rates[0] / rates[best]):
                return 0
            self.steps_since_drafting, self.probe_interval = 0, PROBE_INTERVAL
            if self.ramp and best > 2 * self.ramp:
                # The largest allowed N up to twice the ramp's, else the next allowed above it
                # (a cap of 0, 3 or 7 drafts).
                larger = [n for n in allowed if n > self.ramp]
                within = [n for n in larger if n <= 2 * self.ramp]
                step = max(within) if within else min(larger)
                if step < best:
                    self.ramp = step
                    return step
            # The ramp lasts till N reaches the largest allowed: a step within the cap (N = 2
            # after a probe of 1) is no licence to jump to 5 at the next.
            self.ramp = max(self.ramp, best) if self.ramp and best < allowed[-1] else 0
            if (explored := self._explore(batch, best, rates)) != best or self.ramp:
                return explored  # (a ramp's steps are not re-timings' to take)
            return self._retime(batch, best, tokens, rates)
        if idle < 0:
            self.idle_stretches, self.probed_in_stretch = self.idle_stretches + 1, False
        self.idle_steps = idle + 1
        self.steps_since_drafting += 1
        if self.steps_since_drafting < self.probe_interval:
            self.alpha_bin_since_probe = min(self.alpha_bin_since_probe, mean_bin)
            self.quiet = estimates
            return 0
        rose = mean_bin > self.alpha_bin_since_probe
        probe = allowed[1]  # the smallest N that drafts
        floor = self._probe_floor(tokens, batch, probe)
        interval = PROBE_INTERVAL if rose else 2 * self.probe_interval
        self.probe_interval = max(min(interval, MAX_PROBE_INTERVAL), min(floor, MAX_PROBE_FLOOR))
        self.steps_since_drafting, self.alpha_bin_since_probe = 0, mean_bin
        self.probe_timing = (batch, PROBE_SPAN, 0.0)
        self.probed_in_stretch = True
        self.ramp = probe
        return probe

    def _quiet_step(self) -> bool:
        """An idle step of the batch the last choice weighed and left idle, no verify since:
        unless it ages the batch's counts or probes, N = 0 again, as weighing would choose
        but for the decode steps timed since, which move the step costs by a median's worth
        and are weighed at the next aging step. Weighing costs an idle step of a small target
        ~15 us of host time (SmolLM2 on an H100: ~1.5% of a plain decode step's)."""
        if self._ages_counts() or self.steps_since_drafting + 1 >= self.probe_interval:
            return False
        self.idle_steps += 1
        self.steps_since_drafting += 1
        return True

    def _ages_counts(self) -> bool:
        """Whether this step, in an idle stretch, decays the batch's counts from before it
        (every IDLE_AGE_STEPS steps of the stretch)."""
        idle = self.idle_steps
        return idle >= 0 and (idle + 1) % IDLE_AGE_STEPS == 0

    def _batch_view(
        self, estimates: Iterable[AcceptanceEstimate], age: float = 1.0
    ) -> tuple[list[float], float]:
        """(tokens the batch's next verify commits on average at each N up to the schedule's
        largest, the batch's mean alpha bin); a request never verified counts at the
        engine-wide estimate of its kind (greedy or sampled). `age` < 1: each request's counts
        from before the batch's idle stretch are decayed by it first (IDLE_DECAY)."""
        fresh, bins, rows = [0, 0], 0, []
        for e in estimates:
            if e.alpha_bin < 0:
                fresh[e.sampled] += 1
            else:
                if age < 1.0:
                    self._age(e, age)
                bins += e.alpha_bin
                if not e.expected:  # verified since the last choice
                    e.expected = posterior_expected_tokens(*e.posterior, len(self.expected[0]) - 1)
                rows.append(e.expected)
        for kind, count in enumerate(fresh):
            if count:
                prior_bin = round(self.prior_alpha(bool(kind)) * ALPHA_BINS)
                bins += count * prior_bin
                rows += [self.expected[prior_bin]] * count
        if len(rows) == 1:  # batch 1: the request's own row (read, never written)
            return rows[0], bins
        tokens = [sum(col) for col in zip(*rows, strict=True)]  # one column per N
        return tokens or [0.0] * len(self.expected[0]), bins / max(len(rows), 1)

    def _rates(self, tokens: list[float], batch: int, allowed: tuple[int, ...]) -> dict[int, float]:
        """Expected tokens a second of the batch at each allowed N; drafting must beat plain
        decoding by a margin (step costs are measured, and noise alone must not keep a batch
        drafting when nothing is accepted)."""
        costs = self.step_costs(batch, allowed)
        return {n: tokens[n] / costs[n] / (1.0 + MIN_DRAFT_GAIN * (n > 0)) for n in allowed}

    def expected_rates(
        self, estimates: Iterable[AcceptanceEstimate], batch: int
    ) -> dict[int, float]:
        """What `choose` weighs for this batch, without choosing: tokens a second at each N
        its batch size allows (for benchmarks and traces)."""
        allowed = self.allowed_by_cap[self.schedule.num_drafts(batch)]
        return self._rates(self._batch_view(estimates)[0], batch, allowed)

    def _explore(self, batch: int, best: int, rates: dict[int, float]) -> int:
        """`best`, or an untimed N to explore (`CUDA_EXPLORE_MARGIN`), whose first step this
        is."""
        margin = self.costs.prior.explore_margin
        if not margin or not self.costs.has(batch, best):
            return best
        bucket = self.costs.bucket(batch)
        floor = max(rates[best] * (1.0 - margin), rates.get(0, 0.0))
        untimed = [
            n
            for n, rate in rates.items()
            if n and rate > floor and (bucket, n) not in self.explored
            and not self.costs.has(batch, n)
        ]  # fmt: skip
        if not untimed:
            return best
        n = max(untimed, key=lambda n: rates[n])
        self.explored.add((bucket, n))
        self.exploring = (batch, n, EXPLORE_STEPS - 1)
        return n

    def _retime(self, batch: int, best: int, tokens: list[float], rates: dict[int, float]) -> int:
        """`best`, or a drafting N whose timing is due to be taken again (DRAFT_RETIME_SPACING),
        whose first step this is: one the prior, scaled from `best`'s timing, prices above
        `best` (the most tokens a second of those, when several are due)."""
        costs = self.costs
        if self.num_steps % RETIME_CHECK_STRIDE or not costs.prior.retime:
            return best
        bucket = costs.bucket(batch)
        best_cost = costs.measured.get((bucket, best))
        if best_cost is None:
            return best
        unit = best_cost / costs.prior(batch, best)
        since_retimed = self.num_steps - self.retimed_at.get(bucket, 0)
        due, due_rate = 0, rates[best] * (1.0 + MIN_DRAFT_GAIN)  # drafting's margin taken off
        for n in rates:
            key = (bucket, n)
            samples = costs.samples.get(key)  # None: never timed, nothing to take again
            if not n or n == best or samples is None or len(samples) >= COST_WINDOW:
                continue
            stood = min(since_retimed, self.num_steps - self.draft_timed_at.get(key, 0))
            if stood < DRAFT_RETIME_SPACING:
                continue
            rate = tokens[n] / (unit * costs.prior(batch, n))
            if rate > due_rate:
                due, due_rate = n, rate
        if not due:
            return best
        self.retimed_at[bucket] = self.num_steps
        self.exploring = (batch, due, EXPLORE_STEPS - 1)
        return due

    def _continue_exploring(self, batch: int, allowed: tuple[int, ...]) -> int | None:
        """The N under exploration while its steps last at the same batch; else None."""
        if self.exploring is None:
            return None
        explored_batch, n, left = self.exploring
        if explored_batch != batch or n not in allowed:
            self.exploring = None
            return None
        self.exploring = (batch, n, left - 1) if left > 1 else None
        return n

    def _probe_floor(self, tokens: list[float], batch: int, probe: int) -> int:
        """The fewest steps between probes that keeps their expected loss within the probe
        budget of plain decoding's time: a probe costs `probe_cost` (in decode steps) and commits
        E(alpha, N) - 1 tokens a request more than a decode step at the batch's current
        estimates. It holds after a probe that lifted the estimates too: a lift that leaves
        drafting far from paying is no reason to pay for probes every PROBE_INTERVAL steps."""
        gained = tokens[probe] / batch - 1.0
        loss = self.probe_cost(batch, probe) / self.costs.cost(batch, 0) - gained
        return math.ceil(max(loss, 0.0) / self.probe_budget)

    def _calibrating(self, batch: int) -> bool:
        """Whether this step is one of the plain-decode steps that time N = 0 at a bucket: the
        first one there, or a calibration under way."""
        bucket = self.costs.bucket(batch)
        left = self.calibrating.get(bucket, 0)
        if left:
            self.calibrating[bucket] = left - 1
            return True
        if bucket in self.decode_timed_at:
            return False
        self._start_calibration(bucket)
        return True

    def _recalibration_due(self, batch: int, plain_share: float) -> bool:
        """Whether a drafting batch, whose plain decoding would run at `plain_share` of its
        expected rate, times N = 0 again now (RECALIBRATE_BUDGET)."""
        bucket = self.costs.bucket(batch)
        since_timed = self.num_steps - self.decode_timed_at[bucket]  # steps
        if bucket in self.decode_suspect:
            spacing = self.decode_recheck_spacing.get(bucket, DECODE_RECHECK_SPACING)
            if since_timed >= spacing and self._decode_could_win(bucket, plain_share):
                self.decode_recheck_spacing[bucket] = min(2 * spacing, RECALIBRATE_INTERVAL)
                self._start_calibration(bucket)
                return True
        interval = max(
            RECALIBRATE_INTERVAL,
            CALIBRATION_STEPS * max(1.0 - plain_share, 0.0) / RECALIBRATE_BUDGET,
        )
        if since_timed < interval:
            return False
        self._start_calibration(bucket)
        return True

    def _decode_could_win(self, bucket: int, plain_share: float) -> bool:
        """Whether plain decoding at its fastest timed here, or at any speed when no time
        taken here was below a drafting step's, would beat the drafting the batch chose (at
        `plain_share` of its rate with the suspect decode time)."""
        costs = self.costs
        fastest = costs.fastest_decode[bucket]
        drafting = min(c for (b, n), c in costs.measured.items() if b == bucket and n)
        return fastest >= drafting or plain_share * costs.measured[(bucket, 0)] >= fastest

    def _start_calibration(self, bucket: int) -> None:
        # Counted as timed now: steps that turn out not uniform (prefills) wait for the next.
        self.decode_timed_at[bucket] = self.num_steps
        self.calibrating[bucket] = CALIBRATION_STEPS - 1
