"""`blockdraft.kernels.triton_attention` (paged attention, split-K and its merge, the step's
norm + RoPE + KV store inside the kernel) against the torch twin, on fresh random float32
inputs over scattered pages.

Runs on the CPU through Triton's interpreter (TRITON_INTERPRET=1, which tests/conftest.py sets
on a machine without a GPU). With TRITON_INTERPRET=0 on a CUDA machine the same tests run the
compiled kernels on the GPU. Shapes stay small: the interpreter costs about half a millisecond
per program.
"""

import pytest
import torch

from blockdraft.kernels import triton_attention
from blockdraft.kernels.forward_context import PAD_SLOT_ID, AttentionMetadata
from blockdraft.kernels.paged_attention import paged_attention
from blockdraft.kernels.rope import (
    rope_store_attention_torch,
)
from blockdraft.kernels.triton_attention import (
    REDUCE_SPLITS_PER_PASS,
    SHORT_SPLIT_KEYS,
    _block_m,
    _block_n,
    _num_warps,
    choose_num_splits,
    triton_paged_attention,
)
from blockdraft.layers.rotary import RotaryEmbedding

from kernel_inputs import (
    ATOL,
    DEVICE,
    needs_triton,
    paged_batch,
    randn,
)

pytestmark = needs_triton


def check_attention(
    rng: torch.Generator,
    starts: list[int],
    query_lens: list[int],
    *,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    causal: bool,
    window: int | None,
    **kwargs: object,
) -> None:
    meta, key_cache, value_cache = paged_batch(
        rng, starts, query_lens, block_size, num_kv_heads, head_dim
    )
    num_tokens = sum(query_lens)
    # A strided query, as sliced out of a fused qkv projection.
    qkv = randn(rng, num_tokens, num_heads + 1, head_dim)
    query = qkv[:, :num_heads]
    scale = head_dim**-0.5
    expected = paged_attention(query, key_cache, value_cache, meta, scale, causal, window)
    out = torch.full((num_tokens, num_heads, head_dim), float("nan"), device=DEVICE)
    got = triton_paged_attention(
        query, key_cache, value_cache, meta, scale, causal, window, out=out, **kwargs
    )
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=1e-4)


# Sequence i computes query_lens[i] rows after starts[i] cached keys: a prefill chunk, a
# decode row, a verify block of 1+3, a sequence with no rows this step, a fresh prefill.
MIXED = dict(starts=[13, 9, 20, 5, 0], query_lens=[7, 1, 4, 0, 6])

MODES = {
    "causal": dict(causal=True, window=None),
    "drafter-block": dict(causal=False, window=None),
    "sliding-causal": dict(causal=True, window=5),
    "sliding-noncausal": dict(causal=False, window=4),
}

# (head_dim, block_size, num_heads, num_kv_heads): GQA groups 1, 2 and 4, a head_dim that is
# no power of two (padded to 32 inside the kernel).
SHAPES = [(16, 4, 4, 4), (24, 16, 4, 2), (64, 4, 8, 2)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "d{}-bs{}-h{}-kv{}".format(*s))
@pytest.mark.parametrize("mode", list(MODES))
def test_attention_mixed_batch(rng, shape, mode: str) -> None:
    head_dim, block_size, num_heads, num_kv_heads = shape
    check_attention(
        rng,
        **MIXED,
        block_size=block_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        **MODES[mode],
    )


@pytest.mark.parametrize("causal,window", [(True, None), (True, 20), (False, 20), (False, None)])
def test_attention_multiple_query_tiles_and_key_tiles(
    rng, causal: bool, window: int | None
) -> None:
    # 16-row tiles hold 8 tokens of a GQA-2 group: the 19-row prefill spans three tiles, and
    # 16-key tiles straddle 4-slot pages. Long contexts give tiles that every row sees whole
    # (the unmasked path) between masked ones at the window edge and the diagonal.
    check_attention(
        rng,
        starts=[51, 3, 60],
        query_lens=[19, 2, 1],
        block_size=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        causal=causal,
        window=window,
        block_m=16,
        block_n=16,
    )


def test_attention_group_not_power_of_two(rng) -> None:
    check_attention(
        rng,
        starts=[6, 11],
        query_lens=[5, 1],
        block_size=4,
        num_heads=6,
        num_kv_heads=2,
        head_dim=16,
        causal=True,
        window=7,
    )


@pytest.mark.parametrize("num_splits", [None, 1])
def test_attention_single_decode_row(rng, num_splits: int | None) -> None:
    check_attention(
        rng,
        starts=[37],
        query_lens=[1],
        block_size=16,
        num_heads=4,
        num_kv_heads=1,
        head_dim=24,
        causal=True,
        window=None,
        num_splits=num_splits,
    )


def test_attention_empty_batch() -> None:
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.int64, device=DEVICE),
        query_start_loc=torch.zeros(1, dtype=torch.int64, device=DEVICE),
        seq_lens=torch.zeros(0, dtype=torch.int64, device=DEVICE),
        block_tables=torch.zeros(0, 1, dtype=torch.int64, device=DEVICE),
        max_query_len=0,
        max_seq_len=0,
        block_size=4,
    )
    cache = torch.zeros(2, 4, 1, 16, device=DEVICE)
    out = triton_paged_attention(torch.zeros(0, 2, 16, device=DEVICE), cache, cache, meta, 0.25)
    assert out.shape == (0, 2, 16)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "num_splits"),
    [(m, n) for m in ("causal", "drafter-block", "sliding-noncausal") for n in (5, 37)]
    + [("causal", 2 * REDUCE_SPLITS_PER_PASS[1] + 3)],  # several passes: ~10 s interpreted
)
def test_attention_split_k_forced(rng, mode: str, num_splits: int) -> None:
    # 16-key tiles over contexts of 3 to 62 keys (to ~16 keys a split with more splits: one
    # pass of the merge's larger size, then several): some splits, and whole passes of the
    # merge, get no keys at all (short sequences, the window), which it must weigh as nothing.
    check_attention(
        rng,
        starts=[58 + 16 * max(0, num_splits - 4), 2, 30],
        query_lens=[4, 1, 3],
        block_size=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        num_splits=num_splits,
        block_n=16,
        **MODES[mode],
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "num_splits"),
    [(4, 2, 16, 5), (6, 2, 24, 16), (8, 2, 16, 3), (2, 2, 16, 7)],  # GQA 2, 3 (as 4), 4, 1
)
def test_attention_decode_merges_its_splits(
    rng, num_heads: int, num_kv_heads: int, head_dim: int, num_splits: int
) -> None:
    """Decode rows with a counter buffer: the attention kernel's last split merges (no reduce
    kernel), matching the twin, twice on the same counters (left zeroed after each launch);
    short contexts leave trailing splits empty. Too few counters, or more splits than one
    merge tile holds, fall back to the reduce kernel with the same result."""
    counters = torch.zeros(16, dtype=torch.int32, device=DEVICE)
    shape = dict(block_size=4, num_heads=num_heads, num_kv_heads=num_kv_heads,
                 head_dim=head_dim, causal=True, window=None, block_n=16)  # fmt: skip
    reduce_kernel = triton_attention._paged_attention_reduce_kernel
    triton_attention._paged_attention_reduce_kernel = None  # a launch of it would fail
    try:
        for starts in ([57, 3, 20], [int(torch.randint(30, 70, (1,), generator=rng)), 0, 9]):
            check_attention(rng, starts=starts, query_lens=[1, 1, 1], num_splits=num_splits,
                            split_counters=counters, **shape)  # fmt: skip
            assert not counters.any()
    finally:
        triton_attention._paged_attention_reduce_kernel = reduce_kernel
    few = torch.zeros(2 * num_kv_heads, dtype=torch.int32, device=DEVICE)
    check_attention(rng, starts=[40, 5, 33], query_lens=[1, 1, 1], num_splits=num_splits,
                    split_counters=few, **shape)  # fmt: skip
    check_attention(rng, starts=[40, 5, 33], query_lens=[1, 1, 1], num_splits=17,
                    split_counters=counters, **shape)  # fmt: skip
    assert not few.any() and not counters.any()


def test_attention_decode_merge_only_for_decode_rows(rng) -> None:
    """Verify blocks (several query rows) keep the reduce kernel: the counters stay zero."""
    counters = torch.zeros(16, dtype=torch.int32, device=DEVICE)
    check_attention(rng, starts=[50, 21], query_lens=[3, 3], block_size=4, num_heads=4,
                    num_kv_heads=2, head_dim=16, causal=True, window=None, num_splits=4,
                    block_n=16, split_counters=counters)  # fmt: skip
    assert not counters.any()


def rope_attention_case(
    rng: torch.Generator,
    starts: list[int],
    query_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    qk_norm: bool,
    partial_rotary_factor: float = 1.0,
) -> tuple[dict, dict]:
    """Inputs of `triton_rope_store_attention` / `rope_store_attention_torch` over scattered
    pages (the twin's caches a copy), the first sequence's slot PAD; the step's keys in the
    cache start as noise, which a missing store would leave there."""
    meta, key_cache, value_cache = paged_batch(
        rng, starts, query_lens, 4, num_kv_heads, head_dim, spare_blocks=1
    )
    # A reserved last block, as the engine's pool has, for the twin's PAD write to land in.
    key_cache, value_cache = (torch.cat([c, randn(rng, 1, *c.shape[1:])]) for c in
                              (key_cache, value_cache))  # fmt: skip
    num_tokens = sum(query_lens)
    meta.slot_mapping[0] = PAD_SLOT_ID
    qkv = randn(rng, num_tokens, num_heads + 2 * num_kv_heads + 1, head_dim)  # strided views
    rotary = RotaryEmbedding(
        head_dim, 128, 10000.0, None, partial_rotary_factor=partial_rotary_factor
    ).to(DEVICE)
    weights = (1 + 0.2 * randn(rng, head_dim), 1 + 0.2 * randn(rng, head_dim))
    args = dict(
        query=qkv[:, :num_heads], key=qkv[:, num_heads : num_heads + num_kv_heads],
        value=qkv[:, num_heads + num_kv_heads : -1],
        positions=torch.cat([torch.arange(s, s + n, device=DEVICE)
                             for s, n in zip(starts, query_lens, strict=True)]),
        cos_cache=rotary.cos_cache, sin_cache=rotary.sin_cache,
        q_norm_weight=weights[0] if qk_norm else None,
        k_norm_weight=weights[1] if qk_norm else None, eps=1e-6,
    )  # fmt: skip
    cached = dict(key_cache=key_cache, value_cache=value_cache, meta=meta, scale=head_dim**-0.5)
    return args, cached


@pytest.mark.slow
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "qk_norm", "num_splits", "query_lens", "causal"),
    [
        (4, 4, 16, True, 1, [1, 1, 1], True),  # decode
        (4, 2, 24, False, 3, [1, 1, 1], True),
        (6, 2, 16, True, 5, [1, 1, 1], True),
        (8, 2, 16, True, 1, [1, 1, 1], True),
        (4, 2, 16, True, 4, [4, 1, 3], True),  # verify blocks: step keys across splits
        (6, 2, 24, True, 1, [5, 5, 5], True),
        (4, 2, 16, True, 3, [4, 4, 4], False),  # drafter blocks (non-causal)
    ],
)
def test_attention_norms_rotates_and_stores_the_step(
    rng,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    qk_norm: bool,
    num_splits: int,
    query_lens: list[int],
    causal: bool,
) -> None:
    """A launch with the step's raw q/k/v: the kernel norms and rotates the queries and keys
    (as the RoPE kernel), stores the keys and values at their slots (none for a PAD row) and
    attends over them; the output and both caches equal the twin's (RoPE + store, then
    attention), with and without split-K (a block's keys then span splits), with no RoPE
    kernel launched."""
    starts = [int(v) for v in torch.randint(5, 60, (3,), generator=rng)]
    args, cached = rope_attention_case(rng, starts, query_lens, num_heads, num_kv_heads,
                                       head_dim, qk_norm)  # fmt: skip
    cached["causal"] = causal
    twin_caches = {k: cached[k].clone() for k in ("key_cache", "value_cache")}
    expected = rope_store_attention_torch(**args, **{**cached, **twin_caches})
    step_kv = triton_attention.StepKV(
        args["key"], args["value"], args["positions"], args["cos_cache"], args["sin_cache"],
        args["q_norm_weight"], args["k_norm_weight"], args["eps"], cached["meta"].slot_mapping,
    )  # fmt: skip
    out = torch.full((sum(query_lens), num_heads, head_dim), float("nan"), device=DEVICE)
    rope_kernel = triton_attention.triton_qk_norm_rope_store
    triton_attention.triton_qk_norm_rope_store = None  # a launch of it would fail
    try:
        got = triton_paged_attention(
            args["query"], cached["key_cache"], cached["value_cache"], cached["meta"],
            cached["scale"], causal, out=out, num_splits=num_splits, block_n=16,
            step_kv=step_kv, split_counters=torch.zeros(16, dtype=torch.int32, device=DEVICE),
        )  # fmt: skip
    finally:
        triton_attention.triton_qk_norm_rope_store = rope_kernel
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=1e-4)
    # The twin wraps the PAD row into the pool's reserved last block, where the kernel writes
    # nothing; every other slot must match.
    for name, cache in twin_caches.items():
        torch.testing.assert_close(cached[name][:-1], cache[:-1], atol=1e-6, rtol=1e-6)


def test_rope_store_attention_fused_or_not(rng, monkeypatch, set_policy) -> None:
    """The public wrapper: launches of at most the policy's rope_in_attention_max_query_len
    query rows take the fused kernel, others (and all with 0, and a partial rotary table,
    which the attention kernel cannot rotate) run the RoPE kernel first; all equal the twin."""
    calls = []
    rope_kernel = triton_attention.triton_qk_norm_rope_store

    def counting(*a: object, **kw: object) -> object:
        calls.append(1)
        return rope_kernel(*a, **kw)

    monkeypatch.setattr(triton_attention, "triton_qk_norm_rope_store", counting)
    for query_lens, max_rows, partial, expect_calls in (
        ([1, 1], 1, 1.0, 0), ([3, 2], 1, 1.0, 1), ([1, 1], 0, 1.0, 1), ([3, 2], 16, 1.0, 0),
        ([1, 1], 1, 0.5, 1),
    ):  # fmt: skip
        set_policy(rope_in_attention_max_query_len=max_rows)
        calls.clear()
        args, cached = rope_attention_case(rng, [21, 40], query_lens, 4, 2, 16, True, partial)
        twin = {k: cached[k].clone() for k in ("key_cache", "value_cache")}
        expected = rope_store_attention_torch(**args, **{**cached, **twin})
        got = triton_attention.triton_rope_store_attention(**args, **cached)
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=1e-4)
        torch.testing.assert_close(cached["key_cache"][:-1], twin["key_cache"][:-1])
        assert len(calls) == expect_calls, (query_lens, max_rows)


def test_step_kv_is_checked(rng) -> None:
    args, cached = rope_attention_case(rng, [9, 12], [1, 1], 4, 2, 16, True)
    step_kv = triton_attention.StepKV(
        args["key"], args["value"], args["positions"], args["cos_cache"], args["sin_cache"],
        args["q_norm_weight"], None, 1e-6, cached["meta"].slot_mapping,
    )  # fmt: skip
    with pytest.raises(ValueError, match="q and k norms come together"):
        triton_paged_attention(args["query"], cached["key_cache"], cached["value_cache"],
                               cached["meta"], 0.25, step_kv=step_kv)  # fmt: skip
    half_table = step_kv._replace(k_norm_weight=args["k_norm_weight"],
                                  cos_cache=args["cos_cache"][:, :4],
                                  sin_cache=args["sin_cache"][:, :4])  # fmt: skip
    with pytest.raises(ValueError, match="whole heads"):
        triton_paged_attention(args["query"], cached["key_cache"], cached["value_cache"],
                               cached["meta"], 0.25, step_kv=half_table)  # fmt: skip
    long, cached = rope_attention_case(rng, [9, 12], [9, 1], 4, 2, 16, True)
    step_kv = triton_attention.StepKV(
        long["key"], long["value"], long["positions"], long["cos_cache"], long["sin_cache"],
        long["q_norm_weight"], long["k_norm_weight"], 1e-6, cached["meta"].slot_mapping,
    )  # fmt: skip
    with pytest.raises(ValueError, match="in one tile of 8"):  # 16-row tiles of GQA-2 pairs
        triton_paged_attention(long["query"], cached["key_cache"], cached["value_cache"],
                               cached["meta"], 0.25, step_kv=step_kv, block_m=16)  # fmt: skip


def test_attention_split_k_chosen_for_long_decode(rng) -> None:
    starts, query_lens = [1100, 700], [1, 4]
    num_splits = choose_num_splits(max(query_lens), 1104, 2, 2, DEVICE)
    assert num_splits > 1
    check_attention(
        rng,
        starts=starts,
        query_lens=query_lens,
        block_size=16,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        causal=True,
        window=None,
        block_n=128,  # fewer, larger key tiles: the interpreter pays per operation
    )


def test_choose_num_splits() -> None:
    device = torch.device("cpu")  # the heuristic's stand-in SM count is 16
    assert choose_num_splits(512, 4096, 1, 8, device) == 1  # prefill: enough query tiles
    assert choose_num_splits(1, 300, 1, 8, device) == 1  # short context: nothing to split
    assert choose_num_splits(1, 832, 1, 8, device) == 4  # 8 programs -> two waves of 16 SMs
    assert choose_num_splits(1, 640, 1, 1, device) == 10  # at most one split per 64 keys
    assert choose_num_splits(1, 8192, 1, 2, device) == 16  # two waves over 16 SMs
    assert choose_num_splits(16, 8192, 64, 8, device) == 1  # the grid already fills the GPU
    assert choose_num_splits(1, 8192, 2, 8, device) == 1  # 16 programs already fill 16 SMs


def test_attention_tile_rule() -> None:
    # Query tiles hold every query's GQA group: 16 rows for a decode query, up to 64.
    assert _block_m(1, 4) == 16 and _block_m(16, 4) == 64 and _block_m(512, 4) == 64
    # Key tiles: 32 keys for 2-16 query rows (verify, drafter blocks) over short splits only;
    # decode, prefill and long splits keep 64 (32 for wide heads).
    assert _block_n(16, 128, 64) == 32
    assert _block_n(2, 64, SHORT_SPLIT_KEYS) == 32
    assert _block_n(16, 128, SHORT_SPLIT_KEYS + 1) == 64
    assert _block_n(1, 128, 64) == 64
    assert _block_n(17, 128, 64) == 64
    assert _block_n(512, 256, 4096) == 32
    # A decode query's 16-row tile runs on 2 warps, else 4 (8 for big tiles), whatever the walk.
    assert _num_warps(16, 128) == 2 and _num_warps(16, 64) == 2
    assert _num_warps(64, 128) == 4
    assert _num_warps(64, 256) == 8
