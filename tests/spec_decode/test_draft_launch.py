"""The drafter's work is queued before the step's one readback, built on the device from the
target step's results: its context cache must hold exactly the committed rows, a chunk that
does not complete must not draft, and the order of launches must be target, context, drafter,
then the readback."""

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from blockdraft import LLM, SamplingParams
from blockdraft.runtime.host_batch import slots_for_positions

from checkpoints import make_dflash_drafter, make_predictable_target

POISON = 1.0e4  # no K/V the drafter computes comes near it


def spec(drafter: Path) -> dict:
    # Drafts at every batch size: the CPU's "auto" schedule stops drafting from 4 running
    # requests, and the audit expects every completing chunk to propose.
    return {
        "method": "dflash",
        "model": str(drafter),
        "num_speculative_tokens": 3,
        "num_speculative_tokens_by_batch": None,
    }


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("early")
    target = make_predictable_target(root / "target")
    # Mostly right, sometimes wrong: verifies accept runs of varying length.
    drafter = make_dflash_drafter(
        root / "drafter", target, block_size=8, agree_with_target=True, draft_error_rate=0.3
    )
    return target, drafter


@dataclass
class StepRecord:
    # (chunk, its block table, whether it completes), taken at schedule time
    chunks: list = field(default_factory=list)
    features: torch.Tensor | None = None  # [num_tokens, K * hidden]
    num_drafts: int = 0
    proposers: list[int] = field(default_factory=list)
    num_accepted: list = field(default_factory=list)


class DrafterCacheAudit:
    """Poisons the drafter's KV cache, then checks every step against a reference: the cache
    before the step plus context K/V written from host lists for exactly the committed rows.
    Only the proposing requests' blocks p .. p+N may differ from it (and the pool's last block,
    which takes PAD writes)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.drafter = engine.proposer.drafter
        self.layers = self.drafter.attention_layers
        for attn in self.layers:
            attn.key_cache.fill_(POISON)
            attn.value_cache.fill_(POISON)
        self.record = StepRecord()
        self.kinds: set[str] = set()
        scheduler, launcher, runner = engine.scheduler, engine.draft_launcher, engine.runner
        schedule, launch, finish = scheduler.schedule, launcher.launch, runner.finish

        def spy_schedule():
            chunks = schedule()
            self.record.chunks = [(c, list(c.seq.block_table), c.completes) for c in chunks]
            return chunks

        def spy_launch(step, num_drafts, write_deferred_first=False):
            drafts = launch(step, num_drafts, write_deferred_first)
            self.record.features = step.features
            self.record.num_drafts = num_drafts
            self.record.proposers = [] if drafts is None else drafts.proposers
            return drafts

        def spy_finish(step):
            result = finish(step)
            self.record.num_accepted = result.num_accepted
            return result

        scheduler.schedule, launcher.launch, runner.finish = spy_schedule, spy_launch, spy_finish

    def caches(self) -> list[torch.Tensor]:  # each [num_slots, Hkv, D]
        return [c.flatten(0, 1) for a in self.layers for c in (a.key_cache, a.value_cache)]

    def step(self) -> list:
        before = [c.clone() for c in self.caches()]
        outputs = self.engine.step()
        self.check(before)
        return outputs

    @torch.inference_mode()
    def check(self, before: list[torch.Tensor]) -> None:
        rec, bs = self.record, self.engine.config.block_size
        rows, positions, slots, proposal_slots = [], [], [], []
        row = 0
        for i, ((chunk, table, completes), accepted) in enumerate(
            zip(rec.chunks, rec.num_accepted, strict=True)
        ):
            n = len(chunk.token_ids)
            count = n if accepted is None else accepted + 1
            span = range(chunk.start, chunk.start + count)
            rows += range(row, row + count)
            positions += span
            slots += slots_for_positions(table, span, bs)
            if i in rec.proposers:
                anchor = chunk.start + count
                # Raises if the block p .. p+N were not allocated at schedule time.
                block = range(anchor, anchor + rec.num_drafts + 1)
                proposal_slots += slots_for_positions(table, block, bs)
            self.kinds.add(
                "verify" if accepted is not None else "complete" if completes else "partial"
            )
            if chunk.seq.is_finished:
                self.kinds.add("finished")
            row += n
        assert rec.proposers == [i for i, (_, _, completes) in enumerate(rec.chunks) if completes]
        # The reference: context K/V of exactly the committed rows, from host lists.
        expected = [c.clone() for c in before]
        caches = [(a.key_cache, a.value_cache) for a in self.layers]
        shape = caches[0][0].shape
        for layer, attn in enumerate(self.layers):
            k, v = expected[2 * layer], expected[2 * layer + 1]
            attn.key_cache, attn.value_cache = k.view(shape), v.view(shape)
        try:
            index = torch.tensor(rows)
            self.drafter.write_context(
                rec.features.index_select(0, index), torch.tensor(positions), torch.tensor(slots)
            )
        finally:
            for attn, (k, v) in zip(self.layers, caches, strict=True):
                attn.key_cache, attn.value_cache = k, v
        num_slots = expected[0].shape[0]
        free = torch.ones(num_slots, dtype=torch.bool)
        free[torch.tensor(proposal_slots, dtype=torch.int64)] = False
        free[num_slots - bs :] = False  # the PAD block
        assert not set(slots) & set(proposal_slots)
        for got, want in zip(self.caches(), expected, strict=True):
            torch.testing.assert_close(got[free], want[free], rtol=1e-5, atol=1e-5)
        # Committed slots now hold real K/V, not the poison.
        for got in self.caches():
            assert got[torch.tensor(slots, dtype=torch.int64)].abs().max() < POISON / 10


def run(engine, arrivals: dict[int, list], step_fn) -> dict:
    outputs, step = {}, 0
    while engine.has_unfinished_requests() or arrivals:
        for request in arrivals.pop(step, []):
            engine.add_request(*request)
        outputs.update({o.request_id: o for o in step_fn() if o.finished})
        step += 1
    return outputs


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-twins"])
def test_context_cache_holds_exactly_the_committed_rows(pair, rng, graphs: bool) -> None:
    """A mixed batch: verifies accepting varying runs, a request finishing (its drafts
    dropped), a long prompt chunked over several steps beside them, and a request joining."""
    target, drafter = pair
    kw = dict(block_size=4, max_num_batched_tokens=20, max_model_len=96)
    llm = LLM(str(target), speculative_config=spec(drafter), **kw)
    if graphs:
        llm.engine.capture_graphs([1, 2, 4, 8])
    audit = DrafterCacheAudit(llm.engine)
    prompt = lambda n: torch.randint(4, 64, (n,), generator=rng).tolist()  # noqa: E731
    params = lambda m: SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)  # noqa: E731
    arrivals = {
        0: [("short", prompt(5), params(6)), ("b", prompt(9), params(30))],
        2: [("long", prompt(45), params(12))],
        4: [("c", prompt(3), params(9))],
    }
    requests = {r[0]: (r[1], r[2]) for rs in arrivals.values() for r in rs}
    outs = run(llm.engine, arrivals, audit.step)
    assert audit.kinds == {"verify", "complete", "partial", "finished"}, audit.kinds
    ar = LLM(str(target), **kw)
    for rid, (p, sp) in requests.items():
        want = ar.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids
        assert outs[rid].outputs[0].token_ids == want, rid


def test_mid_prefill_chunk_does_not_draft(pair, rng) -> None:
    """A prompt chunked over several steps writes its context each step but drafts only once
    its last chunk runs: no query block is written past a partial chunk (its table ends at the
    chunk, so a block there would clamp onto committed slots)."""
    target, drafter = pair
    llm = LLM(str(target), block_size=4, max_num_batched_tokens=5, speculative_config=spec(drafter))
    engine = llm.engine
    audit = DrafterCacheAudit(engine)
    proposals: list[int] = []
    original = engine.proposer.propose

    def spy(inputs, block_tables, *args):
        proposals.append(block_tables.shape[0])
        return original(inputs, block_tables, *args)

    engine.proposer.propose = spy
    engine.add_request(
        "r",
        torch.randint(4, 64, (17,), generator=rng).tolist(),
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
    )
    seq = engine.requests["r"]
    for end in (5, 10, 15):  # three partial chunks, positions 0..4, 5..9 and 10..14
        assert audit.step() == []
        assert proposals == [] and seq.drafts is None and seq.num_computed_tokens == end
        # The rest of the chunk's last block: neither context nor a drafter block was written.
        table = seq.block_table
        untouched = slots_for_positions(table, range(end, -(-end // 4) * 4), 4)
        for cache in audit.caches():
            assert cache[untouched].eq(POISON).all()
    audit.step()  # the last chunk completes: it drafts
    assert proposals == [1] and seq.drafts is not None
    while engine.has_unfinished_requests():
        audit.step()
    assert audit.kinds >= {"partial", "complete", "verify"}


def test_drafter_is_launched_before_the_readback(pair, rng, monkeypatch) -> None:
    """Per step: the target forward, then the context write and the drafter forward, and only
    then the step's one read of the device (which the host waits on)."""
    target, drafter = pair
    llm = LLM(str(target), block_size=4, max_num_batched_tokens=8, speculative_config=spec(drafter))
    engine = llm.engine
    events: list[str] = []

    def logged(name: str, fn):
        return lambda *a, **k: events.append(name) or fn(*a, **k)

    drafter = engine.proposer.drafter
    monkeypatch.setattr(engine.model, "forward", logged("target", engine.model.forward))
    monkeypatch.setattr(drafter, "write_context", logged("context", drafter.write_context))
    monkeypatch.setattr(drafter, "forward", logged("draft", drafter.forward))
    monkeypatch.setattr(torch.Tensor, "tolist", logged("readback", torch.Tensor.tolist))
    engine.add_request(
        "a",
        torch.randint(4, 64, (13,), generator=rng).tolist(),
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
    )
    engine.add_request(
        "b",
        torch.randint(4, 64, (3,), generator=rng).tolist(),
        SamplingParams(temperature=0.7, seed=1, max_tokens=7, ignore_eos=True),
    )
    per_step = []
    while engine.has_unfinished_requests():
        events.clear()
        engine.step()
        per_step.append(tuple(events))
    monkeypatch.undo()
    # The first step is a's partial chunk (8 of 13 rows): context only, nothing to read.
    assert per_step[0] == ("target", "context"), per_step
    assert all(s == ("target", "context", "draft", "readback") for s in per_step[1:]), per_step


def test_deferred_context_waits_up_to_its_bytes_and_the_window_bound() -> None:
    """Deferred rows wait until DEFERRED_CONTEXT_MAX_BYTES of features (never fewer than
    DEFERRED_CONTEXT_MIN_ROWS rows), and at most `max_deferred_rows` where a windowed drafter
    sets it."""
    from blockdraft.spec_decode.draft_launch import (
        DEFERRED_CONTEXT_MAX_BYTES,
        DEFERRED_CONTEXT_MIN_ROWS,
        DeferredContext,
        DraftLauncher,
    )

    def fits(width: int, dtype: torch.dtype, waiting: int, rows: int, cap: int | None) -> bool:
        launcher = DraftLauncher(None, None, torch.device("cpu"))
        launcher.max_deferred_rows, launcher.deferred = cap, DeferredContext(num_rows=waiting)
        return launcher._fits(torch.empty(1, width, dtype=dtype), rows)

    smollm2 = DEFERRED_CONTEXT_MAX_BYTES // (5 * 576 * 2)  # 5 target layers of 576, bf16
    assert smollm2 > 10_000
    assert fits(5 * 576, torch.bfloat16, smollm2 - 16, 16, None)
    assert not fits(5 * 576, torch.bfloat16, smollm2 - 15, 16, None)
    huge = DEFERRED_CONTEXT_MAX_BYTES  # a row wider than the budget: still the minimum rows
    assert fits(huge, torch.float32, DEFERRED_CONTEXT_MIN_ROWS - 1, 1, None)
    assert not fits(huge, torch.float32, DEFERRED_CONTEXT_MIN_ROWS, 1, None)
    assert fits(5 * 576, torch.bfloat16, 2000, 32, 2032)
    assert not fits(5 * 576, torch.bfloat16, 2001, 32, 2032)


def test_deferred_decode_rows_find_their_blocks_and_slots_when_asked(rng) -> None:
    """Decode steps' rows are kept as positions and block tables: `lies_in` finds the blocks
    of rows added after an earlier look, and the write gets each row's slot from the table it
    was kept with, even after the request's table was replaced (freed, preempted)."""
    from blockdraft.spec_decode.draft_launch import DeferredContext

    size, deferred = 4, DeferredContext()
    blocks = torch.randperm(64, generator=rng)[:12].tolist()
    tables = [blocks[:6], blocks[6:]]  # two requests' (distinct blocks)
    steps = [[6, 17], [7, 18], [8, 19]]  # their positions, step by step
    for positions in steps[:2]:
        deferred.add_decode_rows(torch.randn(2, 3, generator=rng), positions, list(tables))
    assert deferred.lies_in({tables[1][4]}, size)  # positions 17 and 18: block 4
    assert not deferred.lies_in({tables[0][2], tables[1][3]}, size)  # none kept there yet
    deferred.add_decode_rows(torch.randn(2, 3, generator=rng), steps[2], list(tables))
    assert deferred.lies_in({tables[0][2]}, size)  # position 8, kept after the last look
    assert not deferred.lies_in(set(), size)
    kept = [list(t) for t in tables]
    tables[0] = []  # a freed request gets a new table; its rows keep the old one
    features, positions, slots = deferred.tensors(torch.device("cpu"), None, size)
    assert positions.tolist() == [p for step in steps for p in step]
    assert slots.tolist() == [
        kept[i][p // size] * size + p % size for step in steps for i, p in enumerate(step)
    ]
    assert features.shape == (6, 3)
