"""Scheduler with a real BlockManager and real Sequences, no model: each test plays the engine's
part (a chunk's tokens become computed, a chunk that completes samples a token) on random
prompts. Covers the token budget and chunked prefill, the max_num_seqs cap, FIFO admission,
preemption of the newest running request for recompute, the lookahead room reserved for
speculative steps, and finishing."""

import random

import pytest
import torch

from blockdraft import SamplingParams
from blockdraft.engine.block_manager import BlockManager
from blockdraft.engine.scheduler import ScheduledChunk, Scheduler
from blockdraft.engine.sequence import DRAFT_PLACEHOLDER, Sequence, SequenceStatus
from blockdraft.spec_decode.drafts import DraftBatch, PendingDrafts


@pytest.fixture
def py_rng(rng: torch.Generator) -> random.Random:
    return random.Random(int(torch.randint(0, 2**31, (1,), generator=rng)))


def make_scheduler(
    num_blocks: int = 1024,
    block_size: int = 4,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 1 << 20,
    num_lookahead_tokens: int = 0,
    enable_prefix_caching: bool = False,
) -> Scheduler:
    manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
    return Scheduler(manager, max_num_seqs, max_num_batched_tokens, num_lookahead_tokens)


def make_seq(py_rng: random.Random, num_tokens: int, request_id: str) -> Sequence:
    prompt = [py_rng.randrange(1, 1000) for _ in range(num_tokens)]
    return Sequence(request_id, None, prompt, SamplingParams(), seed=0, max_tokens=1000)


def advance(sched: Scheduler, chunks: list[ScheduledChunk], py_rng: random.Random) -> None:
    """The engine's bookkeeping after a step without drafts: each chunk's tokens are in the KV
    cache, and a chunk that completes samples the request's next token."""
    for chunk in chunks:
        assert chunk.num_drafts == 0
        seq = chunk.seq
        seq.num_computed_tokens = chunk.start + len(chunk.token_ids)
        if chunk.completes:
            seq.token_ids.append(py_rng.randrange(1, 1000))
        sched.block_manager.register_computed_blocks(seq)


def summary(chunks: list[ScheduledChunk]) -> list[tuple[str, int, int]]:
    return [(c.seq.request_id, c.start, len(c.token_ids)) for c in chunks]


def num_blocks_for(sched: Scheduler, num_tokens: int) -> int:
    return -(-num_tokens // sched.block_manager.block_size)


@pytest.mark.parametrize("speculative", [False, True])
def test_long_prompt_is_prefilled_over_several_steps(
    py_rng: random.Random, speculative: bool
) -> None:
    budget = py_rng.randrange(8, 40)
    lookahead = py_rng.randrange(2, 17) if speculative else 0
    sched = make_scheduler(
        block_size=py_rng.choice([4, 16]),
        max_num_batched_tokens=budget,
        num_lookahead_tokens=lookahead,
    )
    length = py_rng.randrange(2 * budget + 1, 5 * budget)
    seq = make_seq(py_rng, length, "long")
    prompt = list(seq.token_ids)
    sched.add(seq)
    for start in range(0, length, budget):
        chunks = sched.schedule()
        end = min(start + budget, length)
        assert summary(chunks) == [("long", start, end - start)]
        assert chunks[0].token_ids == prompt[start:end]
        assert chunks[0].completes == (end == length)
        # Blocks for the chunk; the last one also reserves the lookahead the drafter writes.
        reserved = end + (lookahead if end == length else 0)
        assert len(seq.block_table) == num_blocks_for(sched, reserved)
        advance(sched, chunks, py_rng)
        assert seq.status == SequenceStatus.RUNNING and not sched.waiting
    # Then one decode row per step, at the position of the sampled token.
    for _ in range(3):
        chunks = sched.schedule()
        assert summary(chunks) == [("long", seq.num_tokens - 1, 1)]
        assert chunks[0].token_ids == [seq.token_ids[-1]] and chunks[0].completes
        assert len(seq.block_table) == num_blocks_for(sched, seq.num_tokens + lookahead)
        advance(sched, chunks, py_rng)


def test_budget_is_split_in_arrival_order(py_rng: random.Random) -> None:
    budget = py_rng.randrange(16, 64)
    sched = make_scheduler(max_num_batched_tokens=budget)
    lengths = [py_rng.randrange(1, budget) for _ in range(py_rng.randrange(4, 10))]
    seqs = [make_seq(py_rng, n, f"r{i}") for i, n in enumerate(lengths)]
    for seq in seqs:
        sched.add(seq)
    # Each request in turn takes what is left of the budget; the one where it runs out gets a
    # partial chunk, the ones after it wait (none is skipped for a shorter one behind it).
    expected, left = [], budget
    for seq in seqs:
        if left == 0:
            break
        expected.append((seq.request_id, 0, min(seq.num_tokens, left)))
        left -= expected[-1][2]
    chunks = sched.schedule()
    assert summary(chunks) == expected
    assert sum(len(c.token_ids) for c in chunks) == min(budget, sum(lengths))
    assert sched.running == seqs[: len(expected)]
    assert list(sched.waiting) == seqs[len(expected) :]
    assert all(s.status == SequenceStatus.WAITING and not s.block_table for s in sched.waiting)


def test_decode_rows_count_against_the_budget(py_rng: random.Random) -> None:
    budget = py_rng.randrange(16, 64)
    num_decoding = py_rng.randrange(1, budget // 4)  # their prompts fit in one step
    sched = make_scheduler(max_num_batched_tokens=budget)
    decoding = [make_seq(py_rng, py_rng.randrange(1, 4), f"d{i}") for i in range(num_decoding)]
    for seq in decoding:
        sched.add(seq)
    advance(sched, sched.schedule(), py_rng)
    long = make_seq(py_rng, 2 * budget, "long")
    sched.add(long)
    chunks = sched.schedule()
    # Running requests first, one row each; the new prompt gets the rest of the budget.
    assert summary(chunks) == [(s.request_id, s.num_tokens - 1, 1) for s in decoding] + [
        ("long", 0, budget - num_decoding)
    ]
    advance(sched, chunks, py_rng)
    # Next step: the prompt's next chunk again gets what the decode rows leave.
    chunks = sched.schedule()
    assert summary(chunks)[-1] == ("long", budget - num_decoding, budget - num_decoding)
    assert len(chunks) == num_decoding + 1


def test_random_traffic_follows_the_budget_policy(py_rng: random.Random) -> None:
    """With blocks to spare, every step: running requests in admission order, each its pending
    tokens up to what is left of the budget, then waiting requests in arrival order while the
    budget and max_num_seqs allow."""
    budget = py_rng.randrange(4, 48)
    max_num_seqs = py_rng.randrange(1, 8)
    sched = make_scheduler(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    num_outputs: dict[str, int] = {}
    arrivals = 0
    for _ in range(200):
        for _ in range(py_rng.choice([0, 0, 0, 1, 2])):
            seq = make_seq(py_rng, py_rng.randrange(1, 3 * budget), f"r{arrivals}")
            num_outputs[seq.request_id] = py_rng.randrange(1, 6)
            sched.add(seq)
            arrivals += 1
        expected, left = [], budget
        for seq in sched.running:
            if left == 0:
                break
            num_new = min(seq.num_tokens - seq.num_computed_tokens, left)
            expected.append((seq.request_id, seq.num_computed_tokens, num_new))
            left -= num_new
        for seq in list(sched.waiting)[: max_num_seqs - len(sched.running)]:
            if left == 0:
                break
            expected.append((seq.request_id, 0, min(seq.num_tokens, left)))
            left -= expected[-1][2]
        chunks = sched.schedule()
        assert summary(chunks) == expected
        assert len(sched.running) <= max_num_seqs
        advance(sched, chunks, py_rng)
        for seq in list(sched.running):
            if seq.num_output_tokens >= num_outputs[seq.request_id]:
                sched.finish(seq)
    assert sched.num_preemptions == 0
    assert arrivals > 0


def test_max_num_seqs_caps_what_runs(py_rng: random.Random) -> None:
    max_num_seqs = py_rng.randrange(1, 6)
    sched = make_scheduler(max_num_seqs=max_num_seqs)
    seqs = [make_seq(py_rng, py_rng.randrange(1, 20), f"r{i}") for i in range(max_num_seqs + 3)]
    for seq in seqs:
        sched.add(seq)
    chunks = sched.schedule()
    assert [c.seq for c in chunks] == seqs[:max_num_seqs]
    assert list(sched.waiting) == seqs[max_num_seqs:]
    advance(sched, chunks, py_rng)
    chunks = sched.schedule()  # decodes only: no room for another request
    assert [c.seq for c in chunks] == seqs[:max_num_seqs]
    advance(sched, chunks, py_rng)
    done = py_rng.choice(seqs[:max_num_seqs])
    sched.finish(done)
    chunks = sched.schedule()
    # The freed slot goes to the first one waiting.
    running = [s for s in seqs[:max_num_seqs] if s is not done]
    assert [c.seq for c in chunks] == running + [seqs[max_num_seqs]]
    assert summary(chunks)[-1] == (f"r{max_num_seqs}", 0, seqs[max_num_seqs].num_tokens)
    assert list(sched.waiting) == seqs[max_num_seqs + 1 :]


def test_request_whose_blocks_do_not_fit_keeps_its_place(py_rng: random.Random) -> None:
    """A waiting request the pool has no room for is not admitted and holds nothing; the ones
    behind it wait too, even when they would fit."""
    block_size = 4
    num_blocks = py_rng.randrange(4, 12)
    sched = make_scheduler(num_blocks=num_blocks, block_size=block_size)
    first = make_seq(py_rng, block_size * (num_blocks - 2), "first")
    sched.add(first)
    advance(sched, sched.schedule(), py_rng)
    free = sched.block_manager.num_free_blocks
    assert free == 2
    big = make_seq(py_rng, 2 * block_size + 1, "big")  # three blocks
    small = make_seq(py_rng, 1, "small")
    sched.add(big)
    sched.add(small)
    chunks = sched.schedule()
    assert summary(chunks) == [("first", first.num_tokens - 1, 1)]
    assert list(sched.waiting) == [big, small]
    assert big.block_table == [] and big.num_computed_tokens == 0
    assert sched.block_manager.num_free_blocks == free - 1  # first's next block only
    sched.finish(first)
    chunks = sched.schedule()
    assert summary(chunks) == [("big", 0, big.num_tokens), ("small", 0, 1)]


def test_lookahead_is_reserved_at_admission(py_rng: random.Random) -> None:
    """A prompt that fits the pool but not with the drafter's block after it waits."""
    block_size = py_rng.choice([4, 8])
    lookahead = py_rng.randrange(2, 17)
    num_blocks = py_rng.randrange(lookahead // block_size + 2, 12)
    prompt_len = num_blocks * block_size - lookahead + 1  # one position short
    for reserve, admitted in ((lookahead, False), (0, True)):
        sched = make_scheduler(
            num_blocks=num_blocks, block_size=block_size, num_lookahead_tokens=reserve
        )
        seq = make_seq(py_rng, prompt_len, "r")
        sched.add(seq)
        chunks = sched.schedule()
        assert bool(chunks) == admitted
        assert sched.block_manager.num_free_blocks == (
            num_blocks - num_blocks_for(sched, prompt_len) if admitted else num_blocks
        )


def test_newest_running_requests_are_preempted_for_recompute(py_rng: random.Random) -> None:
    """Requests of two blocks each fill the pool; when their decode needs a third block, the
    newest running ones go back to the front of the waiting queue (oldest first), lose their
    blocks and computed tokens, and come back first, recomputing everything they hold."""
    block_size = py_rng.choice([2, 4, 8])
    for num_reqs in range(3, 7):
        sched = make_scheduler(num_blocks=2 * num_reqs, block_size=block_size)
        seqs = [make_seq(py_rng, 2 * block_size, f"r{i}") for i in range(num_reqs)]
        for seq in seqs:
            sched.add(seq)
        advance(sched, sched.schedule(), py_rng)
        assert sched.block_manager.num_free_blocks == 0
        late = make_seq(py_rng, 1, "late")
        sched.add(late)
        chunks = sched.schedule()
        # Each preempted request frees two blocks, each survivor needs one more.
        num_kept = 2 * num_reqs // 3
        kept, preempted = seqs[:num_kept], seqs[num_kept:]
        assert summary(chunks) == [(s.request_id, 2 * block_size, 1) for s in kept]
        assert sched.running == kept
        assert sched.num_preemptions == len(preempted)
        # No admission in a step that preempted: the late request stays behind them.
        assert list(sched.waiting) == preempted + [late]
        for seq in preempted:
            assert seq.status == SequenceStatus.WAITING
            assert seq.block_table == [] and seq.num_computed_tokens == 0
            assert seq.num_tokens == 2 * block_size + 1  # its sampled token is kept
        assert sched.block_manager.num_free_blocks == 2 * len(preempted) - len(kept)
        advance(sched, chunks, py_rng)
        for seq in kept:
            sched.finish(seq)
        chunks = sched.schedule()
        assert summary(chunks) == [(s.request_id, 0, s.num_tokens) for s in preempted] + [
            ("late", 0, 1)
        ]
        assert all(c.token_ids == c.seq.token_ids for c in chunks)


def test_preempted_request_resumes_from_its_cached_blocks(py_rng: random.Random) -> None:
    """With prefix caching, a preempted request's computed full blocks stay cached: readmitted
    before they are reused, it shares them again and computes only the rest."""
    block_size = 4
    sched = make_scheduler(num_blocks=5, block_size=block_size, enable_prefix_caching=True)
    old = make_seq(py_rng, 2 * block_size, "old")
    new = make_seq(py_rng, 2 * block_size + 1, "new")  # three blocks
    sched.add(old)
    sched.add(new)
    advance(sched, sched.schedule(), py_rng)
    new_blocks = list(new.block_table)
    chunks = sched.schedule()  # old needs a third block: the pool has none left
    assert [c.seq for c in chunks] == [old]
    assert list(sched.waiting) == [new]
    advance(sched, chunks, py_rng)
    sched.finish(old)
    chunks = sched.schedule()
    # Its two full blocks (the third held one computed token) are hits; the rest is computed.
    assert summary(chunks) == [("new", 2 * block_size, new.num_tokens - 2 * block_size)]
    assert new.block_table[:2] == new_blocks[:2]
    assert new.num_cached_tokens == 2 * block_size


def test_cached_tokens_never_exceed_the_prompt(py_rng: random.Random) -> None:
    block_size = 4
    sched = make_scheduler(num_blocks=7, block_size=block_size, enable_prefix_caching=True)
    old = make_seq(py_rng, 1, "old")
    new = make_seq(py_rng, 1, "new")
    sched.add(old)
    sched.add(new)
    # Both decode until the pool runs out: the newest is preempted with 3 full blocks computed.
    for _ in range(20):
        advance(sched, sched.schedule(), py_rng)
        if sched.num_preemptions:
            break
    assert list(sched.waiting) == [new]
    sched.finish(old)
    chunks = sched.schedule()
    assert chunks[0].seq is new and chunks[0].start >= 2 * block_size
    assert new.num_cached_tokens <= new.num_prompt_tokens


def test_no_admission_in_a_step_that_preempted(py_rng: random.Random) -> None:
    """A request preempted in a step waits for the next one, even when its cached blocks would
    let it back in at once."""
    block_size = 4
    sched = make_scheduler(
        num_blocks=5, block_size=block_size, max_num_batched_tokens=9, enable_prefix_caching=True
    )
    short = make_seq(py_rng, block_size, "short")
    long = make_seq(py_rng, 3 * block_size + 1, "long")
    sched.add(short)
    sched.add(long)
    chunks = sched.schedule()
    assert summary(chunks) == [("short", 0, 4), ("long", 0, 5)]
    advance(sched, chunks, py_rng)  # long: its first block computed and cached
    # short's decode takes a block; long's next chunk needs two more, one is left: long (the
    # newest) is preempted, with one cached block and three free ones, enough to come back.
    chunks = sched.schedule()
    assert summary(chunks) == [("short", block_size, 1)]
    assert list(sched.waiting) == [long] and sched.num_preemptions == 1
    assert sched.block_manager.num_free_blocks == 3
    advance(sched, chunks, py_rng)
    chunks = sched.schedule()
    assert summary(chunks) == [("short", block_size + 1, 1), ("long", block_size, 8)]


def test_failed_admission_returns_its_cached_blocks(py_rng: random.Random) -> None:
    """A request whose prefix is cached but whose other blocks do not fit gives the cached ones
    back: they stay free and evictable, and it holds nothing while it waits."""
    block_size = 4
    sched = make_scheduler(num_blocks=6, block_size=block_size, enable_prefix_caching=True)
    first = make_seq(py_rng, 2 * block_size + 1, "first")
    sched.add(first)
    advance(sched, sched.schedule(), py_rng)
    cached = first.block_table[:2]
    sched.finish(first)
    filler = make_seq(py_rng, 3 * block_size, "filler")  # takes the three untouched blocks
    sched.add(filler)
    advance(sched, sched.schedule(), py_rng)
    assert not set(filler.block_table) & set(cached)
    # Shares the two cached blocks, needs two more, one is left.
    prompt = first.token_ids[: 2 * block_size] + [1] * (2 * block_size)
    again = Sequence("again", None, prompt, SamplingParams(), seed=0, max_tokens=1000)
    sched.add(again)
    free = sched.block_manager.num_free_blocks
    chunks = sched.schedule()
    assert [c.seq for c in chunks] == [filler]
    assert list(sched.waiting) == [again]
    assert again.block_table == [] and again.num_computed_tokens == 0
    assert sched.block_manager.num_free_blocks == free - 1  # filler's next block only
    assert all(sched.block_manager.ref_counts[b] == 0 for b in cached)


def spec_decoding(
    sched: Scheduler, py_rng: random.Random, num_reqs: int, drafts: list[int]
) -> list[Sequence]:
    """Running requests, prefilled, each holding drafts[i] proposed drafts."""
    seqs = [make_seq(py_rng, py_rng.randrange(1, 30), f"r{i}") for i in range(num_reqs)]
    for seq in seqs:
        sched.add(seq)
    for _ in range(30):
        if all(seq.num_output_tokens for seq in seqs):
            break
        advance(sched, sched.schedule(), py_rng)
    assert all(seq.num_output_tokens for seq in seqs)
    for row, (seq, num_drafts) in enumerate(zip(seqs, drafts, strict=True)):
        # The drafts' values stay on the device: the scheduler only reads how many there are.
        tokens = torch.zeros(num_reqs, num_drafts, dtype=torch.int64)
        seq.drafts = PendingDrafts(DraftBatch(tokens, None), row)
    return seqs


def test_verify_reserves_drafts_and_the_drafters_block(py_rng: random.Random) -> None:
    """A verify computes the last token plus N draft rows, and its blocks cover the drafter's
    block (lookahead rows) past the last draft."""
    num_spec = py_rng.randrange(2, 16)
    lookahead = num_spec + 1
    block_size = py_rng.choice([4, 8, 16])
    sched = make_scheduler(block_size=block_size, num_lookahead_tokens=lookahead)
    num_reqs = py_rng.randrange(1, 5)
    drafts = [py_rng.randrange(1, num_spec + 1) for _ in range(num_reqs)]
    seqs = spec_decoding(sched, py_rng, num_reqs, drafts)
    width = min(drafts)  # one verify shape: the fewest pending drafts
    chunks = sched.schedule()
    assert [c.seq for c in chunks] == seqs
    for chunk, seq in zip(chunks, seqs, strict=True):
        assert chunk.start == seq.num_tokens - 1
        assert chunk.token_ids == [seq.token_ids[-1]] + [DRAFT_PLACEHOLDER] * width
        assert chunk.num_drafts == width and chunk.completes
        assert len(seq.block_table) == num_blocks_for(sched, seq.num_tokens + width + lookahead)


def test_verify_is_never_split(py_rng: random.Random) -> None:
    """A verify the budget left cannot hold whole is not scheduled: its request keeps its
    drafts and computed tokens for the next step."""
    num_drafts = py_rng.randrange(2, 16)
    budget = py_rng.randrange(num_drafts + 2, 2 * num_drafts + 2)  # room for one verify
    sched = make_scheduler(max_num_batched_tokens=budget, num_lookahead_tokens=num_drafts + 1)
    first, second = spec_decoding(sched, py_rng, 2, [num_drafts, num_drafts])
    pending, computed = second.drafts, second.num_computed_tokens
    chunks = sched.schedule()
    assert summary(chunks) == [("r0", first.num_tokens - 1, 1 + num_drafts)]
    assert second.drafts is pending and second.num_computed_tokens == computed
    assert sched.running == [first, second]


def test_finish_frees_blocks_and_forgets_the_request(py_rng: random.Random) -> None:
    num_blocks = 256
    sched = make_scheduler(num_blocks=num_blocks, max_num_seqs=2)
    seqs = [make_seq(py_rng, py_rng.randrange(1, 40), f"r{i}") for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    advance(sched, sched.schedule(), py_rng)
    running, waiting = seqs[:2], seqs[2]
    held = sum(len(s.block_table) for s in running)
    assert held > 0 and sched.block_manager.num_free_blocks == num_blocks - held
    gone = py_rng.choice(running)
    (other,) = [s for s in running if s is not gone]
    sched.finish(gone)
    assert gone.status == SequenceStatus.FINISHED and gone.block_table == []
    assert sched.running == [other]
    assert sched.block_manager.num_free_blocks == num_blocks - len(other.block_table)
    assert sched.waiting[0] is waiting  # nothing scheduled it yet
    sched.finish(waiting)  # an abort before it ran
    assert list(sched.waiting) == [] and waiting.is_finished
    sched.finish(sched.running[0])
    assert not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == num_blocks
    assert sched.schedule() == []
