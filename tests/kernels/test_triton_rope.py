"""`blockdraft.kernels.triton_rope`: the fused q/k norm + RoPE (and + KV store) against their
torch twins, also with Qwen3.5's offset norms and partial rotary; those twins against the eager
composition the gated attention layer ran (`OffsetRMSNorm`, then `RotaryEmbedding.rotate`).

Runs on the CPU through Triton's interpreter (TRITON_INTERPRET=1, which tests/conftest.py sets
on a machine without a GPU). With TRITON_INTERPRET=0 on a CUDA machine the same tests run the
compiled kernels on the GPU. Shapes stay small: the interpreter costs about half a millisecond
per program.
"""

import pytest
import torch

from blockdraft.kernels.forward_context import PAD_SLOT_ID
from blockdraft.kernels.rope import (
    qk_norm_rope_store_torch,
    qk_norm_rope_torch,
)
from blockdraft.kernels.triton_rope import triton_qk_norm_rope, triton_qk_norm_rope_store
from blockdraft.layers.norm import OffsetRMSNorm, RMSNorm
from blockdraft.layers.rotary import RotaryEmbedding

from kernel_inputs import (
    DEVICE,
    eager_rotate,
    needs_triton,
    qk_case,
    randn,
    tolerance,
)

pytestmark = needs_triton


# (head_dim, num_heads, num_kv_heads, block_h): GQA 2 and 3, MHA; head_dims 80 and 96 are no
# power of two (their halves padded to 64); block_h 2 over 3 heads leaves a partial block.
ROPE_SHAPES = [(64, 4, 2, None), (80, 3, 1, 2), (96, 2, 2, None), (128, 2, 1, None)]


def slots_and_caches(
    rng: torch.Generator, num_tokens: int, cache_shape: tuple[int, int, int, int], dtype
) -> tuple[torch.Tensor, ...]:
    """Slot mapping (distinct slots, the pool's last block reserved for the twin's PAD rows, a
    third of the rows PAD), NaN key and value caches (a slot the kernel misses, or a PAD row it
    writes, shows up) and a copy of each for the twin."""
    num_blocks, block_size = cache_shape[:2]
    slots = torch.randperm((num_blocks - 1) * block_size, generator=rng)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=rng)[: num_tokens // 3]] = PAD_SLOT_ID
    key_cache = torch.full(cache_shape, float("nan"), dtype=dtype, device=DEVICE)
    value_cache = torch.full_like(key_cache, float("nan"))
    return slots.to(DEVICE), key_cache, value_cache, key_cache.clone(), value_cache.clone()


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
    slots, key_cache, value_cache, expected_k, expected_v = slots_and_caches(
        rng, num_tokens, (num_blocks, block_size, num_kv_heads, head_dim), cache_dtype
    )
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


# --- Qwen3.5's full attention: offset norm weights, partial rotary ----------------------------

OptTensor = torch.Tensor | None
NORMS = ["none", "plain", "offset"]


def gated_case(
    rng: torch.Generator,
    num_tokens: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    rotary_dim: int,
    dtype: torch.dtype,
    norm: str,  # one of NORMS
) -> tuple[RotaryEmbedding, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, OptTensor,
           OptTensor]:  # fmt: skip
    """(rotary, query, key, value, positions, q_norm_weight, k_norm_weight) as the gated layer
    hands them over: each query a strided view beside its output gate ([T, H, 2D] halves), keys
    and values strided rows of one fused projection; offset weights around zero (they start
    there), plain ones around one."""
    rotary = RotaryEmbedding(head_dim, 50, 10000.0, partial_rotary_factor=rotary_dim / head_dim)
    rotary = rotary.to(DEVICE)
    assert rotary.rotary_dim == rotary_dim
    q_gate = randn(rng, num_tokens, num_heads, 2 * head_dim, dtype=dtype)
    kv = randn(rng, num_tokens, 2 * num_kv_heads, head_dim, dtype=dtype)
    query, key, value = q_gate[..., :head_dim], kv[:, :num_kv_heads], kv[:, num_kv_heads:]
    positions = torch.randint(0, 50, (num_tokens,), generator=rng).to(DEVICE)
    center = {"none": None, "plain": 1.0, "offset": 0.0}[norm]
    weights = [
        None if center is None else (center + 0.3 * randn(rng, head_dim)).to(dtype) for _ in "qk"
    ]
    return rotary, query, key, value, positions, *weights


# (head_dim, rotary_dim, num_heads, num_kv_heads, block_h): Qwen3.5's factor 0.25 on a tiny
# head and on its real one (256, 64 rotated), half rotary with a pass-through of 48 (no power of
# two) over a partial head block, a 2-dimension rotation, and whole heads with offset norms.
PARTIAL_SHAPES = [
    (16, 4, 4, 2, None),
    (256, 64, 2, 1, None),
    (80, 32, 3, 1, 2),
    (36, 2, 2, 2, 1),
    (64, 64, 4, 2, None),
]


# The new modes: partial rotary with any norm, whole heads with offset norms (whole heads with
# plain norms or none are test_qk_norm_rope's and test_qk_norm_rope_store's).
PARTIAL_CASES = [
    (shape, norm)
    for shape in PARTIAL_SHAPES
    for norm in NORMS
    if norm == "offset" or shape[1] < shape[0]
]


def _case_id(case: tuple) -> str:
    return "d{}-rot{}-h{}-kv{}-bh{}".format(*case[0]) + f"-{case[1]}"


@pytest.mark.parametrize("case", PARTIAL_CASES, ids=_case_id)
@pytest.mark.parametrize("num_tokens", [0, 1, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_qk_norm_rope_offset_partial(rng, case: tuple, num_tokens: int, dtype: torch.dtype) -> None:
    """Offset norms (the output in the activation dtype) and partial rotary against the twin:
    the rotated dimensions within a rounding, the pass-through ones normed alike."""
    (head_dim, rotary_dim, num_heads, num_kv_heads, block_h), norm = case
    rotary, query, key, _, positions, q_w, k_w = gated_case(
        rng, num_tokens, num_heads, num_kv_heads, head_dim, rotary_dim, dtype, norm
    )
    caches = (rotary.cos_cache, rotary.sin_cache)
    offset = norm == "offset"
    expected = qk_norm_rope_torch(
        query, key, positions, *caches, q_w, k_w, 1e-6, norm_offset=offset
    )
    got = triton_qk_norm_rope(
        query, key, positions, *caches, q_w, k_w, 1e-6, norm_offset=offset, block_h=block_h
    )
    for g, e in zip(got, expected, strict=True):
        assert g.shape == e.shape and g.dtype == e.dtype
        torch.testing.assert_close(g, e, **tolerance(dtype))
        if norm == "none":  # the pass-through dimensions are the input's, copied
            assert torch.equal(g[..., rotary_dim:], e[..., rotary_dim:])
    q_none, k_only = triton_qk_norm_rope(
        None, key, positions, *caches, None, k_w, 1e-6, norm_offset=offset
    )
    assert q_none is None
    torch.testing.assert_close(k_only, expected[1], **tolerance(dtype))


def test_offset_norm_keeps_the_activation_dtype(rng) -> None:
    """float32 offset weights over bf16 heads give bf16 heads (the norm's one rounding), where
    plain weights promote, in the kernel as in the twin."""
    rotary, query, key, _, positions, q_w, k_w = gated_case(
        rng, 3, 2, 1, 16, 4, torch.bfloat16, "offset"
    )
    caches = (rotary.cos_cache, rotary.sin_cache)
    for offset, dtype in [(True, torch.bfloat16), (False, torch.float32)]:
        weights = (q_w.float(), k_w.float())
        for fn in (qk_norm_rope_torch, triton_qk_norm_rope):
            q, k = fn(query, key, positions, *caches, *weights, 1e-6, norm_offset=offset)
            assert q.dtype == k.dtype == dtype, (fn.__name__, offset)


@pytest.mark.parametrize("case", PARTIAL_CASES, ids=_case_id)
@pytest.mark.parametrize("num_tokens", [1, 6])
@pytest.mark.parametrize(
    "dtype,cache_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)],
    ids=["fp32", "bf16"],
)
def test_qk_norm_rope_store_offset_partial(
    rng, case: tuple, num_tokens: int, dtype: torch.dtype, cache_dtype: torch.dtype
) -> None:
    """The store variant in the new modes: the returned heads as the twin's, the cache holding
    exactly them (pass-through dimensions included), the values copied whole, PAD rows and
    untouched slots left alone."""
    (head_dim, rotary_dim, num_heads, num_kv_heads, block_h), norm = case
    block_size, num_blocks = 4, 4
    rotary, query, key, value, positions, q_w, k_w = gated_case(
        rng, num_tokens, num_heads, num_kv_heads, head_dim, rotary_dim, dtype, norm
    )
    caches = (rotary.cos_cache, rotary.sin_cache)
    offset = norm == "offset"
    slots, key_cache, value_cache, expected_k, expected_v = slots_and_caches(
        rng, num_tokens, (num_blocks, block_size, num_kv_heads, head_dim), cache_dtype
    )
    expected = qk_norm_rope_store_torch(
        query, key, value, positions, *caches, q_w, k_w, 1e-6, expected_k, expected_v, slots,
        norm_offset=offset,
    )  # fmt: skip
    got = triton_qk_norm_rope_store(
        query, key, value, positions, *caches, q_w, k_w, 1e-6, key_cache, value_cache, slots,
        norm_offset=offset, block_h=block_h,
    )  # fmt: skip
    for g, e in zip(got, expected, strict=True):
        assert g.shape == e.shape and g.dtype == e.dtype
        torch.testing.assert_close(g, e, **tolerance(dtype))
    written = slots[slots >= 0]
    flat_k, flat_v = key_cache.flatten(0, 1), value_cache.flatten(0, 1)
    torch.testing.assert_close(
        flat_k[written], expected_k.flatten(0, 1)[written], **tolerance(dtype)
    )
    assert torch.equal(flat_v[written], expected_v.flatten(0, 1)[written])
    assert torch.equal(flat_k[written], got[1][slots >= 0].to(cache_dtype))
    unwritten = torch.ones(flat_k.shape[0], dtype=torch.bool, device=DEVICE)
    unwritten[written] = False
    assert flat_k[unwritten].isnan().all() and flat_v[unwritten].isnan().all()


def test_rotary_table_wider_than_the_head_is_refused(rng) -> None:
    rotary, query, key, _, positions, _, _ = gated_case(rng, 2, 2, 1, 16, 16, torch.float32, "none")
    with pytest.raises(ValueError, match="do not rotate"):
        triton_qk_norm_rope(query[..., :8], key[..., :8], positions, rotary.cos_cache,
                            rotary.sin_cache, None, None, 1e-6)  # fmt: skip


def eager_partial_rotate(
    rotary: RotaryEmbedding,
    positions: torch.Tensor,  # [num_tokens] int64
    x: torch.Tensor,  # [num_tokens, num_heads, head_dim]
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """`RotaryEmbedding.rotate` with partial rotary as written before the fused kernel took it:
    the first rotary_dim dimensions rotated, the rest concatenated after."""
    rot, rest = x[..., : rotary.rotary_dim], x[..., rotary.rotary_dim :]
    return torch.cat((eager_rotate(rotary, positions, rot), rest), -1)


@pytest.mark.parametrize("shape", [(16, 4), (256, 64), (80, 32), (48, 48)], ids=str)
@pytest.mark.parametrize("offset", [True, False], ids=["offset-norm", "plain-norm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_twin_is_the_eager_composition(
    rng, set_policy, shape: tuple, offset: bool, dtype: torch.dtype
) -> None:
    """The twin (what the gated layer runs off the Triton path) is, bit for bit, the norm
    modules followed by `RotaryEmbedding.rotate`, and `rotate` the old eager partial rotation;
    `RotaryEmbedding.forward` in the offset mode is the twin."""
    set_policy(backend="torch")
    head_dim, rotary_dim = shape
    norm = "offset" if offset else "plain"
    rotary, query, key, _, positions, q_w, k_w = gated_case(
        rng, 5, 4, 2, head_dim, rotary_dim, dtype, norm
    )
    norm_cls = OffsetRMSNorm if offset else RMSNorm
    q_norm, k_norm = (norm_cls(head_dim, eps=1e-6).to(DEVICE, dtype) for _ in "qk")
    q_norm.weight.data, k_norm.weight.data = q_w, k_w
    with torch.no_grad():
        expected = (
            eager_partial_rotate(rotary, positions, q_norm(query)),
            eager_partial_rotate(rotary, positions, k_norm(key)),
        )
        assert torch.equal(
            rotary.rotate(positions, key), eager_partial_rotate(rotary, positions, key)
        )
    caches = (rotary.cos_cache, rotary.sin_cache)
    twin = qk_norm_rope_torch(query, key, positions, *caches, q_w, k_w, 1e-6, norm_offset=offset)
    layer = rotary(positions, query, key, q_w, k_w, 1e-6, norm_offset=offset)
    for t, lay, e in zip(twin, layer, expected, strict=True):
        assert t.dtype == e.dtype
        torch.testing.assert_close(t, e, atol=0, rtol=0)
        torch.testing.assert_close(lay, e, atol=0, rtol=0)
