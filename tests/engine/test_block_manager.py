"""BlockManager on its own, on random prompts: allocation and freeing, reference counts, prefix
cache hits (full blocks only, chained on everything before them), the order in which freed
blocks are reused, and a pool that runs out."""

import random

import pytest

from blockdraft import SamplingParams
from blockdraft.engine.block_manager import BlockManager
from blockdraft.engine.sequence import Sequence


def make_seq(tokens: list[int]) -> Sequence:
    return Sequence("r", None, tokens, SamplingParams(), seed=0, max_tokens=1000)


def random_tokens(py_rng: random.Random, n: int) -> list[int]:
    return [py_rng.randrange(1000) for _ in range(n)]


def compute(manager: BlockManager, seq: Sequence, num_computed: int | None = None) -> None:
    """What the engine does for a request: blocks for its tokens, the K/V of the first
    `num_computed` of them (all by default) written, and the full ones registered."""
    assert manager.ensure_capacity(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens if num_computed is None else num_computed
    manager.register_computed_blocks(seq)


def admit(manager: BlockManager, tokens: list[int]) -> tuple[Sequence, int]:
    """A new request sharing what the cache holds of its prompt, then computing the rest."""
    seq = make_seq(tokens)
    hit = manager.allocate_cached_prefix(seq)
    seq.num_computed_tokens = hit
    compute(manager, seq)
    return seq, hit


@pytest.fixture
def block_size(py_rng: random.Random) -> int:
    return py_rng.choice([2, 4, 8, 16])


def test_allocate_grow_and_free(py_rng: random.Random, block_size: int) -> None:
    num_blocks = py_rng.randrange(8, 40)
    manager = BlockManager(num_blocks, block_size, enable_prefix_caching=True)
    seq = make_seq(random_tokens(py_rng, 3))
    ids_seen: list[int] = []
    for num_tokens in sorted(py_rng.sample(range(1, num_blocks * block_size + 1), 5)):
        assert manager.ensure_capacity(seq, num_tokens)
        expected_len = -(-num_tokens // block_size)
        assert len(seq.block_table) == expected_len
        # Growing keeps the blocks held and appends new ones; a fresh pool hands out ids in order.
        assert seq.block_table[: len(ids_seen)] == ids_seen
        assert seq.block_table == list(range(expected_len))
        ids_seen = list(seq.block_table)
        assert manager.num_free_blocks == num_blocks - expected_len
        assert manager.usage == pytest.approx(expected_len / num_blocks)
        assert all(manager.ref_counts[b] == 1 for b in seq.block_table)
        # Asking for fewer positions than held allocates nothing.
        assert manager.ensure_capacity(seq, py_rng.randrange(1, num_tokens + 1))
        assert seq.block_table == ids_seen
    manager.free(seq)
    assert seq.block_table == []
    assert manager.num_free_blocks == num_blocks
    assert manager.ref_counts == [0] * num_blocks
    assert manager.usage == 0.0


def test_running_out_of_blocks_allocates_nothing(py_rng: random.Random, block_size: int) -> None:
    num_blocks = py_rng.randrange(4, 20)
    manager = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
    first = make_seq(random_tokens(py_rng, 1))
    held = py_rng.randrange(1, num_blocks)
    assert manager.ensure_capacity(first, held * block_size)
    second = make_seq(random_tokens(py_rng, 1))
    left = num_blocks - held
    assert manager.ensure_capacity(second, 1)  # one block
    # One position more than the pool has room for: refused, and nothing taken.
    assert not manager.ensure_capacity(second, left * block_size + 1)
    assert len(second.block_table) == 1
    assert manager.num_free_blocks == left - 1
    assert manager.ref_counts.count(1) == held + 1
    # Exactly the room left: granted, to the last block.
    assert manager.ensure_capacity(second, left * block_size)
    assert manager.num_free_blocks == 0
    assert sorted(first.block_table + second.block_table) == list(range(num_blocks))
    third = make_seq(random_tokens(py_rng, 1))
    assert not manager.ensure_capacity(third, 1)
    assert third.block_table == []
    first_blocks = list(first.block_table)
    manager.free(first)
    assert manager.ensure_capacity(third, 1)
    assert third.block_table == [first_blocks[-1]]  # freed tail first


def test_shared_prompt_prefix_shares_full_blocks(py_rng: random.Random, block_size: int) -> None:
    """A second request whose prompt starts like the first shares the first's full blocks of
    that common start: its partial last block, and every block after the prompts differ, are
    its own."""
    manager = BlockManager(64, block_size, enable_prefix_caching=True)
    tokens = random_tokens(py_rng, py_rng.randrange(2 * block_size, 6 * block_size))
    first, hit = admit(manager, tokens)
    assert hit == 0
    common = py_rng.randrange(1, len(tokens))
    other = tokens[:common] + [tokens[common] + 1] + random_tokens(py_rng, py_rng.randrange(8))
    second = make_seq(other)
    hit = manager.allocate_cached_prefix(second)
    num_shared = common // block_size  # blocks wholly inside the common start
    assert hit == num_shared * block_size
    assert second.block_table == first.block_table[:num_shared]
    assert all(manager.ref_counts[b] == 2 for b in first.block_table[:num_shared])
    assert all(manager.ref_counts[b] == 1 for b in first.block_table[num_shared:])
    second.num_computed_tokens = hit
    compute(manager, second)
    own = second.block_table[num_shared:]
    assert not set(own) & set(first.block_table)
    assert all(manager.ref_counts[b] == 1 for b in own)


def test_identical_prompt_leaves_one_token_to_compute(
    py_rng: random.Random, block_size: int
) -> None:
    """A prompt that is whole cached blocks shares all but its last block: the step needs one
    token to compute to have logits; one token more and it shares them all."""
    manager = BlockManager(64, block_size, enable_prefix_caching=True)
    num_full = py_rng.randrange(1, 6)
    tokens = random_tokens(py_rng, num_full * block_size + block_size - 1)
    first, _ = admit(manager, tokens)
    same = make_seq(tokens[: num_full * block_size])
    assert manager.allocate_cached_prefix(same) == (num_full - 1) * block_size
    assert same.block_table == first.block_table[: num_full - 1]
    longer = make_seq(tokens[: num_full * block_size + 1])
    assert manager.allocate_cached_prefix(longer) == num_full * block_size
    assert longer.block_table == first.block_table[:num_full]


def test_only_computed_full_blocks_are_registered(py_rng: random.Random, block_size: int) -> None:
    manager = BlockManager(64, block_size, enable_prefix_caching=True)
    tokens = random_tokens(py_rng, py_rng.randrange(3 * block_size, 8 * block_size))
    seq = make_seq(tokens)
    num_computed = py_rng.randrange(len(tokens))
    compute(manager, seq, num_computed)
    registered = num_computed // block_size
    assert sorted(manager.block_key) == sorted(seq.block_table[:registered])
    assert len(manager.cached) == registered
    probe = make_seq(tokens)
    assert manager.allocate_cached_prefix(probe) == registered * block_size
    assert probe.block_table == seq.block_table[:registered]


def test_shared_block_is_freed_by_its_last_user(py_rng: random.Random, block_size: int) -> None:
    num_blocks = 64
    manager = BlockManager(num_blocks, block_size, enable_prefix_caching=True)
    prefix = random_tokens(py_rng, py_rng.randrange(1, 4) * block_size)
    num_shared = len(prefix) // block_size
    users = []
    for _ in range(py_rng.randrange(2, 5)):
        seq, _ = admit(manager, prefix + random_tokens(py_rng, py_rng.randrange(1, 20)))
        users.append(seq)
    shared = users[0].block_table[:num_shared]
    assert all(seq.block_table[:num_shared] == shared for seq in users)
    py_rng.shuffle(users)
    for n, seq in enumerate(users):
        own = seq.block_table[num_shared:]
        free_before = manager.num_free_blocks
        manager.free(seq)
        last = n == len(users) - 1
        assert manager.num_free_blocks == free_before + len(own) + (num_shared if last else 0)
        assert all(manager.ref_counts[b] == 0 for b in own)
        assert all(manager.ref_counts[b] == len(users) - 1 - n for b in shared)
        assert all((b in manager.free_blocks) == last for b in shared)
    assert manager.num_free_blocks == num_blocks


def test_same_block_after_a_different_prefix_is_no_hit(
    py_rng: random.Random, block_size: int
) -> None:
    """Blocks are keyed on everything before them: equal tokens at the same position after a
    different earlier block are different K/V."""
    manager = BlockManager(64, block_size, enable_prefix_caching=True)
    head = random_tokens(py_rng, block_size)
    tail = random_tokens(py_rng, py_rng.randrange(1, 4) * block_size + 1)
    admit(manager, head + tail)
    other_head = list(head)
    other_head[py_rng.randrange(block_size)] += 1000  # token ids of the first are < 1000
    seq = make_seq(other_head + tail)
    assert manager.allocate_cached_prefix(seq) == 0
    assert seq.block_table == []
    # Shifted by a block, the same tokens are no hit either.
    shifted = make_seq(tail)
    assert manager.allocate_cached_prefix(shifted) == 0


def test_prefix_caching_off_never_hits(py_rng: random.Random, block_size: int) -> None:
    manager = BlockManager(64, block_size, enable_prefix_caching=False)
    tokens = random_tokens(py_rng, py_rng.randrange(2 * block_size, 6 * block_size))
    first, hit = admit(manager, tokens)
    assert hit == 0
    assert not manager.cached and not manager.block_key
    second, hit = admit(manager, tokens)
    assert hit == 0
    assert not set(first.block_table) & set(second.block_table)
    manager.free(first)
    third, hit = admit(manager, tokens)
    assert hit == 0


def test_reuse_takes_never_used_then_least_recently_freed(
    py_rng: random.Random, block_size: int
) -> None:
    """A fresh allocation takes untouched blocks first, then freed ones, least recently freed
    first; a request's own blocks from its tail, so its prefix stays cached longest. A block
    taken for reuse leaves the prefix cache."""
    num_blocks = 32
    manager = BlockManager(num_blocks, block_size, enable_prefix_caching=True)
    a, _ = admit(manager, random_tokens(py_rng, py_rng.randrange(2, 6) * block_size))
    b, _ = admit(manager, random_tokens(py_rng, py_rng.randrange(2, 6) * block_size))
    a_tokens, a_blocks, b_blocks = a.token_ids, list(a.block_table), list(b.block_table)
    manager.free(a)
    manager.free(b)
    untouched = [i for i in range(num_blocks) if i not in a_blocks + b_blocks]
    expected_order = untouched + a_blocks[::-1] + b_blocks[::-1]
    assert list(manager.free_blocks) == expected_order

    # Take every untouched block and some of a's tail: a's prompt then hits only up to the
    # first block taken.
    num_evicted = py_rng.randrange(1, len(a_blocks) + 1)
    taker = make_seq([0])
    assert manager.ensure_capacity(taker, (len(untouched) + num_evicted) * block_size)
    assert taker.block_table == expected_order[: len(untouched) + num_evicted]
    num_left = len(a_blocks) - num_evicted
    assert all(b not in manager.block_key for b in a_blocks[num_left:])
    assert len(manager.cached) == num_left + len(b_blocks)
    probe = make_seq(a_tokens + [0])
    assert manager.allocate_cached_prefix(probe) == num_left * block_size
    assert probe.block_table == a_blocks[:num_left]
    manager.free(probe)
    # A hit refreshes its blocks: they go back to the end of the free list.
    assert list(manager.free_blocks) == b_blocks[::-1] + a_blocks[:num_left][::-1]


def test_random_traffic_keeps_the_books(py_rng: random.Random, block_size: int) -> None:
    """Requests with shared prompt starts come, grow and go on a small pool. Throughout, each
    block's reference count is the number of requests holding it, the free list is exactly the
    unreferenced blocks, and every prefix hit hands out blocks whose K/V are that prefix (a
    block overwritten since it was cached is never hit)."""
    num_blocks = py_rng.randrange(6, 24)
    manager = BlockManager(num_blocks, block_size, enable_prefix_caching=True)
    # What each block's K/V were computed from: the tokens up to the block's end.
    contents: dict[int, tuple[int, ...]] = {}
    stems = [random_tokens(py_rng, py_rng.randrange(2, 5) * block_size) for _ in range(3)]
    live: list[Sequence] = []
    num_hits = 0

    def run_to(seq: Sequence, num_tokens: int) -> bool:
        if not manager.ensure_capacity(seq, num_tokens):
            return False
        for i in range(seq.num_computed_tokens // block_size, -(-num_tokens // block_size)):
            contents[seq.block_table[i]] = tuple(
                seq.token_ids[: min(num_tokens, (i + 1) * block_size)]
            )
        seq.num_computed_tokens = num_tokens
        manager.register_computed_blocks(seq)
        return True

    for _ in range(300):
        op = py_rng.random()
        if op < 0.4 or not live:
            stem = py_rng.choice(stems)
            seq = make_seq(
                stem[: py_rng.randrange(1, len(stem) + 1)]
                + random_tokens(py_rng, py_rng.randrange(4))
            )
            hit = manager.allocate_cached_prefix(seq)
            assert hit % block_size == 0 and hit < seq.num_tokens
            for i, b in enumerate(seq.block_table):
                assert contents[b] == tuple(seq.token_ids[: (i + 1) * block_size])
            num_hits += hit > 0
            seq.num_computed_tokens = hit
            if run_to(seq, seq.num_tokens):
                live.append(seq)
            else:
                manager.free(seq)
        elif op < 0.75:  # a decode step: one more token computed
            seq = py_rng.choice(live)
            seq.token_ids.append(py_rng.randrange(1000))
            if not run_to(seq, seq.num_tokens):
                live.remove(seq)
                manager.free(seq)
        else:
            seq = live.pop(py_rng.randrange(len(live)))
            manager.free(seq)
        holders = [0] * num_blocks
        for seq in live:
            assert len(set(seq.block_table)) == len(seq.block_table)
            for b in seq.block_table:
                holders[b] += 1
        assert manager.ref_counts == holders
        assert sorted(manager.free_blocks) == [b for b in range(num_blocks) if holders[b] == 0]
        assert {b: k for k, b in manager.cached.items()} == manager.block_key
    assert num_hits > 0  # the traffic did exercise the cache


def test_prefix_keys_registered_step_by_step_match_one_shot(py_rng: random.Random) -> None:
    """Blocks registered one step at a time (a decode) get the same chained keys as blocks
    registered all at once; a second request with the same tokens then finds all of them."""
    block_size = 4
    tokens = [py_rng.randrange(100) for _ in range(61)]
    manager = BlockManager(64, block_size, enable_prefix_caching=True)
    seq = make_seq(tokens[:5])
    for n in range(5, len(tokens) + 1):  # computed tokens grow by one or two per step
        seq.token_ids = tokens[:n]
        assert manager.ensure_capacity(seq, n)
        seq.num_computed_tokens = n - py_rng.randrange(2)
        manager.register_computed_blocks(seq)
    incremental = dict(manager.cached)

    one_shot = BlockManager(64, block_size, enable_prefix_caching=True)
    other = make_seq(tokens)
    assert one_shot.ensure_capacity(other, len(tokens))
    other.num_computed_tokens = len(tokens)
    one_shot.register_computed_blocks(other)
    assert list(incremental) == list(one_shot.cached)

    again = make_seq(tokens)
    assert manager.allocate_cached_prefix(again) == (len(tokens) - 1) // block_size * block_size
    assert again.block_table == seq.block_table[: len(again.block_table)]
    # ... and keeps chaining from the shared prefix after a recompute.
    again.num_computed_tokens = len(tokens)
    assert manager.ensure_capacity(again, len(tokens))
    manager.register_computed_blocks(again)
    assert list(manager.cached) == list(incremental)


def test_state_slots_come_and_go_with_blocks(py_rng: random.Random) -> None:
    """Hybrid models: a request takes a state slot with its first blocks and gives it back
    with them; when every slot is taken, capacity is refused and nothing is allocated."""
    manager = BlockManager(num_blocks=32, block_size=4, enable_prefix_caching=False,
                           num_state_slots=2)  # fmt: skip
    a, b, c = (make_seq(random_tokens(py_rng, 6)) for _ in range(3))
    assert manager.ensure_capacity(a, 6) and manager.ensure_capacity(b, 6)
    assert {a.state_slot, b.state_slot} == {0, 1}
    slot = a.state_slot
    assert manager.ensure_capacity(a, 12) and a.state_slot == slot  # kept while growing
    free_blocks = manager.num_free_blocks
    assert not manager.ensure_capacity(c, 6)
    assert c.state_slot is None and not c.block_table
    assert manager.num_free_blocks == free_blocks
    manager.free(a)
    assert a.state_slot is None
    assert manager.ensure_capacity(c, 6) and c.state_slot == slot
    dense = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    assert dense.ensure_capacity(a, 6) and a.state_slot is None
