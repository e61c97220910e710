"""A reduced draft vocabulary: d2t/t2d checked, logits scattered back to target ids, and a
sampled draft's q zero outside the draft vocabulary."""

import pytest
import torch

from blockdraft.layers.sampler import SamplingTensors
from blockdraft.models.draft_vocab import draft_token_ids, scatter_draft_logits
from blockdraft.spec_decode.rejection_sampler import sample_drafts


def test_ids_from_d2t_and_t2d(rng) -> None:
    ids = torch.randperm(50, generator=rng)[:12].sort().values
    d2t = ids - torch.arange(12)
    t2d = torch.zeros(50, dtype=torch.bool).index_fill_(0, ids, True)
    assert torch.equal(draft_token_ids(d2t, t2d, 50), ids)
    assert torch.equal(draft_token_ids(d2t, None, 50), ids)


@pytest.mark.parametrize(
    "d2t, t2d, message",
    [
        (torch.tensor([0, 0, 48]), None, "outside the target's vocabulary"),
        (torch.tensor([-1, 0, 0]), None, "outside"),
        (torch.tensor([2, 1, 0]), None, "same target token"),
        (torch.tensor([0, 0, 0]), torch.zeros(50, dtype=torch.bool), "disagree"),
        (torch.tensor([0, 0, 0]), torch.ones(49, dtype=torch.bool), "49 entries"),
        (torch.zeros(3, 1, dtype=torch.int64), None, "1-D"),
    ],
)
def test_bad_maps_are_named(d2t, t2d, message) -> None:
    with pytest.raises(ValueError, match=message):
        draft_token_ids(d2t, t2d, 50)


def test_scattered_logits_propose_only_draft_tokens(rng) -> None:
    ids = torch.randperm(40, generator=rng)[:9].sort().values
    logits = torch.randn(6, 9, generator=rng)
    full = scatter_draft_logits(logits, ids, 40)
    assert torch.equal(full[:, ids], logits)
    assert torch.isneginf(full.sum(0)[~torch.isin(torch.arange(40), ids)]).all()
    greedy = SamplingTensors.from_lists(
        [0.0, 0.0], [0, 0], [1.0] * 2, [0.0] * 2, [1, 2], [5, 9], "cpu"
    )
    tokens, probs = sample_drafts(full.view(2, 3, 40), greedy)
    assert probs is None and torch.equal(tokens.flatten(), ids[logits.argmax(-1)])
    sampled = SamplingTensors.from_lists(
        [1.0, 0.7], [0, 4], [1.0] * 2, [0.0] * 2, [1, 2], [5, 9], "cpu"
    )
    tokens, probs = sample_drafts(full.view(2, 3, 40), sampled)
    assert torch.isin(tokens, ids).all()
    outside = ~torch.isin(torch.arange(40), ids)
    assert (probs[..., outside] == 0).all() and torch.allclose(probs.sum(-1), torch.ones(2, 3))
