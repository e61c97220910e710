"""`blockdraft.kernels.candidate_walk` (through `spec_decode.candidate_selection`): the DFlash2
path walk. Greedy: the reference's
position-by-position argmax given the previous pick. Sampled: the joint law of the path is the
product of each position's softmax given the previous pick, and q is that softmax.

Statistical checks use a chi-square test at ALPHA (tests/sampling_checks.py)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from blockdraft.kernels import candidate_walk
from blockdraft.spec_decode.candidate_selection import dense_draft_probs
from blockdraft.spec_decode.rejection_sampler import SALT_DRAFT

from sampling_checks import ALPHA, MAX_SEED, Ctx, chi2_pvalue


def _scores(gen: torch.Generator, r: int, n: int, k: int, scale: float = 1.5) -> torch.Tensor:
    scores = torch.randn(r, n, k, k, generator=gen) * scale
    scores[:, 0] = scores[:, 0, :1]  # position 0 follows the anchor: its rows are equal
    return scores


def walk_candidates(scores, temperature, seed, position):
    return candidate_walk.walk_candidates(scores, temperature, seed, position, SALT_DRAFT)


def _reference_walk(scores: torch.Tensor) -> list[list[int]]:  # greedy, one step at a time
    paths = []
    for row in scores:
        previous, path = 0, []
        for position in row:
            previous = int(position[previous].argmax())
            path.append(previous)
        paths.append(path)
    return paths


def test_greedy_walk(ctx: Ctx) -> None:
    for n in (1, 2, 5, 7, 15):
        r, k = 6, 4
        scores = _scores(ctx.gen, r, n, k)
        seed = torch.randint(0, MAX_SEED, (r,), generator=ctx.gen)
        index, q = walk_candidates(scores, torch.zeros(r), seed, torch.arange(r) * 100)
        assert index.tolist() == _reference_walk(scores), ctx.tag
        assert torch.equal(q, torch.nn.functional.one_hot(index, k).float()), ctx.tag


def test_sampled_walk_law_and_q(ctx: Ctx) -> None:
    """Many seeds on one score tensor: the counts of whole paths (N = 3, K = 3: 27 paths) fit
    the product of the conditional softmaxes; q is each position's softmax given the previous
    pick; a greedy row in the batch still walks greedily."""
    m, n, k, temperature = 6000, 3, 3, 0.8
    scores = _scores(ctx.gen, 1, n, k).expand(m, n, k, k).contiguous()
    temp = torch.full((m,), temperature)
    temp[0] = 0.0
    seed = torch.randint(0, MAX_SEED, (m,), generator=ctx.gen)
    position = torch.randint(0, 1 << 30, (m,), generator=ctx.gen)
    index, q = walk_candidates(scores, temp, seed, position)
    assert index[0].tolist() == _reference_walk(scores[:1])[0], ctx.tag
    conditional = torch.softmax(scores[0].double() / temperature, dim=-1)  # [N, K, K]
    previous = torch.cat([torch.zeros(m, 1, dtype=torch.int64), index[:, :-1]], dim=1)
    want_q = conditional[torch.arange(n)[None], previous].float()
    assert torch.allclose(q[1:], want_q[1:], atol=1e-6), ctx.tag
    law, counts = [], np.zeros(k**n)
    for path in itertools.product(range(k), repeat=n):
        p, before = 1.0, 0
        for i, c in enumerate(path):
            p, before = p * float(conditional[i, before, c]), c
        law.append(p)
    for path in index[1:].tolist():
        counts[sum(c * k ** (n - 1 - i) for i, c in enumerate(path))] += 1
    assert chi2_pvalue(counts, np.array(law)) > ALPHA, ctx.tag


def test_same_seed_same_path_whatever_the_batch(ctx: Ctx) -> None:
    """A request's draws depend on its own seed and positions, not on its batch mates."""
    r, n, k = 5, 6, 4
    scores = _scores(ctx.gen, r, n, k)
    temp = torch.full((r,), 1.3)
    seed = torch.randint(0, MAX_SEED, (r,), generator=ctx.gen)
    position = torch.randint(0, 1 << 30, (r,), generator=ctx.gen)
    index, q = walk_candidates(scores, temp, seed, position)
    for i in range(r):
        alone, q_alone = walk_candidates(
            scores[i : i + 1], temp[i : i + 1], seed[i : i + 1], position[i : i + 1]
        )
        assert torch.equal(alone[0], index[i]) and torch.equal(q_alone[0], q[i]), ctx.tag


def test_dense_draft_probs() -> None:
    candidates = torch.tensor([[[4, 0, 2], [1, 3, 0]]])
    q = torch.tensor([[[0.5, 0.3, 0.2], [0.1, 0.0, 0.9]]])
    dense = dense_draft_probs(candidates, q, 6)
    assert dense.shape == (1, 2, 6)
    assert torch.equal(dense[0, 0], torch.tensor([0.3, 0.0, 0.2, 0.0, 0.5, 0.0]))
    assert torch.allclose(dense[0, 1], torch.tensor([0.9, 0.1, 0.0, 0.0, 0.0, 0.0]))


def _tiny_proposer(tmp_path, rng, block_size: int):
    """A tiny DFlash2 proposer on the CPU with larger random weights than the dummy ones."""
    from benchmarks.common import write_dummy_drafter
    from benchmarks.drafter_step_bench import TINY, TINY_DFLASH2, build_proposer

    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=rng)))
    drafter_dir = write_dummy_drafter(
        tmp_path, TINY, 2, block_size, with_weights=False, dflash2=TINY_DFLASH2
    )
    proposer = build_proposer(drafter_dir, TINY, 128, 16, torch.float32, torch.device("cpu"))
    for module in proposer.drafter.modules():
        for p in module.parameters(recurse=False):
            p.normal_(0, 0.3)
    return proposer


def _block_inputs(proposer, anchors: torch.Tensor, context_len: int, n: int):
    """Block tables of two pages per request, and the drafter inputs after `context_len`
    context rows."""
    batch = anchors.shape[0]
    i64 = dict(dtype=torch.int64)
    tables = torch.arange(batch * 2, **i64).view(batch, 2)
    rows = torch.arange(batch, **i64)
    inputs = proposer.prepare_inputs(
        anchors, torch.full((batch,), context_len, **i64), rows, torch.ones(batch, **i64), rows,
        tables, n, batch,
    )  # fmt: skip
    return inputs, tables


@torch.inference_mode()
def test_graphed_selection_equals_eager(tmp_path, rng) -> None:
    """A DFlash2 proposer's drafts through its captured graph (the CPU twin: the selector and
    the requests' temperatures and seeds in persistent buffers) equal the eager run's, for a
    batch mixing greedy and sampled requests, and their dense q sums to one over the
    candidates."""
    from blockdraft.layers.sampler import SamplingTensors

    proposer = _tiny_proposer(tmp_path, rng, 8)
    batch, n, context_len = 3, 7, 20
    inputs, tables = _block_inputs(
        proposer, torch.randint(4, 200, (batch,), generator=rng), context_len, n
    )
    seeds = torch.randint(0, MAX_SEED, (batch,), generator=rng).tolist()
    st = SamplingTensors.from_lists(
        [0.0, 0.9, 1.7],
        [0] * batch,
        [1.0] * batch,
        [0.0] * batch,
        seeds,
        [context_len + 1] * batch,
        "cpu",
    )
    want_tokens, want_probs = proposer.propose(inputs, tables, context_len + n + 1, st, n)
    proposer.capture_graphs(n, [2, 4], 2, None)
    graph, replays = proposer.graphs[n + 1], []
    run = graph.run
    graph.run = lambda *a: replays.append(a[3].shape[0]) or run(*a)
    got_tokens, got_probs = proposer.propose(inputs, tables, context_len + n + 1, st, n)
    assert replays == [batch]
    # The drafts outlive the replay: a later graph reusing its output memory leaves them be.
    for out in graph.graphs[4][1]:
        out.fill_(0)
    assert torch.equal(got_tokens, want_tokens)
    torch.testing.assert_close(got_probs, want_probs)
    assert torch.allclose(got_probs.sum(-1), torch.ones(batch, n))
    assert torch.equal(got_probs[0], torch.nn.functional.one_hot(got_tokens[0], 256).float())
    assert (got_probs.gather(2, got_tokens[..., None]) > 0).all()


@torch.inference_mode()
def test_triton_drafting_path_equals_torch(tmp_path, rng, set_policy) -> None:
    """A DFlash2 drafter step with every kernel of the GPU path (the fused closing convolution
    + norm, top-K, candidate walk; Triton's interpreter on the CPU) proposes the tokens and q
    of the torch path, greedy and sampled requests in one batch."""
    from blockdraft.layers.sampler import SamplingTensors

    from kernel_inputs import INTERPRETED

    if not INTERPRETED:  # the proposer here is on the CPU
        pytest.skip("runs the Triton kernels on the CPU, under TRITON_INTERPRET=1")
    proposer = _tiny_proposer(tmp_path, rng, 6)
    batch, n, context_len = 2, 5, 12
    st = SamplingTensors.from_lists(
        [0.0, 1.1], [0] * batch, [1.0] * batch, [0.0] * batch,
        torch.randint(0, MAX_SEED, (batch,), generator=rng).tolist(), [context_len + 1] * batch,
        "cpu",
    )  # fmt: skip
    anchors = torch.randint(4, 200, (batch,), generator=rng)
    proposals = []
    for backend in ("torch", "triton"):
        set_policy(backend=backend)
        inputs, tables = _block_inputs(proposer, anchors, context_len, n)
        proposals.append(proposer.propose(inputs, tables, context_len + n + 1, st, n))
    (want_tokens, want_probs), (got_tokens, got_probs) = proposals
    assert torch.equal(got_tokens, want_tokens)
    torch.testing.assert_close(got_probs, want_probs, rtol=1e-4, atol=1e-5)
