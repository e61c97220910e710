"""Triton kernels against their pure-torch twins, on fresh random float32 inputs.

Runs on the CPU through Triton's interpreter (TRITON_INTERPRET=1, set before triton is
imported). With TRITON_INTERPRET=0 on a CUDA machine the same tests run the compiled kernels
on the GPU. Shapes stay small: the interpreter costs about half a millisecond per program.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

pytest.importorskip("triton")

from blockdraft import LLM, SamplingParams  # noqa: E402
from blockdraft.kernels import select, triton_attention, triton_rope  # noqa: E402
from blockdraft.kernels.dflash_inputs import (  # noqa: E402
    DFlashInputs,
    prepare_dflash_inputs_torch,
)
from blockdraft.kernels.forward_context import (  # noqa: E402
    PAD_SLOT_ID,
    AttentionMetadata,
    forward_context,
)
from blockdraft.kernels.paged_attention import paged_attention, store_kv  # noqa: E402
from blockdraft.kernels.policy import KernelPolicy  # noqa: E402
from blockdraft.kernels.rope import (  # noqa: E402
    qk_norm_rope_store_torch,
    qk_norm_rope_torch,
    rope_store_attention_torch,
    silu_mul_torch,
)
from blockdraft.kernels.sampling import exponential_race_torch, hashed_uniform  # noqa: E402
from blockdraft.kernels.triton_activation import triton_silu_mul  # noqa: E402
from blockdraft.kernels.triton_attention import (  # noqa: E402
    REDUCE_SPLITS_PER_PASS,
    SHORT_SPLIT_KEYS,
    _block_m,
    _block_n,
    _num_warps,
    choose_num_splits,
    triton_paged_attention,
)
from blockdraft.kernels.triton_dflash_inputs import prepare_dflash_inputs  # noqa: E402
from blockdraft.kernels.triton_env import triton_interpreting  # noqa: E402
from blockdraft.kernels.triton_kv_store import triton_store_kv  # noqa: E402
from blockdraft.kernels.triton_rmsnorm import rms_norm_torch, triton_rms_norm  # noqa: E402
from blockdraft.kernels.triton_rope import (  # noqa: E402
    triton_qk_norm_rope,
    triton_qk_norm_rope_store,
)
from blockdraft.kernels.triton_sampling import (  # noqa: E402
    triton_exponential_race,
    triton_hashed_uniform,
)
from blockdraft.layers.linear import fuse_projections  # noqa: E402
from blockdraft.layers.mlp import MLP  # noqa: E402
from blockdraft.layers.norm import RMSNorm, final_norm  # noqa: E402
from blockdraft.layers.rotary import RotaryEmbedding  # noqa: E402
from blockdraft.layers.sampler import SamplingTensors, sample  # noqa: E402
from blockdraft.models.llama import DecoderLayer  # noqa: E402
from blockdraft.models.model_config import TransformerConfig  # noqa: E402
from blockdraft.runtime.host_batch import (  # noqa: E402
    build_attention_metadata,
    slots_for_positions,
)
from blockdraft.spec_decode.rejection_sampler import rejection_sample, sample_drafts  # noqa: E402

from checkpoints import make_dflash_drafter, make_qwen3_checkpoint  # noqa: E402

INTERPRETED = triton_interpreting()
if not INTERPRETED and not torch.cuda.is_available():
    pytest.skip("compiled Triton needs a CUDA device", allow_module_level=True)
DEVICE = torch.device("cpu" if INTERPRETED else "cuda")
ATOL = 2e-5 if INTERPRETED else 1e-4  # fp32 tensor-core dots on the GPU round differently


def randn(rng: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=rng).to(DEVICE)


# --- paged attention -----------------------------------------------------------------------


def paged_batch(
    rng: torch.Generator,
    starts: list[int],
    query_lens: list[int],
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    spare_blocks: int = 3,
) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor]:
    """Metadata over scattered pages (a random permutation of the pool) and random caches;
    every slot holds data, so a wrong page or a key past seq_len shows up in the output."""
    needed = [-(-(s + n) // block_size) for s, n in zip(starts, query_lens, strict=True)]
    num_blocks = sum(needed) + spare_blocks
    perm = torch.randperm(num_blocks, generator=rng).tolist()
    tables, used = [], 0
    for n in needed:
        tables.append(perm[used : used + n])
        used += n
    meta = build_attention_metadata(tables, starts, query_lens, block_size, DEVICE)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return meta, randn(rng, *shape), randn(rng, *shape)


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
    rotary = RotaryEmbedding(head_dim, 128, 10000.0, None).to(DEVICE)
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
    query rows take
    the fused kernel, others (and all with 0) run the RoPE kernel first; all equal the twin."""
    calls = []
    rope_kernel = triton_attention.triton_qk_norm_rope_store

    def counting(*a: object, **kw: object) -> object:
        calls.append(1)
        return rope_kernel(*a, **kw)

    monkeypatch.setattr(triton_attention, "triton_qk_norm_rope_store", counting)
    for query_lens, max_rows, expect_calls in (([1, 1], 1, 0), ([3, 2], 1, 1), ([1, 1], 0, 1),
                                               ([3, 2], 16, 0)):  # fmt: skip
        set_policy(rope_in_attention_max_query_len=max_rows)
        calls.clear()
        args, cached = rope_attention_case(rng, [21, 40], query_lens, 4, 2, 16, True)
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


# --- KV store ------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size,num_kv_heads,head_dim", [(4, 3, 24), (16, 2, 64), (4, 1, 16)])
def test_store_kv(rng, block_size: int, num_kv_heads: int, head_dim: int) -> None:
    num_blocks, num_tokens = 5, 11
    # The pool's last block is reserved (the torch twin sends PAD rows there).
    slots = torch.randperm((num_blocks - 1) * block_size, generator=rng)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=rng)[:3]] = PAD_SLOT_ID
    slots = slots.to(DEVICE)
    # Strided key/value, as slices of a fused qkv output.
    kv = randn(rng, num_tokens, 2 * num_kv_heads + 1, head_dim)
    key, value = kv[:, :num_kv_heads], kv[:, num_kv_heads : 2 * num_kv_heads]
    key_cache = randn(rng, num_blocks, block_size, num_kv_heads, head_dim)
    value_cache = randn(rng, num_blocks, block_size, num_kv_heads, head_dim)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    before_k, before_v = key_cache.clone(), value_cache.clone()
    store_kv(key, value, expected_k, expected_v, slots)
    triton_store_kv(key, value, key_cache, value_cache, slots)
    # Every readable slot matches; the pool's last slot is reserved for PAD rows, which the
    # torch twin writes there and the kernel skips.
    assert_same_slots(key_cache, expected_k)
    assert_same_slots(value_cache, expected_v)
    # PAD rows wrote nothing.
    assert torch.equal(key_cache.flatten(0, 1)[-1], before_k.flatten(0, 1)[-1])
    assert torch.equal(value_cache.flatten(0, 1)[-1], before_v.flatten(0, 1)[-1])


def assert_same_slots(cache: torch.Tensor, expected: torch.Tensor) -> None:
    # cache: [num_blocks, block_size, num_kv_heads, head_dim]; all slots but the last.
    assert torch.equal(cache.flatten(0, 1)[:-1], expected.flatten(0, 1)[:-1])


@pytest.mark.parametrize("num_tokens", [0, 1])
def test_store_kv_empty_and_single(rng, num_tokens: int) -> None:
    key, value = randn(rng, num_tokens, 2, 16), randn(rng, num_tokens, 2, 16)
    key_cache, value_cache = randn(rng, 3, 4, 2, 16), randn(rng, 3, 4, 2, 16)
    slots = torch.tensor([6], device=DEVICE)[:num_tokens]
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    store_kv(key, value, expected_k, expected_v, slots)
    triton_store_kv(key, value, key_cache, value_cache, slots)
    assert_same_slots(key_cache, expected_k)
    assert_same_slots(value_cache, expected_v)


# --- RMSNorm -------------------------------------------------------------------------------


@pytest.mark.parametrize("num_rows", [0, 1, 5])
@pytest.mark.parametrize("hidden", [48, 100])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(rng, num_rows: int, hidden: int, with_residual: bool) -> None:
    x = randn(rng, num_rows, hidden)
    weight = randn(rng, hidden)
    residual = randn(rng, num_rows, hidden) if with_residual else None
    expected = rms_norm_torch(x, weight, 1e-6, residual)
    out = torch.full_like(x, float("nan"))
    # The new residual may overwrite the old one in place.
    residual_out = residual.clone() if residual is not None else None
    got = triton_rms_norm(
        x,
        weight,
        1e-6,
        residual_out,
        out=out,
        residual_out=residual_out,
    )
    if with_residual:
        torch.testing.assert_close(got[0], expected[0], atol=ATOL, rtol=1e-5)
        torch.testing.assert_close(got[1], expected[1], atol=0, rtol=0)
        assert got[0].data_ptr() == out.data_ptr()
    else:
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=1e-5)


def eager_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`RMSNorm.forward` as written before the kernel existed: the numerics to keep."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rms_norm_matches_layer(rng, set_policy, dtype: torch.dtype) -> None:
    set_policy(backend="torch")
    layer = RMSNorm(40, eps=1e-5).to(DEVICE, dtype)
    layer.weight.data = randn(rng, 40).to(dtype)
    x, residual = randn(rng, 2, 3, 40).to(dtype), randn(rng, 2, 3, 40).to(dtype)
    expected = eager_rms_norm(x, layer.weight, 1e-5)
    # The torch path (CPU, or backend "torch") is bit-identical to the eager code.
    torch.testing.assert_close(rms_norm_torch(x, layer.weight, 1e-5), expected, atol=0, rtol=0)
    torch.testing.assert_close(layer(x), expected, atol=0, rtol=0)
    normed, stream = layer(x, residual)
    torch.testing.assert_close(stream, x + residual, atol=0, rtol=0)
    torch.testing.assert_close(
        normed, eager_rms_norm(x + residual, layer.weight, 1e-5), atol=0, rtol=0
    )
    tol = {} if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(triton_rms_norm(x, layer.weight, 1e-5), expected, **tol)
    set_policy(backend="triton")
    triton_layer = RMSNorm(40, eps=1e-5).to(DEVICE, dtype)
    triton_layer.weight.data = layer.weight.data
    torch.testing.assert_close(triton_layer(x), expected, **tol)
    # Training keeps the torch path: the kernel has no backward.
    with torch.enable_grad():
        x.requires_grad_(True)
        triton_layer(x).sum().backward()
    assert x.grad is not None


# --- q/k norm + RoPE, SiLU-and-multiply ----------------------------------------------------

OptTensor = torch.Tensor | None
BF16_TOL = dict(atol=3e-2, rtol=3e-2)  # a bf16 ulp or two (the interpreter truncates casts)


def tolerance(dtype: torch.dtype) -> dict:
    return dict(atol=ATOL, rtol=1e-5) if dtype == torch.float32 else BF16_TOL


def eager_rotate(rotary: RotaryEmbedding, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`RotaryEmbedding.rotate` as written before the fused kernel: the numerics to keep."""
    cos = rotary.cos_cache[positions][:, None, :]
    sin = rotary.sin_cache[positions][:, None, :]
    x32 = x.float()
    x1, x2 = x32.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def qk_case(
    rng: torch.Generator,
    num_tokens: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    with_norm: bool,
) -> tuple[RotaryEmbedding, torch.Tensor, torch.Tensor, torch.Tensor, OptTensor, OptTensor]:
    """(rotary, query, key, positions, q_norm_weight, k_norm_weight): strided q and k sliced
    from one fused qkv projection, positions over the whole table, norm weights around 1 (or
    None: Llama)."""
    rotary = RotaryEmbedding(head_dim, 50, 10000.0).to(DEVICE)
    qkv = randn(rng, num_tokens, num_heads + 2 * num_kv_heads, head_dim).to(dtype)
    query, key = qkv[:, :num_heads], qkv[:, num_heads : num_heads + num_kv_heads]
    positions = torch.randint(0, 50, (num_tokens,), generator=rng).to(DEVICE)
    weights = [(1 + 0.1 * randn(rng, head_dim)).to(dtype) if with_norm else None for _ in "qk"]
    return rotary, query, key, positions, *weights


# (head_dim, num_heads, num_kv_heads, block_h): GQA 2 and 3, MHA; head_dims 80 and 96 are no
# power of two (their halves padded to 64); block_h 2 over 3 heads leaves a partial block.
ROPE_SHAPES = [(64, 4, 2, None), (80, 3, 1, 2), (96, 2, 2, None), (128, 2, 1, None)]


@pytest.mark.parametrize("shape", ROPE_SHAPES, ids=lambda s: "d{}-h{}-kv{}-bh{}".format(*s))
@pytest.mark.parametrize("num_tokens", [0, 1, 5])
@pytest.mark.parametrize("with_norm", [False, True], ids=["rope", "norm-rope"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_qk_norm_rope(
    rng, shape: tuple, num_tokens: int, with_norm: bool, dtype: torch.dtype
) -> None:
    head_dim, num_heads, num_kv_heads, block_h = shape
    rotary, query, key, positions, q_w, k_w = qk_case(
        rng, num_tokens, num_heads, num_kv_heads, head_dim, dtype, with_norm
    )
    caches = (rotary.cos_cache, rotary.sin_cache)
    expected = qk_norm_rope_torch(query, key, positions, *caches, q_w, k_w, 1e-6)
    got = triton_qk_norm_rope(query, key, positions, *caches, q_w, k_w, 1e-6, block_h=block_h)
    for g, e in zip(got, expected, strict=True):
        assert g.shape == e.shape and g.dtype == e.dtype
        torch.testing.assert_close(g, e, **tolerance(dtype))
    # Keys alone (the drafter's context K): the same keys, no query.
    q_none, k_only = triton_qk_norm_rope(None, key, positions, *caches, None, k_w, 1e-6)
    assert q_none is None
    torch.testing.assert_close(k_only, expected[1], **tolerance(dtype))


# (head_dim, num_heads, num_kv_heads, block_h): GQA 3 over a partial head block, GQA 2 with
# several key-head programs per token, MHA; head_dims 80 and 96 are no power of two.
ROPE_STORE_SHAPES = [(80, 3, 1, 2), (96, 4, 2, 1), (16, 2, 2, None)]


@pytest.mark.parametrize("shape", ROPE_STORE_SHAPES, ids=lambda s: "d{}-h{}-kv{}-bh{}".format(*s))
@pytest.mark.parametrize("num_tokens", [0, 1, 6])
@pytest.mark.parametrize("with_norm", [False, True], ids=["rope", "norm-rope"])
@pytest.mark.parametrize(
    "dtype,cache_dtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float32),  # a cache dtype other than the activations'
    ],
    ids=["fp32", "bf16", "fp16-fp32cache"],
)
def test_qk_norm_rope_store(
    rng,
    shape: tuple,
    num_tokens: int,
    with_norm: bool,
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
) -> None:
    """The fused norm + RoPE + KV store against its twin (rotation, then `store_kv`): the same
    returned heads, and every slot a sequence can read the same in both caches."""
    head_dim, num_heads, num_kv_heads, block_h = shape
    block_size, num_blocks = 4, 4
    rotary, query, key, positions, q_w, k_w = qk_case(
        rng, num_tokens, num_heads, num_kv_heads, head_dim, dtype, with_norm
    )
    # The values: the third slice of the fused projection q and k come from (strided rows).
    value = key.as_strided(key.shape, key.stride(), num_kv_heads * head_dim + key.storage_offset())
    caches = (rotary.cos_cache, rotary.sin_cache)
    # Distinct slots, the pool's last block reserved (the twin sends PAD rows there), and a
    # third of the rows PAD.
    slots = torch.randperm((num_blocks - 1) * block_size, generator=rng)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=rng)[: num_tokens // 3]] = PAD_SLOT_ID
    slots = slots.to(DEVICE)
    shape_c = (num_blocks, block_size, num_kv_heads, head_dim)
    # NaN everywhere: a slot the kernel misses, or a PAD row it writes, shows up.
    key_cache = torch.full(shape_c, float("nan"), dtype=cache_dtype, device=DEVICE)
    value_cache = torch.full_like(key_cache, float("nan"))
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    expected = qk_norm_rope_store_torch(
        query, key, value, positions, *caches, q_w, k_w, 1e-6, expected_k, expected_v, slots
    )
    store = (key_cache, value_cache, slots)
    got = triton_qk_norm_rope_store(
        query, key, value, positions, *caches, q_w, k_w, 1e-6, *store, block_h=block_h
    )
    for g, e in zip(got, expected, strict=True):
        assert g.shape == e.shape and g.dtype == e.dtype
        torch.testing.assert_close(g, e, **tolerance(dtype))
    written = slots[slots >= 0]
    for cache, twin in [(key_cache, expected_k), (value_cache, expected_v)]:
        flat, flat_twin = cache.flatten(0, 1), twin.flatten(0, 1)
        # The values are copied as they are (a cast at most); the keys within a rounding.
        tol = tolerance(dtype) if cache is key_cache else dict(atol=0, rtol=0)
        torch.testing.assert_close(flat[written], flat_twin[written], **tol)
        unwritten = torch.ones(flat.shape[0], dtype=torch.bool, device=DEVICE)
        unwritten[written] = False
        assert flat[unwritten].isnan().all()  # PAD rows (and the reserved last slot) untouched
    # The cache holds exactly the returned keys.
    rows = slots >= 0
    assert torch.equal(key_cache.flatten(0, 1)[written], got[1][rows].to(cache_dtype))
    # Keys alone (the drafter's context K/V): the same keys and slots, no query.
    key_cache.fill_(float("nan"))
    value_cache.fill_(float("nan"))
    q_none, k_only = triton_qk_norm_rope_store(
        None, key, value, positions, *caches, None, k_w, 1e-6, *store
    )
    assert q_none is None
    torch.testing.assert_close(k_only, expected[1], **tolerance(dtype))
    torch.testing.assert_close(
        key_cache.flatten(0, 1)[written], expected_k.flatten(0, 1)[written], **tolerance(dtype)
    )
    assert torch.equal(value_cache.flatten(0, 1)[written], expected_v.flatten(0, 1)[written])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_qk_norm_rope_matches_layers(rng, set_policy, dtype: torch.dtype) -> None:
    """The twin is bit-identical to the norm modules + the old rotate; the Triton path of the
    layer is close, and training (grad) falls back to the twin."""
    set_policy(backend="torch")
    rotary, query, key, positions, q_w, k_w = qk_case(rng, 6, 4, 2, 48, dtype, True)
    q_norm, k_norm = RMSNorm(48, eps=1e-5).to(DEVICE, dtype), RMSNorm(48, eps=1e-5)
    k_norm = k_norm.to(DEVICE, dtype)
    q_norm.weight.data, k_norm.weight.data = q_w, k_w
    expected = (
        eager_rotate(rotary, positions, q_norm(query)),
        eager_rotate(rotary, positions, k_norm(key)),
    )
    got = rotary(positions, query, key, q_w, k_w, 1e-5)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, atol=0, rtol=0)
    assert torch.equal(rotary(positions, query, key)[0], eager_rotate(rotary, positions, query))
    assert torch.equal(rotary.rotate(positions, key), eager_rotate(rotary, positions, key))
    # float32 norm weights over bf16 heads (autocast training) give float32 heads, as before.
    _, mixed = qk_norm_rope_torch(
        None, key, positions, rotary.cos_cache, rotary.sin_cache, None, k_w.float(), 1e-5
    )
    assert mixed.dtype == torch.float32
    set_policy(backend="triton")
    triton_rotary = RotaryEmbedding(48, 50, 10000.0).to(DEVICE)
    got = triton_rotary(positions, query, key, q_w, k_w, 1e-5)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, **tolerance(dtype))
    with torch.enable_grad():
        q_w.requires_grad_(True)
        triton_rotary(positions, query, key, q_w, k_w, 1e-5)[0].float().sum().backward()
    assert q_w.grad is not None


@pytest.mark.parametrize("num_rows", [0, 1, 5])
@pytest.mark.parametrize("cols", [80, 1300])  # 1300: two column blocks, the last partial
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_silu_mul(rng, num_rows: int, cols: int, dtype: torch.dtype) -> None:
    # Strided halves, as of a fused gate_up projection.
    gate_up = (2 * randn(rng, num_rows, 2 * cols)).to(dtype)
    gate, up = gate_up[:, :cols], gate_up[:, cols:]
    expected = silu_mul_torch(gate, up)
    # The twin is the eager MLP's expression, bit for bit.
    assert torch.equal(expected, torch.nn.functional.silu(gate) * up)
    got = triton_silu_mul(gate, up)
    assert got.shape == expected.shape and got.dtype == expected.dtype
    torch.testing.assert_close(got, expected, **tolerance(dtype))


def test_mlp_backends(rng, set_policy) -> None:
    set_policy(backend="triton")
    with torch.device(DEVICE):
        mlp = MLP(24, 40)
    x = randn(rng, 3, 24)
    expected = mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    with torch.no_grad():
        torch.testing.assert_close(mlp(x), expected, atol=ATOL, rtol=1e-5)
    # Training keeps the torch path: the kernel has no backward.
    mlp(x).sum().backward()
    assert mlp.gate_proj.weight.grad is not None


# --- decoder layers: residual adds fused into the norms ------------------------------------


def layer_stack(
    rng: torch.Generator, dtype: torch.dtype, num_layers: int = 2
) -> tuple[nn.ModuleList, RMSNorm]:
    """Qwen3-shaped layers (q/k norms, GQA 2) and a final norm with random weights."""
    cfg = TransformerConfig(
        architecture="qwen3",
        vocab_size=64,
        hidden_size=48,
        intermediate_size=80,
        num_layers=num_layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attention_bias=False,
        qk_norm=True,
    )
    with torch.device(DEVICE):  # the rotary tables too: the compiled kernels read them
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, None)
        layers = nn.ModuleList(DecoderLayer(cfg, rotary) for _ in range(num_layers))
        final = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    for name, p in [*layers.named_parameters(), *final.named_parameters(prefix="final")]:
        # Norm weights around 1, projections at about 1/sqrt(fan_in): activations stay O(1).
        init = 1 + 0.1 * randn(rng, *p.shape) if "norm" in name else 0.2 * randn(rng, *p.shape)
        p.data = init
    return layers.to(dtype).requires_grad_(False), final.to(dtype).requires_grad_(False)


def unfused_stack(
    layers: nn.ModuleList,
    final: RMSNorm,
    x: torch.Tensor,  # [num_tokens, hidden]
    positions: torch.Tensor,  # [num_tokens] int64
) -> torch.Tensor:  # [num_tokens, hidden]
    """The pre-norm blocks as written before the fusion: eager adds, then a torch norm."""

    def norm(module: RMSNorm, h: torch.Tensor) -> torch.Tensor:
        return eager_rms_norm(h, module.weight, module.eps)

    for layer in layers:
        x = x + layer.self_attn(norm(layer.input_layernorm, x), positions)
        x = x + layer.mlp(norm(layer.post_attention_layernorm, x))
    return norm(final, x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_decoder_layers_fused_residual_norm(
    rng, monkeypatch, set_policy, backend: str, dtype: torch.dtype
) -> None:
    # Only the norms change backend: attention stays on the torch twin, as the interpreter's
    # bf16 dots are not faithful (the engine test below covers the kernels together, in fp32).
    set_policy(backend="torch")
    if backend == "triton":
        monkeypatch.setattr("blockdraft.layers.norm.get_rms_norm_backend", lambda d: counting)
    fused_calls = []

    def counting(*args: object, **kwargs: object) -> object:
        fused_calls.append(len(args) > 3 and args[3] is not None)
        return triton_rms_norm(*args, **kwargs)

    layers, final = layer_stack(rng, dtype)
    # A prefill chunk, a decode row and a verify block over scattered pages.
    starts, query_lens = [5, 9, 3], [6, 1, 4]
    meta, key_cache, _ = paged_batch(rng, starts, query_lens, 4, 2, 16)
    for layer in layers:
        attn = layer.self_attn.attn
        attn.key_cache = randn(rng, *key_cache.shape).to(dtype)
        attn.value_cache = randn(rng, *key_cache.shape).to(dtype)
    positions = torch.cat(
        [torch.arange(s, s + n) for s, n in zip(starts, query_lens, strict=True)]
    ).to(DEVICE)
    x = randn(rng, sum(query_lens), 48).to(dtype)
    with torch.inference_mode(), forward_context(meta):
        expected = unfused_stack(layers, final, x, positions)
        h, residual = x, None
        for layer in layers:
            h, residual = layer(h, positions, residual)
        got = final_norm(final, h, residual)
    if backend == "torch":  # today's numerics, bit for bit
        torch.testing.assert_close(got, expected, atol=0, rtol=0)
        return
    # Every norm but the first input norm (no residual yet) fused an add; the q/k norms run
    # inside the RoPE kernel's torch twin here (only the RMSNorm modules switch backend).
    assert fused_calls.count(True) == 2 * len(layers)
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=1e-4)
    else:
        # bf16: another rounding of rstd (and, in the interpreter, truncating casts to bf16)
        # moves values by a bf16 ulp, which the following layers carry on.
        torch.testing.assert_close(got, expected, atol=3e-2, rtol=3e-2)


def test_decoder_fuses_kv_store_into_rope(rng, monkeypatch, set_policy) -> None:
    """With fuse_kv_store_into_rope, Qwen3 layers on the Triton path (fused q/k/v: strided
    heads) store their keys and values from the RoPE kernel and attend without the store
    kernel, and the drafter's context rows (`write_kv`) likewise: the same outputs and caches,
    bit for bit, as the separate store."""
    set_policy(backend="triton")
    calls = {"store": 0, "rope+store": 0}

    def counting_store(*args: object) -> None:
        calls["store"] += 1
        triton_store_kv(*args)

    def counting_rope_store(*args: object, **kwargs: object) -> object:
        calls["rope+store"] += 1
        return triton_qk_norm_rope_store(*args, **kwargs)

    monkeypatch.setattr("blockdraft.kernels.triton_kv_store.triton_store_kv", counting_store)
    for module in (triton_rope, triton_attention):  # the drafter's context path, the layers'
        monkeypatch.setattr(module, "triton_qk_norm_rope_store", counting_rope_store)
    layers, final = layer_stack(rng, torch.float32)
    fuse_projections(layers)
    # A prefill chunk, a decode row and a verify block over scattered pages.
    starts, query_lens = [5, 9, 3], [3, 1, 4]
    meta, key_cache, _ = paged_batch(rng, starts, query_lens, 4, 2, 16)
    caches = [(randn(rng, *key_cache.shape), randn(rng, *key_cache.shape)) for _ in layers]
    positions = torch.cat(
        [torch.arange(s, s + n) for s, n in zip(starts, query_lens, strict=True)]
    ).to(DEVICE)
    x = randn(rng, sum(query_lens), 48)
    # Context rows as the drafter writes them, one PAD among them, into slots the block
    # forward does not touch (the pool's spare blocks but the last).
    ctx_slots = torch.tensor([0, PAD_SLOT_ID, 2, 5], device=DEVICE)
    ctx_slots[ctx_slots >= 0] += (key_cache.shape[0] - 3) * 4
    ctx_positions = torch.tensor([7, 0, 8, 9], device=DEVICE)
    ctx = randn(rng, 4, 48)

    def run(fuse: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        set_policy(backend="triton", fuse_kv_store_into_rope=fuse)
        for layer, (k, v) in zip(layers, caches, strict=True):
            layer.self_attn.attn.key_cache, layer.self_attn.attn.value_cache = k.clone(), v.clone()
        with torch.inference_mode(), forward_context(meta):
            h, residual = x, None
            for layer in layers:
                layer.self_attn.write_kv(ctx, ctx_positions, ctx_slots, counting_store)
                h, residual = layer(h, positions, residual)
            out = final_norm(final, h, residual)
        attns = [layer.self_attn.attn for layer in layers]
        return out, [c for a in attns for c in (a.key_cache, a.value_cache)]

    expected, expected_caches = run(False)
    assert calls == {"store": 2 * len(layers), "rope+store": 0}
    calls.update(store=0)
    got, got_caches = run(True)
    assert calls == {"store": 0, "rope+store": 2 * len(layers)}
    assert torch.equal(got, expected)
    for g, e in zip(got_caches, expected_caches, strict=True):
        # All but the pool's reserved last slot, where the torch store sends PAD rows.
        assert_same_slots(g, e)


# --- DFlash drafter inputs -----------------------------------------------------------------


def dflash_case(
    rng: torch.Generator,
    num_reqs: int,
    num_spec: int,
    block_size: int,
    drafts: torch.Tensor | None = None,  # [num_reqs] bool: which requests draft; random if None
) -> tuple[dict, list[list[int]]]:
    """Requests laid out as a verify/prefill batch: each has its committed rows followed by
    a few rejected ones. A random subset drafts (their block tables cover the block [anchor,
    MASK x N]); the others are mid-prefill chunks whose tables end at their last committed
    row, so a query block for them would fall past their table."""
    num_ctx = torch.randint(0, 6, (num_reqs,), generator=rng)
    num_ctx[:1] = 1  # a decode-like request with one committed row
    rejected = torch.randint(0, 3, (num_reqs,), generator=rng)
    rows = num_ctx + rejected
    starts = torch.cumsum(rows, 0) - rows
    anchor_positions = num_ctx + torch.randint(0, 20, (num_reqs,), generator=rng)
    if drafts is None:
        drafts = torch.rand(num_reqs, generator=rng) < 0.7
    tables = [
        torch.randperm(200, generator=rng)[
            : (int(p) + num_spec) // block_size + 1 if d else max(-(-int(p) // block_size), 1)
        ].tolist()
        for p, d in zip(anchor_positions, drafts, strict=True)
    ]
    args = dict(
        anchor_tokens=torch.randint(0, 50, (num_reqs,), generator=rng).to(DEVICE),
        anchor_positions=anchor_positions.to(DEVICE),
        ctx_row_start=starts.to(DEVICE),
        num_ctx=num_ctx.to(DEVICE),
        proposers=torch.nonzero(drafts).flatten().to(DEVICE),
        block_size=block_size,
        num_spec=num_spec,
        mask_token_id=99,
    )
    return args, tables


def padded_tables(tables: list[list[int]], num_rows: int) -> torch.Tensor:
    width = max([len(t) for t in tables] + [1])
    rows = [t + [0] * (width - len(t)) for t in tables] + [[0] * width] * (num_rows - len(tables))
    return torch.tensor(rows, dtype=torch.int64, device=DEVICE).view(-1, width)


def poisoned(num_reqs_padded: int, num_spec: int, num_ctx_rows: int) -> DFlashInputs:
    out = DFlashInputs.empty(num_reqs_padded, num_spec, num_ctx_rows, DEVICE)
    for f in dataclasses.fields(out):
        getattr(out, f.name).fill_(-7777)
    return out


@pytest.mark.parametrize(
    "num_reqs,num_reqs_padded,num_spec,block_size",
    [(3, 5, 4, 4), (1, 1, 1, 16), (0, 2, 3, 4), (21, 32, 7, 4), (40, 24, 3, 4)],
)
def test_prepare_dflash_inputs(
    rng, num_reqs: int, num_reqs_padded: int, num_spec: int, block_size: int
) -> None:
    args, tables = dflash_case(rng, num_reqs, num_spec, block_size)
    args["proposers"] = args["proposers"][:num_reqs_padded]
    num_ctx_rows = int((args["ctx_row_start"][-1:] + args["num_ctx"][-1:]).sum()) + 300
    block_tables = padded_tables(tables, num_reqs)
    sizes = dict(num_reqs_padded=num_reqs_padded, num_ctx_rows=num_ctx_rows)
    expected = prepare_dflash_inputs_torch(**args, block_tables=block_tables, **sizes)
    got = prepare_dflash_inputs(
        **args,
        block_tables=block_tables,
        **sizes,
        out=poisoned(num_reqs_padded, num_spec, num_ctx_rows),
    )
    for f in dataclasses.fields(expected):
        assert torch.equal(getattr(got, f.name), getattr(expected, f.name)), f.name


def test_prepare_dflash_inputs_spec(rng) -> None:
    """The twin agrees with a host-side construction from lists (the engine's metadata for
    the drafter's blocks, and slots of the committed rows), pads with inert rows, and gives
    requests that do not draft no query block."""
    num_reqs, num_reqs_padded, n, block_size = 6, 8, 3, 4
    q = n + 1
    drafts = torch.tensor([True, False, True, True, False, True])
    args, tables = dflash_case(rng, num_reqs, n, block_size, drafts)
    num_ctx_rows = 40
    got = prepare_dflash_inputs_torch(
        **args,
        block_tables=padded_tables(tables, num_reqs),
        num_reqs_padded=num_reqs_padded,
        num_ctx_rows=num_ctx_rows,
    )
    props = args["proposers"].tolist()
    num_props = len(props)
    anchors = [args["anchor_tokens"].tolist()[c] for c in props]
    positions = [args["anchor_positions"].tolist()[c] for c in props]
    prop_tables = [tables[c] for c in props]
    meta = build_attention_metadata(prop_tables, positions, [q] * num_props, block_size, DEVICE)
    real = num_props * q
    assert got.input_ids[:real].tolist() == [t for a in anchors for t in [a] + [99] * n]
    assert got.positions[:real].tolist() == [p + i for p in positions for i in range(q)]
    assert torch.equal(got.slot_mapping[:real], meta.slot_mapping)
    assert torch.equal(got.query_start_loc[: num_props + 1], meta.query_start_loc)
    assert torch.equal(got.seq_lens[:num_props], meta.seq_lens)
    # Padded requests: inert dummy blocks.
    assert got.input_ids[real:].eq(99).all()
    assert got.slot_mapping[real:].eq(PAD_SLOT_ID).all()
    assert got.seq_lens[num_props:].eq(q).all()
    assert got.query_start_loc.tolist() == [r * q for r in range(num_reqs_padded + 1)]
    # Context, of every request: committed rows get the positions right before their anchor
    # and those slots.
    expected_pos = [0] * num_ctx_rows
    expected_slot = [PAD_SLOT_ID] * num_ctx_rows
    all_positions = args["anchor_positions"].tolist()
    for r in range(num_reqs):
        start, count = int(args["ctx_row_start"][r]), int(args["num_ctx"][r])
        ctx = range(all_positions[r] - count, all_positions[r])
        expected_pos[start : start + count] = list(ctx)
        expected_slot[start : start + count] = slots_for_positions(tables[r], ctx, block_size)
    assert got.context_positions.tolist() == expected_pos
    assert got.context_slot_mapping.tolist() == expected_slot


# --- sampler: hashed uniforms, exponential race -------------------------------------------

MAX_SEED = 2**63 - 1


def seeds_and_positions(rng: torch.Generator, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[num_rows] int64 seeds in [0, 2**63) and positions, the extremes first."""
    seed = torch.randint(0, MAX_SEED, (num_rows,), generator=rng)
    pos = torch.randint(0, 1 << 62, (num_rows,), generator=rng)
    special_seeds = [0, MAX_SEED, 2**32, 2**32 - 1, 2**31]
    special_pos = [0, 2**62 + 12345, 1, 2**32, 5]
    k = min(num_rows, len(special_seeds))
    seed[:k] = torch.tensor(special_seeds[:k])
    pos[:k] = torch.tensor(special_pos[:k])
    return seed.to(DEVICE), pos.to(DEVICE)


@pytest.mark.parametrize("num_rows", [0, 1, 5])
@pytest.mark.parametrize("width", [None, 0, 1, 7, 1000, 5000])
def test_hashed_uniform_bit_exact(rng, num_rows: int, width: int | None) -> None:
    seed, pos = seeds_and_positions(rng, num_rows)
    salts = [0, 1, 0x0ACCE9, 2**40 + 0x5E5A3, 2**64 - 1]
    salts.append(int(torch.randint(0, 2**62, (), generator=rng)) * 3)  # a fresh 64-bit salt
    for salt in salts:
        expected = hashed_uniform(seed, pos, salt, width)
        got = triton_hashed_uniform(seed, pos, salt, width)
        assert got.shape == expected.shape and got.dtype == torch.float32
        assert torch.equal(got, expected), f"salt={salt}"
    # int32 inputs are widened as by the torch code
    small = seed.to(torch.int32), pos.to(torch.int32)
    assert torch.equal(triton_hashed_uniform(*small, 3, width), hashed_uniform(*small, 3, width))


def check_race(
    probs: torch.Tensor, seed: torch.Tensor, pos: torch.Tensor, salt: int
) -> tuple[int, int]:
    """Asserts the kernel's winners against the torch race; returns (rows, exact rows)."""
    expected = exponential_race_torch(probs, seed, pos, salt)
    got = triton_exponential_race(probs, seed, pos, salt)
    assert got.shape == expected.shape and got.dtype == torch.int64
    if probs.shape[0] == 0:
        return 0, 0
    # The kernel's log may differ from torch's by an ulp: a different winner is only allowed
    # when its torch score ties the best one within that.
    u = hashed_uniform(seed, pos, salt, probs.shape[-1])
    scores = probs / -torch.log(u)
    best = scores.gather(1, expected[:, None]).squeeze(1)
    mine = scores.gather(1, got[:, None]).squeeze(1)
    torch.testing.assert_close(mine, best, rtol=1e-6, atol=0)
    return probs.shape[0], int((got == expected).sum())


@pytest.mark.parametrize("num_rows", [0, 1, 6])
@pytest.mark.parametrize("vocab", [1, 7, 2048, 5000])  # 5000: three blocks, the last partial
def test_exponential_race(rng, num_rows: int, vocab: int) -> None:
    seed, pos = seeds_and_positions(rng, num_rows)
    probs = torch.rand(num_rows, vocab, generator=rng) ** 4
    probs[torch.rand(num_rows, vocab, generator=rng) < 0.3] = 0.0  # zero entries
    if num_rows > 2:
        probs[1] = 0.0
        probs[1, vocab // 2] = 1.0  # one-hot: always that token
        probs[2] = 0.0  # all zero: every score 0, argmax picks index 0
    probs = probs.to(DEVICE)
    rows = exact = 0
    for salt in (0, 2**40 + 7):
        got_rows, got_exact = check_race(probs, seed, pos, salt)
        rows, exact = rows + got_rows, exact + got_exact
        if num_rows > 2:
            winners = triton_exponential_race(probs, seed, pos, salt)
            assert winners[1] == vocab // 2 and winners[2] == 0
    assert exact == rows  # an ulp-tie between the two best scores is this unlikely
    # Strided rows (a slice), half precision, and ties between equal scores (lowest index).
    wide = torch.rand(num_rows, vocab + 3, generator=rng).to(DEVICE)
    check_race(wide[:, 3:], seed, pos, 5)
    check_race(wide[:, 3:].to(torch.bfloat16), seed, pos, 5)
    tied = torch.zeros(num_rows, vocab, device=DEVICE)
    got = triton_exponential_race(tied, seed, pos, 5)
    assert torch.equal(got, torch.zeros(num_rows, dtype=torch.int64, device=DEVICE))


def test_exponential_race_nan_wins_like_torch(rng) -> None:
    seed, pos = seeds_and_positions(rng, 3)
    probs = torch.rand(3, 3000, generator=rng).to(DEVICE)
    probs[0, 2500] = float("nan")
    probs[0, 2600] = float("nan")
    probs[1, 10] = float("inf")
    probs[2, 2999] = float("nan")
    probs[2, 5] = float("inf")
    expected = exponential_race_torch(probs, seed, pos, 9)
    assert expected.tolist() == [2500, 10, 2999]
    assert torch.equal(triton_exponential_race(probs, seed, pos, 9), expected)


def test_sampling_same_with_triton_backend(rng, monkeypatch, set_policy) -> None:
    """sample() and the rejection sampler with the Triton hash/race against the torch ones."""
    num_rows, n, vocab = 4, 3, 300
    seed, pos = seeds_and_positions(rng, num_rows)
    st = SamplingTensors.from_lists(
        temperature=[1.0, 1.0, 0.7, 0.0],
        top_k=[0, 20, 0, 0],
        top_p=[1.0, 1.0, 0.9, 1.0],
        min_p=[0.0, 0.0, 0.0, 0.05],
        seed=seed.tolist(),
        position=pos.tolist(),
        device=DEVICE,
    )
    logits = randn(rng, num_rows, vocab)
    draft_logits = randn(rng, num_rows, n, vocab)
    # Targets close to the drafts, so some drafts get accepted and some rejected.
    target_logits = torch.cat([draft_logits, randn(rng, num_rows, 1, vocab)], dim=1)
    target_logits = target_logits + 0.5 * randn(rng, num_rows, n + 1, vocab)

    def run(backend: str) -> list[torch.Tensor]:
        set_policy(backend=backend)
        drafts, q = sample_drafts(draft_logits, st)
        out, accepted = rejection_sample(target_logits, drafts, q, st)
        one_hot_out, one_hot_accepted = rejection_sample(target_logits, drafts, None, st)
        return [sample(logits, st, salt=3), drafts, out, accepted, one_hot_out, one_hot_accepted]

    expected = run("torch")
    calls = {"hash": 0, "race": 0}

    def counting_hash(*args: object, **kwargs: object) -> torch.Tensor:
        calls["hash"] += 1
        return triton_hashed_uniform(*args, **kwargs)

    def counting_race(*args: object, **kwargs: object) -> torch.Tensor:
        calls["race"] += 1
        return triton_exponential_race(*args, **kwargs)

    monkeypatch.setattr("blockdraft.kernels.triton_sampling.triton_hashed_uniform", counting_hash)
    monkeypatch.setattr("blockdraft.kernels.triton_sampling.triton_exponential_race", counting_race)
    got = run("triton")
    assert calls == {"hash": 2, "race": 4}
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g, e)


# --- backend selection ---------------------------------------------------------------------


def test_backend_selection(monkeypatch, set_policy) -> None:
    set_policy(backend="torch")
    assert select.get_attention_backend(DEVICE) is paged_attention
    assert select.get_store_kv_backend(DEVICE) is store_kv
    assert select.get_rms_norm_backend(DEVICE) is rms_norm_torch
    assert select.get_rope_backend(DEVICE) is qk_norm_rope_torch
    assert select.get_rope_store_backend(DEVICE) is qk_norm_rope_store_torch
    assert select.get_silu_mul_backend(DEVICE) is silu_mul_torch
    assert select.get_dflash_inputs_backend(DEVICE) is prepare_dflash_inputs_torch
    assert select.get_hashed_uniform_backend(DEVICE) is hashed_uniform
    assert select.get_exponential_race_backend(DEVICE) is exponential_race_torch
    set_policy(backend="triton")
    assert select.get_attention_backend(DEVICE) is triton_paged_attention
    assert select.get_store_kv_backend(DEVICE) is triton_store_kv
    assert select.get_rms_norm_backend(DEVICE) is triton_rms_norm
    assert select.get_rope_backend(DEVICE) is triton_qk_norm_rope
    assert select.get_rope_store_backend(DEVICE) is triton_qk_norm_rope_store
    assert select.get_silu_mul_backend(DEVICE) is triton_silu_mul
    assert select.get_dflash_inputs_backend(DEVICE) is prepare_dflash_inputs
    assert select.get_hashed_uniform_backend(DEVICE) is triton_hashed_uniform
    assert select.get_exponential_race_backend(DEVICE) is triton_exponential_race
    set_policy(backend="auto")
    expected = triton_paged_attention if DEVICE.type == "cuda" else paged_attention
    assert select.get_attention_backend(DEVICE) is expected
    with pytest.raises(ValueError, match="backend"):
        set_policy(backend="flash")
    set_policy(backend="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        select.get_attention_backend("cpu")


# --- engine --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("kernels-engine")
    target = make_qwen3_checkpoint(root / "target", num_layers=2)
    # One sliding causal layer, one non-causal layer: both drafter attention modes.
    drafter = make_dflash_drafter(
        root / "drafter",
        target,
        target_layer_ids=[0, 1],
        sliding_window=6,
        layer_types=["sliding_attention", "full_attention"],
    )
    return target, drafter


@pytest.mark.parametrize(
    ("speculative", "rope_rows"),
    [(False, None), (True, None), (True, 16)],
    ids=["plain", "dflash", "dflash-rope-in-block-attention"],
)
def test_engine_greedy_same_with_triton_kernels(
    tiny_pair, rng, monkeypatch, speculative: bool, rope_rows: int | None
) -> None:
    """Greedy outputs with every Triton kernel equal the torch path's; with rope_rows, verify
    and drafter blocks also norm, rotate and store their step in the attention kernel."""
    target, drafter = tiny_pair
    prompts = [torch.randint(4, 128, (n,), generator=rng).tolist() for n in (3, 13)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    # A small pool: the interpreter copies every tensor argument on each launch. Chunked
    # prefill puts prefill chunks and decode/verify rows in the same batch.
    engine_args: dict = dict(
        block_size=4,
        num_kv_blocks=24,
        max_model_len=48,
        max_num_batched_tokens=8,
        device=str(DEVICE),
    )
    if speculative:
        engine_args["speculative_config"] = {
            "method": "dflash",
            "model": str(drafter),
            "num_speculative_tokens": 3,
        }

    def generate(policy: KernelPolicy) -> list[list[int]]:
        llm = LLM(str(target), dtype="float32", kernel_policy=policy, **engine_args)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    expected = generate(KernelPolicy(backend="torch"))
    calls: dict[str, int] = {"attention": 0, "norm": 0, "fused norm": 0, "rope": 0, "silu": 0}
    triton_policy = KernelPolicy(backend="triton")
    if rope_rows is not None:
        triton_policy = dataclasses.replace(
            triton_policy, rope_in_attention_max_query_len=rope_rows
        )
        del calls["rope"]  # every launch here (chunks of <= 8 rows) fits the attention kernel
    if not speculative or rope_rows is not None:  # (DFlash steps verify: no decode forward)
        # Decode forwards (and blocks, with rope_rows) norm, rotate and store the step's
        # q/k/v in the attention kernel.
        calls["rope in attention"] = 0
    if speculative:
        calls["rope keys only"] = 0  # the drafter's context K (project_kv)
        calls["dflash inputs"] = 0  # the drafter's inputs, built from the step's results

        def counting_dflash_inputs(*args: object, **kwargs: object) -> DFlashInputs:
            calls["dflash inputs"] += 1
            return prepare_dflash_inputs(*args, **kwargs)

        monkeypatch.setattr(
            "blockdraft.kernels.triton_dflash_inputs.prepare_dflash_inputs",
            counting_dflash_inputs,
        )

    def counting_attention(*args: object, **kwargs: object) -> torch.Tensor:
        calls["attention"] += 1
        if kwargs.get("step_kv") is not None:  # (on CUDA the warm-up also runs decodes)
            calls["rope in attention"] = calls.get("rope in attention", 0) + 1
        return triton_paged_attention(*args, **kwargs)

    def counting_norm(*args: object, **kwargs: object) -> object:
        fused = len(args) > 3 and args[3] is not None
        calls["fused norm" if fused else "norm"] += 1
        return triton_rms_norm(*args, **kwargs)

    monkeypatch.setattr(
        "blockdraft.kernels.triton_attention.triton_paged_attention", counting_attention
    )

    def counting_rope(*args: object, **kwargs: object) -> object:
        name = "rope" if args[0] is not None else "rope keys only"
        calls[name] = calls.get(name, 0) + 1  # (on CUDA the warm-up also runs long prefills)
        return triton_qk_norm_rope(*args, **kwargs)

    def counting_rope_store(*args: object, **kwargs: object) -> object:
        # fuse_kv_store_into_rope: the same norm + RoPE, storing K/V as it goes
        name = "rope" if args[0] is not None else "rope keys only"
        calls[name] = calls.get(name, 0) + 1
        return triton_qk_norm_rope_store(*args, **kwargs)

    def counting_silu_mul(*args: object, **kwargs: object) -> torch.Tensor:
        calls["silu"] += 1
        return triton_silu_mul(*args, **kwargs)

    monkeypatch.setattr("blockdraft.kernels.triton_rmsnorm.triton_rms_norm", counting_norm)
    monkeypatch.setattr("blockdraft.kernels.triton_rope.triton_qk_norm_rope", counting_rope)
    for module in (triton_rope, triton_attention):  # the drafter's context path, the layers'
        monkeypatch.setattr(module, "triton_qk_norm_rope_store", counting_rope_store)
    monkeypatch.setattr("blockdraft.kernels.triton_activation.triton_silu_mul", counting_silu_mul)
    got = generate(triton_policy)
    # Plain norms (the first input norm), residual-fused ones, the q/k norms fused with RoPE,
    # the MLP activations (and the drafter's inputs) all ran in Triton.
    assert all(calls.values()), f"the engine skipped a Triton backend: {calls}"
    assert got == expected
