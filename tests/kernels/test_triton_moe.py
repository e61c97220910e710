"""The Triton MoE router and experts (`blockdraft.kernels.triton_moe`) against their torch twins
(`route_torch`, `experts_torch`), on fresh random inputs: both expert paths (per-pair decode
GEMVs and the grouped GEMMs), empty experts, every pair on one expert, padded rows, top-k of 1,
2 and 8, up to 128 experts, fp32 and 16-bit.

Runs on the CPU through Triton's interpreter (TRITON_INTERPRET=1); with TRITON_INTERPRET=0 on a
CUDA machine the same tests run the compiled kernels. Shapes stay small: the interpreter costs
milliseconds per program. The grouped path's 16-bit cases are fp16 under the interpreter, whose
bf16 `tl.dot` is wrong (see tests/kernels/test_triton_linear.py); bf16 runs there on a GPU.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from blockdraft.kernels.moe import experts_torch, moe_backend, route_torch  # noqa: E402
from blockdraft.kernels.triton_moe import (  # noqa: E402
    DECODE_MAX_PAIRS,
    DecodeConfig,
    GroupedConfig,
    group_by_expert,
    triton_experts,
    triton_route,
)

from kernel_inputs import DEVICE, INTERPRETED, needs_triton, randn, tolerance  # noqa: E402

pytestmark = needs_triton

HIDDEN, INTER = 32, 24  # H not a multiple of the configs' BLOCK_K below: masked K tails too
DECODE = DecodeConfig(block_n=16, gate_up_block_k=16, down_block_k=16)
# pairs_per_program 32: inputs past 32 pairs take several grouping chunks.
GROUPED = GroupedConfig(block_m=16, block_n=16, block_k=16, num_stages=1, pairs_per_program=32)
BF16_GROUPED = pytest.param(
    torch.bfloat16,
    marks=pytest.mark.skipif(INTERPRETED, reason="the interpreter's bf16 tl.dot is wrong"),
)


def distinct_logits(rng: torch.Generator, tokens: int, experts: int, dtype: torch.dtype):
    """Router logits without ties, exact in any dtype: a shuffle of k / 16 per row."""
    rows = [torch.randperm(experts, generator=rng) for _ in range(tokens)]
    logits = (torch.stack(rows).float() - experts / 2) / 16 if rows else torch.empty(0, experts)
    return logits.to(DEVICE, dtype)


def expert_weights(rng: torch.Generator, experts: int, dtype: torch.dtype):
    w_gate_up = randn(rng, experts, 2 * INTER, HIDDEN) / HIDDEN**0.5
    w_down = randn(rng, experts, HIDDEN, INTER) / INTER**0.5
    return w_gate_up.to(dtype), w_down.to(dtype)


def routing(rng: torch.Generator, tokens: int, experts: int, top_k: int):
    """The twin's routing of random logits: fp32 weights, distinct ids per row."""
    return route_torch(randn(rng, tokens, experts), top_k, renormalize=False)


def check(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.shape == expected.shape and got.dtype == expected.dtype
    assert not got.isnan().any()
    # Relative to the output's scale: the twin adds the slots in x's dtype, the kernel in fp32.
    tol = tolerance(got.dtype)
    scale = max(1.0, expected.float().abs().max().item())
    torch.testing.assert_close(got, expected, rtol=tol["rtol"], atol=tol["atol"] * scale)


@pytest.mark.parametrize(
    "tokens,experts,top_k,renormalize",
    [(1, 128, 8, True), (7, 6, 2, False), (5, 4, 1, True), (3, 128, 8, False), (4, 300, 3, True)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_route_matches_twin(rng, tokens, experts, top_k, renormalize, dtype) -> None:
    logits = distinct_logits(rng, tokens, experts, dtype)
    weights, ids = triton_route(logits, top_k, renormalize)
    expected_weights, expected_ids = route_torch(logits, top_k, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("tokens,experts,top_k,renormalize", [(1, 128, 8, True), (6, 6, 2, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_route_with_a_shared_expert_matches_twin(rng, tokens, experts, top_k, renormalize, dtype):
    """The shared expert's gate in the last logit column: the routed slots as without it, one
    more slot for expert id `experts` weighted sigmoid(gate)."""
    logits = torch.cat(
        (distinct_logits(rng, tokens, experts, dtype), randn(rng, tokens, 1).to(dtype)), dim=1
    )
    weights, ids = triton_route(logits, top_k, renormalize, shared_expert=True)
    expected_weights, expected_ids = route_torch(logits, top_k, renormalize, shared_expert=True)
    assert weights.shape == ids.shape == (tokens, top_k + 1)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights, rtol=1e-6, atol=1e-7)
    routed_weights, routed_ids = triton_route(logits[:, :-1], top_k, renormalize)
    assert torch.equal(ids[:, :top_k], routed_ids) and (ids[:, top_k] == experts).all()
    torch.testing.assert_close(weights[:, :top_k], routed_weights, rtol=0, atol=0)
    gate = torch.sigmoid(logits[:, -1].float())
    torch.testing.assert_close(weights[:, top_k], gate, rtol=1e-6, atol=1e-7)


def test_route_ties_take_the_lowest_index_and_nan_rows_stay_valid(rng) -> None:
    logits = randn(rng, 3, 10)
    logits[0] = 0.5  # all equal
    logits[1, 7] = float("nan")  # a padded row's garbage
    weights, ids = triton_route(logits, 4, renormalize=True)
    assert ids[0].tolist() == [0, 1, 2, 3]
    torch.testing.assert_close(weights[0], torch.full((4,), 0.25, device=DEVICE))
    assert ((ids >= 0) & (ids < 10)).all()
    assert torch.equal(ids[2], route_torch(logits[2:], 4, True)[1][0])


@pytest.mark.parametrize("tokens,top_k", [(1, 8), (2, 8), (3, 2), (16, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_path_matches_twin(rng, tokens, top_k, dtype) -> None:
    experts = 16
    x = randn(rng, tokens, HIDDEN + 8).to(dtype)[:, 5 : 5 + HIDDEN]  # strided rows
    w_gate_up, w_down = expert_weights(rng, experts, dtype)
    weights, ids = routing(rng, tokens, experts, top_k)
    expected = experts_torch(x, w_gate_up, w_down, weights, ids)
    check(triton_experts(x, w_gate_up, w_down, weights, ids, DECODE), expected)
    if tokens * top_k <= DECODE_MAX_PAIRS:  # the default config picks this path
        check(triton_experts(x, w_gate_up, w_down, weights, ids), expected)


# (tokens, experts, top_k): experts left empty, 128 experts, several grouping chunks (> 32
# pairs) and an expert past one block (> 16 of its pairs).
GROUPED_CASES = [(9, 6, 2), (3, 128, 8), (12, 4, 4), (40, 3, 1)]


@pytest.mark.parametrize("tokens,experts,top_k", GROUPED_CASES)
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, BF16_GROUPED], ids=["fp32", "fp16", "bf16"]
)
def test_grouped_path_matches_twin(rng, tokens, experts, top_k, dtype) -> None:
    x = randn(rng, tokens, HIDDEN + 8).to(dtype)[:, 3 : 3 + HIDDEN]  # strided rows
    w_gate_up, w_down = expert_weights(rng, experts, dtype)
    weights, ids = routing(rng, tokens, experts, top_k)
    got = triton_experts(x, w_gate_up, w_down, weights, ids, GROUPED)
    check(got, experts_torch(x, w_gate_up, w_down, weights, ids))
    assert torch.equal(got, triton_experts(x, w_gate_up, w_down, weights, ids, GROUPED))


def test_grouped_default_config_matches_twin(rng) -> None:
    x = randn(rng, 3, HIDDEN)
    w_gate_up, w_down = expert_weights(rng, 10, torch.float32)
    weights, ids = routing(rng, 3, 10, 8)  # 24 pairs: past the decode path
    got = triton_experts(x, w_gate_up, w_down, weights, ids)
    check(got, experts_torch(x, w_gate_up, w_down, weights, ids))


@pytest.mark.parametrize("config", [DECODE, GROUPED], ids=["decode", "grouped"])
def test_all_pairs_on_one_expert(rng, config) -> None:
    tokens, top_k = (2, 1) if isinstance(config, DecodeConfig) else (20, 2)
    x = randn(rng, tokens, HIDDEN)
    w_gate_up, w_down = expert_weights(rng, 5, torch.float32)
    ids = torch.full((tokens, top_k), 3, dtype=torch.int32, device=DEVICE)  # any int dtype
    weights = torch.rand(tokens, top_k, generator=rng).to(DEVICE)
    got = triton_experts(x, w_gate_up, w_down, weights, ids, config)
    check(got, experts_torch(x, w_gate_up, w_down, weights, ids))


@pytest.mark.parametrize("config", [DECODE, GROUPED], ids=["decode", "grouped"])
def test_padded_rows_do_not_touch_other_rows(rng, config) -> None:
    """Padded rows (NaN activations, NaN weights, any valid experts) leave the real rows as
    the twin computes them without the padding."""
    tokens, top_k, experts = (2, 4, 6) if isinstance(config, DecodeConfig) else (11, 2, 6)
    real = [0, 2, 3] if tokens > 2 else [1]
    x = randn(rng, tokens, HIDDEN)
    w_gate_up, w_down = expert_weights(rng, experts, torch.float32)
    weights, ids = routing(rng, tokens, experts, top_k)
    pad = torch.ones(tokens, dtype=torch.bool)
    pad[real] = False
    x[pad] = float("nan")
    weights[pad] = float("nan")
    got = triton_experts(x, w_gate_up, w_down, weights, ids, config)
    expected = experts_torch(x[real], w_gate_up, w_down, weights[real], ids[real])
    check(got[real], expected)


@pytest.mark.parametrize(
    "config,tokens,top_k",
    [(DECODE, 2, 4), (GROUPED, 11, 2), (GROUPED, 9, 1)],
    ids=["decode", "grouped", "grouped-top1"],
)
def test_pairs_without_an_expert_add_nothing(rng, config, tokens, top_k) -> None:
    """Ids outside [0, E) (another rank's experts: -1; or E) add nothing to their token, which
    sums its other pairs; a token without any expert gets zeros. Their weights are not read:
    NaN there changes nothing."""
    experts = 6
    x = randn(rng, tokens, HIDDEN)
    w_gate_up, w_down = expert_weights(rng, experts, torch.float32)
    weights, ids = routing(rng, tokens, experts, top_k)
    gone = (torch.rand(tokens, top_k, generator=rng) < 0.5).to(DEVICE)
    gone[0] = True  # a token all of whose experts live elsewhere
    elsewhere = torch.where(torch.rand(tokens, top_k, generator=rng) < 0.5, -1, experts)
    ids = torch.where(gone, elsewhere.to(DEVICE), ids)
    weights[gone] = float("nan")
    got = triton_experts(x, w_gate_up, w_down, weights, ids, config)
    kept = torch.where(gone, 0.0, weights)
    check(got, experts_torch(x, w_gate_up, w_down, kept, torch.where(gone, 0, ids)))
    assert not got[0].any()
    check(experts_torch(x, w_gate_up, w_down, weights, ids), got)


def test_group_by_expert_is_a_stable_padded_sort(rng) -> None:
    experts, block_m = 7, 4
    ids = torch.randint(0, experts - 1, (45,), generator=rng).to(DEVICE)  # the last one empty
    grouping = group_by_expert(ids, experts, block_m, pairs_per_program=32)
    block_expert, block_rows = grouping.block_expert.cpu(), grouping.block_rows.cpu()
    rows = grouping.sorted_pairs.cpu().view(-1, block_m)
    counts = torch.bincount(ids.cpu(), minlength=experts)
    used = int((-(-counts // block_m)).sum())
    assert (block_expert[used:] == -1).all() and (block_rows[used:] == 0).all()
    expected_experts = torch.repeat_interleave(torch.arange(experts), -(-counts // block_m))
    assert torch.equal(block_expert[:used].long(), expected_experts)
    got = torch.cat([rows[b, : block_rows[b]] for b in range(used)]).long()
    assert torch.equal(got, torch.sort(ids.cpu(), stable=True).indices)


def test_bad_arguments_are_value_errors(rng) -> None:
    x = randn(rng, 2, HIDDEN)
    w_gate_up, w_down = expert_weights(rng, 4, torch.float32)
    weights, ids = routing(rng, 2, 4, 2)
    with pytest.raises(ValueError, match="top_k"):
        triton_route(randn(rng, 2, 4), 5, True)
    with pytest.raises(ValueError, match=r"top_k must be in \[1, 3\]"):  # a gate column
        triton_route(randn(rng, 2, 4), 4, True, shared_expert=True)
    with pytest.raises(ValueError, match="w_down"):
        triton_experts(x, w_gate_up, w_down[:, :, :-1], weights, ids)
    with pytest.raises(ValueError, match="dtype"):
        triton_experts(x.double(), w_gate_up, w_down, weights, ids)
    with pytest.raises(ValueError, match="topk_ids"):
        triton_experts(x, w_gate_up, w_down, weights, ids[:1])


def test_moe_backend_follows_the_policy(set_policy) -> None:
    set_policy(backend="torch")
    assert moe_backend(DEVICE) == (route_torch, experts_torch)
    set_policy(backend="triton")
    assert moe_backend(DEVICE) == (triton_route, triton_experts)
