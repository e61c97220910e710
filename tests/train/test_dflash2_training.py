"""DFlash2 drafter training (`arch="dflash2"`): the selector loss against z-lab's selector, a
loss that falls, checkpoints that z-lab's DFlash2DraftModel and the engine load and draft alike
(greedy lossless), starting from a DFlash2 checkpoint, and the options' errors."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from blockdraft import LLM, SamplingParams
from blockdraft.cli import main as cli_main
from blockdraft.models.dflash2_drafter import DFlash2Drafter
from blockdraft.models.registry import resolve_drafter
from blockdraft.train import TrainConfig, regenerate
from blockdraft.train.drafter import (
    DFlash2Shape,
    default_mask_token_id,
    drafter_hf_config,
    init_drafter_weights,
    load_target,
    save_drafter,
)
from blockdraft.train.selector_loss import selector_loss
from blockdraft.train.trainer import Trainer

from checkpoints import make_qwen3_checkpoint
from dflash2_checkpoints import (
    load_zlab_dflash2_strict,
    make_dflash2_drafter,
    prompt_where_selector_picks,
)
from spies import spy_draft_logits, spy_proposals

VOCAB = 128
SMALL = dict(selector_rank=8, selector_top_k=6)  # tiny selector for the 128-token vocabulary


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict[str, Path]:
    """A random target and 24 responses it wrote to random word prompts (a fixed data set)."""
    root = tmp_path_factory.mktemp("dflash2-train")
    target = make_qwen3_checkpoint(root / "target", seed=0)
    words = random.Random(0)
    chats = [
        [{"role": "user", "content": " ".join(f"w{words.randrange(7, VOCAB)}" for _ in range(n))}]
        for n in [words.randrange(3, 12) for _ in range(24)]
    ]
    data = regenerate(
        chats,
        root / "data.jsonl",
        model=str(target),
        max_tokens=48,
        max_prompt_tokens=64,
        use_tqdm=False,
    )
    return {"root": root, "target": target, "data": data}


def train_config(setup: dict[str, Path], out: Path, **kw: object) -> TrainConfig:
    args: dict = dict(
        out_dir=str(out),
        data=str(setup["data"]),
        model=str(setup["target"]),
        arch="dflash2",
        batch_size=4,
        anchors=16,
        block_size=8,
        lr=3e-3,
        use_tqdm=False,
    )
    args.update(kw)
    return TrainConfig(**args)


def random_drafter(setup: dict[str, Path], seed: int) -> tuple[DFlash2Drafter, dict]:
    """A fresh DFlash2 drafter with large random weights and a random hidden projection (a
    sharp selector), and its config.json dict."""
    target, tokenizer, hf = load_target(
        str(setup["target"]), torch.float32, torch.device("cpu"), 256
    )
    hf = drafter_hf_config(
        hf, mask_token_id=default_mask_token_id(tokenizer, hf), dflash2=DFlash2Shape(**SMALL)
    )
    dcfg, drafter_class = resolve_drafter(hf)
    drafter = drafter_class(dcfg, target, 256)
    init_drafter_weights(drafter, seed=seed, std=0.1)
    projection = drafter.candidate_selector.hidden_projection.weight  # zero when fresh
    with torch.no_grad():
        projection.copy_(0.1 * torch.randn(projection.shape, generator=torch.Generator()))
    return drafter, hf


def test_selector_loss_matches_zlab_selector(setup: dict[str, Path], tmp_path: Path, rng) -> None:
    """Our selector loss is the cross-entropy of z-lab's own selector probabilities (its
    CandidateSelector.select at T = 1, one position after the given predecessor) at the true
    token, weighted, over the rows whose true token is a candidate; its pick is z-lab's
    argmax. Chunked (with recompute in backward) or not, the same loss and gradients."""
    drafter, hf = random_drafter(setup, seed=int(torch.randint(0, 2**31, (1,), generator=rng)))
    out = save_drafter(drafter, hf, tmp_path / "drafter", torch.float32)
    ref = load_zlab_dflash2_strict(out)
    rows = 40
    hidden = torch.randn(rows, drafter.cfg.body.hidden_size, generator=rng)
    predecessors = torch.randint(0, VOCAB, (rows,), generator=rng)
    weights = torch.rand(rows, generator=rng) + 0.1
    with torch.no_grad():
        logits = drafter.compute_logits(hidden)
    ranked = logits.argsort(-1, descending=True)
    # Half the labels among the top 6 candidates, half outside them.
    pick = torch.randint(0, 6, (rows,), generator=rng)
    pick[rows // 2 :] += 6 + torch.randint(0, VOCAB - 12, (rows - rows // 2,), generator=rng)
    labels = ranked.gather(1, pick[:, None])[:, 0]

    with torch.no_grad():
        _, candidates, q = ref.candidate_selector.select(
            hidden[:, None], logits[:, None], predecessors, temperature=1.0
        )
    candidates, q = candidates[:, 0], q[:, 0]  # [rows, K]
    match = candidates == labels[:, None]
    hit = match.any(-1)
    assert hit.tolist() == [True] * (rows // 2) + [False] * (rows - rows // 2)
    ce = -q.gather(1, match.int().argmax(-1, keepdim=True))[:, 0].log()
    expected = (weights * ce)[hit].sum() / weights[hit].sum()
    ref_pick = q.argmax(-1)

    grads = []
    for chunk_rows in (rows, 7):
        h = hidden.clone().requires_grad_(True)
        loss, in_candidates, correct = selector_loss(
            drafter, h, predecessors, labels, weights, chunk_rows=chunk_rows
        )
        assert torch.allclose(loss, expected, rtol=1e-5), (loss, expected)
        assert torch.equal(in_candidates, hit)
        assert torch.equal(correct, hit & (candidates.gather(1, ref_pick[:, None])[:, 0] == labels))
        drafter.zero_grad()
        loss.backward()
        grads.append((h.grad, drafter.candidate_selector.predecessor_codebook.weight.grad))
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*grads, strict=True))
    assert grads[0][0][~hit].abs().max() == 0 and grads[0][0][hit].abs().max() > 0


def test_selector_loss_without_candidate_labels_is_zero_safe(setup: dict[str, Path], rng) -> None:
    """No true token among the candidates: the loss is zero and every gradient exists and is
    zero (no 0 / 0)."""
    drafter, _ = random_drafter(setup, seed=int(torch.randint(0, 2**31, (1,), generator=rng)))
    drafter.requires_grad_(True)
    hidden = torch.randn(12, drafter.cfg.body.hidden_size, generator=rng, requires_grad=True)
    with torch.no_grad():
        labels = drafter.compute_logits(hidden).argmin(-1)  # never a top-6 candidate
    weights = torch.rand(12, generator=rng) + 0.1
    predecessors = torch.randint(0, VOCAB, (12,), generator=rng)
    loss, in_candidates, correct = selector_loss(drafter, hidden, predecessors, labels, weights)
    assert loss.item() == 0 and not in_candidates.any() and not correct.any()
    loss.backward()
    selector = drafter.candidate_selector
    for grad in (hidden.grad, *(p.grad for p in selector.parameters())):
        assert grad is not None and torch.isfinite(grad).all() and not grad.any()


def test_training_lowers_the_loss(setup: dict[str, Path], tmp_path: Path, rng) -> None:
    """A fresh DFlash2 drafter (random seed) trained 40 steps, measured over an epoch of fixed
    micro-batches: the loss falls and the selector picks the true token more often; the trained
    selector's loss beats that of the logits alone (its codebooks zeroed; in 40 of 40 seeds);
    the convolutions leave the identity they start as."""
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))
    trainer = Trainer(train_config(setup, tmp_path, steps=40, seed=seed, **SMALL))
    layer = trainer.drafter.layers[0]
    identity_taps = layer.attention_conv.base_kernel[:, 1:]
    assert not identity_taps.any() and not layer.mlp_conv.kernel_projection.weight.any()

    def measure() -> tuple[float, float, float]:  # loss, selector loss, selector's true picks
        with torch.no_grad():
            outs = [trainer.batch_loss(m) for m in range(6)]  # 24 samples, 4 per batch
        return tuple(sum(float(x) for x in values) for values in zip(
            *((o.loss, o.selector_loss, o.hits.sum()) for o in outs), strict=True
        ))  # fmt: skip

    before = measure()
    result = trainer.fit()
    after = measure()
    codebook = trainer.drafter.candidate_selector.predecessor_codebook.weight
    with torch.no_grad():
        codebook.zero_()
    logits_alone = measure()
    assert after[0] < before[0] - 6.0, (before, after)
    assert after[1] < logits_alone[1], (after, logits_alone)
    assert after[2] > before[2], (before, after)
    assert layer.attention_conv.base_kernel[:, 1:].abs().max() > 0
    assert layer.mlp_conv.kernel_projection.weight.abs().max() > 0
    log = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert len(log) == 40 and all(0 <= r["candidate_recall"] <= 1 for r in log)
    assert result.history[-1].selector_loss == log[-1]["selector_loss"]


def test_trained_checkpoint_loads_in_zlab_and_engine(
    setup: dict[str, Path], tmp_path: Path, rng
) -> None:
    """Training from a z-lab DFlash2 checkpoint (random convolutions, large codebooks): it
    starts from that checkpoint's weights, and the drafter it writes loads in z-lab's
    DFlash2DraftModel with every tensor in place; the engine's first drafts and logits are
    z-lab's (the selector, not the argmax, picks some), and its greedy output is plain
    decoding's."""
    target = setup["target"]
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))
    init = make_dflash2_drafter(
        tmp_path / "init", target, block_size=8, seed=seed, codebook_std=0.5, **SMALL
    )
    trainer = Trainer(train_config(setup, tmp_path / "out", steps=3, init_drafter=str(init)))
    params = dict(trainer.drafter.named_parameters())
    for name, tensor in load_file(init / "model.safetensors").items():
        assert torch.equal(params[trainer.drafter.checkpoint_name(name)], tensor), name
    trainer.fit()
    out = tmp_path / "out"
    saved = json.loads((out / "config.json").read_text())
    initial = json.loads((init / "config.json").read_text())
    assert saved["architectures"] == ["DFlash2DraftModel"]
    assert saved["dflash_config"] == initial["dflash_config"]
    assert set(load_file(out / "model.safetensors")) == set(load_file(init / "model.safetensors"))
    load_zlab_dflash2_strict(out)

    prompt, ref_logits, ref_proposals = prompt_where_selector_picks(target, out, rng, 13, VOCAB)
    spec = {
        "method": "dflash",
        "model": str(out),
        "num_speculative_tokens": 7,
        "num_speculative_tokens_by_batch": None,
    }
    llm = LLM(str(target), speculative_config=spec)
    seen = spy_draft_logits(llm)
    proposals = spy_proposals(llm)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)
    assert (seen[0] - ref_logits).abs().max() / ref_logits.abs().max() < 1e-4
    assert proposals[0][0].tolist() == ref_proposals

    prompts = [prompt] + [torch.randint(4, VOCAB, (n,), generator=rng).tolist() for n in (5, 9)]
    spec_out = llm.generate(prompts, params, use_tqdm=False)
    ar = LLM(str(target)).generate(prompts, params, use_tqdm=False)
    for a, s in zip(ar, spec_out, strict=True):
        assert s.outputs[0].token_ids == a.outputs[0].token_ids
    assert llm.engine.spec_stats.num_drafts > 0


def test_grown_drafter_starts_as_the_init(setup: dict[str, Path], tmp_path: Path, rng) -> None:
    """--grow-layers on a DFlash2 checkpoint: the added layer (identity convolutions, zero output
    projections) leaves the drafter's hidden states, hence its block and selector losses, as
    they were."""
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))
    init = make_dflash2_drafter(tmp_path / "init", setup["target"], block_size=8, seed=seed)
    kw = dict(steps=1, seed=seed, init_drafter=str(init))
    plain = Trainer(train_config(setup, tmp_path / "plain", **kw))
    grown = Trainer(train_config(setup, tmp_path / "grown", grow_layers=1, **kw))
    assert len(grown.drafter.layers) == len(plain.drafter.layers) + 1
    with torch.no_grad():
        a, b = plain.batch_loss(0), grown.batch_loss(0)
    assert torch.allclose(a.loss, b.loss, rtol=1e-5) and a.selector_loss > 0
    assert torch.allclose(a.selector_loss, b.selector_loss, rtol=1e-5)


def test_dflash_drafter_grows_into_dflash2(setup: dict[str, Path], tmp_path: Path, rng) -> None:
    """--arch dflash2 from a trained DFlash checkpoint: its layers load as they are, the
    convolutions start as the identity and the selector adds nothing, so the loss and the
    correct drafts are the DFlash drafter's; it trains and saves a DFlash2 checkpoint of the
    given shape that z-lab loads."""
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))
    dflash = Trainer(train_config(setup, tmp_path / "a", arch="dflash", steps=15, seed=seed))
    dflash.fit()  # some drafts right
    init = str(tmp_path / "a")
    grown = Trainer(
        train_config(
            setup,
            tmp_path / "b",
            steps=2,
            seed=seed,
            init_drafter=init,
            selector_loss_weight=0.0,
            **SMALL,
        )
    )
    assert isinstance(grown.drafter, DFlash2Drafter)
    with torch.no_grad():
        a, b = dflash.batch_loss(0), grown.batch_loss(0)
    assert torch.allclose(a.loss, b.loss, rtol=1e-5) and b.selector_loss > 0
    assert torch.equal(a.hits, b.hits) and a.hits.sum() > 0
    grown.fit()
    saved = json.loads((tmp_path / "b" / "config.json").read_text())
    assert saved["architectures"] == ["DFlash2DraftModel"]
    assert {k: saved["dflash_config"][k] for k in DFlash2Shape.__dataclass_fields__} == dict(
        conv_kernel_size=2, conv_group_size=16, **SMALL
    )
    load_zlab_dflash2_strict(tmp_path / "b")


def cli(setup: dict[str, Path], out: Path, *extra: str) -> None:
    cli_main(
        [
            "train-draft",
            "--model",
            str(setup["target"]),
            "--data",
            str(setup["data"]),
            "--out",
            str(out),
            "--block-size",
            "8",
            "--batch-size",
            "2",
            "--anchors",
            "4",
            "--quiet",
            *extra,
        ]
    )


def test_cli_options_and_errors(setup: dict[str, Path], tmp_path: Path, capsys) -> None:
    """`--arch dflash2` writes a DFlash2 drafter with the given shape (the published drafters'
    values where unset); DFlash2 options without it, a DFlash2 init drafter for a DFlash one, a
    shape other than the init drafter's, or bad values are refused by name (exit status 2)."""
    cli(setup, tmp_path / "ok", "--arch", "dflash2", "--steps", "2", "--selector-top-k", "5")
    saved = json.loads((tmp_path / "ok" / "config.json").read_text())
    assert saved["architectures"] == ["DFlash2DraftModel"]
    assert {k: saved["dflash_config"][k] for k in DFlash2Shape.__dataclass_fields__} == dict(
        conv_kernel_size=2, conv_group_size=16, selector_rank=256, selector_top_k=5
    )

    dflash2 = make_dflash2_drafter(tmp_path / "dflash2", setup["target"], block_size=8)
    bad = tmp_path / "bad"
    cases = [
        (("--selector-top-k", "4"), "selector_top_k: DFlash2 options; set arch='dflash2'"),
        (("--selector-loss-weight", "0.5"), "DFlash2 options"),
        (("--init-drafter", str(dflash2)), "arch='dflash' starts from a DFlashDraftModel"),
        (
            ("--arch", "dflash2", "--init-drafter", str(dflash2), "--conv-kernel-size", "2"),
            "conv_kernel_size=2 differs from init_drafter's 3",
        ),
        (("--arch", "dflash2", "--selector-rank", "0"), "selector_rank must be positive"),
        (("--arch", "dflash2", "--selector-loss-weight", "-1"), "selector_loss_weight must be"),
        (("--arch", "dflash2", "--conv-group-size", "7"), "conv_group_size 7 does not divide"),
        (("--arch", "dflash2", "--selector-top-k", "200"), "selector_top_k 200 exceeds vocab"),
    ]
    for args, message in cases:
        with pytest.raises(SystemExit) as exc:
            cli(setup, bad, "--steps", "1", *args)
        assert exc.value.code == 2
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli(setup, bad, "--arch", "dflash3")
    assert "invalid choice: 'dflash3'" in capsys.readouterr().err
    # The init drafter's own values may be repeated.
    cli(setup, tmp_path / "again", "--arch", "dflash2", "--init-drafter", str(dflash2),
        "--conv-kernel-size", "3", "--steps", "1")  # fmt: skip
