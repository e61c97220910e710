"""Drafter training: data regeneration, anchors and block masks, the training forward against
z-lab's drafter and our engine, checkpoints, resume, and a loss that falls."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from blockdraft import LLM, SamplingParams
from blockdraft.cli import main as cli_main
from blockdraft.models.dflash_drafter import DFlashDrafter, load_drafter
from blockdraft.models.registry import resolve_drafter
from blockdraft.train import (
    TrainConfig,
    build_block_mask,
    load_prompts,
    load_samples,
    load_sharegpt_prompts,
    pack_blocks,
    regenerate,
    sample_anchors,
)
from blockdraft.train.blocks import IGNORE_INDEX, BlockLayout
from blockdraft.train.drafter import (
    DFlash2Shape,
    TargetFeatures,
    block_loss,
    default_mask_token_id,
    dense_attend,
    drafter_hf_config,
    drafter_train_forward,
    init_drafter_weights,
    load_target,
    save_drafter,
)
from blockdraft.train.trainer import BatchSchedule, Trainer

from checkpoints import (
    MASK_ID,
    load_hf_target,
    load_zlab_drafter,
    make_qwen3_checkpoint,
    zlab_first_draft_logits,
)
from dflash2_checkpoints import load_zlab_dflash2_strict
from spies import spy_draft_logits

VOCAB = 128
MAX_TOKENS = 48


def write_prompts(path: Path, count: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(count):
            words = " ".join(f"w{rng.randrange(7, VOCAB)}" for _ in range(rng.randrange(3, 12)))
            f.write(json.dumps({"messages": [{"role": "user", "content": words}]}) + "\n")
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("train")
    target = make_qwen3_checkpoint(root / "target", seed=0)
    prompts = write_prompts(root / "prompts.jsonl", 40)
    data = regenerate(
        prompts,
        root / "data.jsonl",
        model=str(target),
        max_tokens=MAX_TOKENS,
        max_prompt_tokens=64,
        use_tqdm=False,
    )
    return {"root": root, "target": target, "prompts": prompts, "data": data}


def train_config(setup: dict[str, Path], out: Path, **kw: object) -> TrainConfig:
    args: dict = dict(
        out_dir=str(out),
        data=str(setup["data"]),
        model=str(setup["target"]),
        batch_size=4,
        anchors=16,
        block_size=8,
        lr=3e-3,
        use_tqdm=False,
    )
    args.update(kw)
    return TrainConfig(**args)


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------


def test_prompt_formats(tmp_path: Path) -> None:
    chat = tmp_path / "chat.jsonl"
    records = [
        {
            "messages": [
                {"role": "system", "content": "S"},
                {"role": "user", "content": "A"},
                {"role": "assistant", "content": "x"},
                {"role": "user", "content": "y"},
            ]
        },
        {"conversations": [{"from": "gpt", "value": "hi"}, {"from": "human", "value": "B"}]},
        {"conversations": [{"from": "gpt", "value": "no human turn"}]},
        {"messages": [{"role": "user", "content": "A"}, {"role": "system", "content": "S"}]},
        {"prompt": "C"},
    ]
    chat.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert load_prompts(chat) == [
        [{"role": "system", "content": "S"}, {"role": "user", "content": "A"}],
        [{"role": "user", "content": "B"}],
        [{"role": "user", "content": "A"}],
        [{"role": "user", "content": "C"}],
    ]
    assert len(load_prompts(chat, limit=2)) == 2
    text = tmp_path / "prompts.txt"
    text.write_text("first prompt\n\nsecond prompt\nfirst prompt\n")
    assert load_prompts(text) == [
        [{"role": "user", "content": "first prompt"}],
        [{"role": "user", "content": "second prompt"}],
    ]


def test_sharegpt_truncated_json(tmp_path: Path) -> None:
    """The PyPI dump is a JSON array cut off mid-record: every whole record is read."""
    convs = [
        {
            "id": str(i),
            "conversations": [
                {"from": "system", "value": "be nice"},
                {"from": "human", "value": f"question {i} " + "x" * (50 * i)},
                {"from": "gpt", "value": "answer"},
            ],
        }
        for i in range(30)
    ]
    convs[3]["conversations"] = [{"from": "gpt", "value": "only a bot"}]
    convs[4]["conversations"] = []
    text = json.dumps(convs, indent=2)
    cut = text[: text.index('"id": "29"') + 30]  # inside the last record
    path = tmp_path / "sharegpt.json"
    path.write_text(cut)
    prompts = load_sharegpt_prompts(path)
    expected = [i for i in range(29) if i not in (3, 4)]
    assert [p[0]["content"].split()[1] for p in prompts] == [str(i) for i in expected]
    assert all(len(p) == 1 and p[0]["role"] == "user" for p in prompts)
    assert len(load_sharegpt_prompts(path, limit=5)) == 5
    # Small read chunks: records spanning many chunks are still parsed.
    from blockdraft.train.data import iter_json_array

    assert len(list(iter_json_array(path, chunk_chars=64))) == 29


def test_sharegpt_all_turns(tmp_path: Path) -> None:
    """`all_turns` gives one prompt per human turn with the conversation before it."""
    rng = random.Random()
    convs, expected = [], []
    for c in range(12):
        turns, chat = [], []
        for t in range(rng.randint(1, 4)):
            q, a = f"q{c}.{t} {rng.random()}", f"a{c}.{t}"
            turns += [{"from": "human", "value": q}, {"from": "gpt", "value": a}]
            expected.append([*chat, {"role": "user", "content": q}])
            chat += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        convs.append({"id": str(c), "conversations": turns})
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(convs))
    assert load_sharegpt_prompts(path, all_turns=True) == expected
    assert load_sharegpt_prompts(path, limit=3, all_turns=True) == expected[:3]
    assert load_sharegpt_prompts(path) == [[e[0]] for e in expected if len(e) == 1]


@pytest.mark.slow
def test_regenerate_matches_llm_and_resumes(setup: dict[str, Path], tmp_path: Path) -> None:
    prompts = load_prompts(setup["prompts"])[:10]
    out = tmp_path / "data.jsonl"
    regenerate(
        prompts[:4],
        out,
        model=str(setup["target"]),
        max_tokens=MAX_TOKENS,
        max_prompt_tokens=64,
        use_tqdm=False,
    )
    assert len(load_samples(out)) == 4
    llm = LLM(str(setup["target"]), max_model_len=128)
    # Re-run over all prompts (in batches of 4): only the 6 new ones are generated.
    regenerate(prompts, out, llm=llm, max_tokens=MAX_TOKENS, batch_size=4, use_tqdm=False)
    samples = load_samples(out)
    assert len(samples) == 10 and len({s.key for s in samples}) == 10
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    by_chat = llm.chat(prompts, params, use_tqdm=False)
    for sample, ref in zip(samples, by_chat, strict=True):
        assert sample.loss_start == len(ref.prompt_token_ids)
        assert sample.input_ids == ref.prompt_token_ids + ref.outputs[0].token_ids
    by_generate = llm.generate(
        [s.input_ids[: s.loss_start] for s in samples], params, use_tqdm=False
    )
    assert [s.input_ids[s.loss_start :] for s in samples] == [
        o.outputs[0].token_ids for o in by_generate
    ]
    # Sampled regeneration is seeded per prompt: resuming gives what one go gives.
    one_go, split = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    kw = dict(llm=llm, max_tokens=16, temperature=1.0, use_tqdm=False)
    regenerate(prompts[:6], one_go, **kw)
    regenerate(prompts[:2], split, **kw)
    regenerate(prompts[:6], split, **kw)
    assert [s.input_ids for s in load_samples(one_go)] == [s.input_ids for s in load_samples(split)]
    assert [s.input_ids for s in load_samples(one_go)] != [s.input_ids for s in samples[:6]]


def test_regenerate_continues_a_final_assistant_message(
    setup: dict[str, Path], tmp_path: Path
) -> None:
    """A prompt chat ending with an assistant message is continued (vLLM's
    continue_final_message): the prompt ids are the template's text up to that message's content,
    with no end-of-turn or generation prompt after it, and the response is what `LLM.chat` gives."""
    rng = random.Random()
    words = lambda n: " ".join(f"w{rng.randrange(7, VOCAB)}" for _ in range(n))  # noqa: E731
    chats = [
        [
            {"role": "user", "content": words(rng.randint(2, 6))},
            {"role": "assistant", "content": words(rng.randint(1, 5))},
        ]
        for _ in range(3)
    ]
    llm = LLM(str(setup["target"]), max_model_len=128)
    tok = llm.tokenizer
    out = regenerate(chats, tmp_path / "cont.jsonl", llm=llm, max_tokens=12, use_tqdm=False)
    samples = load_samples(out)
    assert len(samples) == 3
    ref = llm.chat(
        chats,
        SamplingParams(temperature=0.0, max_tokens=12),
        use_tqdm=False,
        add_generation_prompt=False,
        continue_final_message=True,
    )
    for chat, sample, r in zip(chats, samples, ref, strict=True):
        user, answer = chat[0]["content"], chat[1]["content"]
        # the test template: "w4 {content} w5 " per message, "w6" as the generation prompt
        assert sample.input_ids[: sample.loss_start] == tok.encode(
            f"w4 {user} w5 w4 {answer}", add_special_tokens=False
        )
        assert sample.input_ids == r.prompt_token_ids + r.outputs[0].token_ids
    with pytest.raises(ValueError, match="assistant message last"):
        llm.chat(chats[0][:1], add_generation_prompt=False, continue_final_message=True)
    with pytest.raises(ValueError, match="exclude each other"):
        llm.chat(chats[0], continue_final_message=True)


# ---------------------------------------------------------------------------------------------
# Anchors and masks
# ---------------------------------------------------------------------------------------------


def test_anchor_sampling_brute_force() -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        seq_len = int(torch.randint(1, 40, (1,), generator=g))
        loss_start = int(torch.randint(0, seq_len + 1, (1,), generator=g))
        n = int(torch.randint(0, 30, (1,), generator=g))
        anchors = sample_anchors(seq_len, loss_start, n, g).tolist()
        in_response = [loss_start <= i < seq_len for i in range(seq_len + 1)]
        valid = [a for a in range(seq_len) if in_response[a] and in_response[a + 1]]
        assert len(anchors) == min(n, len(valid))
        assert len(set(anchors)) == len(anchors) and anchors == sorted(anchors)
        assert all(a in valid for a in anchors)
    # A few anchors of a long response: every epoch draws new ones.
    counts = [set(sample_anchors(200, 10, 8, g).tolist()) for _ in range(2)]
    assert counts[0] != counts[1]


def test_batch_schedule_redraws_anchors_per_epoch(setup: dict[str, Path]) -> None:
    samples = load_samples(setup["data"])[:4]
    cfg = TrainConfig(out_dir="unused", data="unused", batch_size=4, anchors=4, device="cpu")
    schedule = BatchSchedule(samples, cfg)
    epoch0, anchors0 = schedule.micro_batch(0)
    epoch1, anchors1 = schedule.micro_batch(1)
    assert sorted(s.key for s in epoch0) == sorted(s.key for s in epoch1)
    first = {s.key: a.tolist() for s, a in zip(epoch0, anchors0, strict=True)}
    second = {s.key: a.tolist() for s, a in zip(epoch1, anchors1, strict=True)}
    assert first != second
    again = BatchSchedule(samples, cfg).micro_batch(1)[1]  # a pure function of (seed, m)
    assert all(torch.equal(a, b) for a, b in zip(again, anchors1, strict=True))


def reference_mask(
    seqs: list[list[int]], anchors: list[list[int]], b: int, causal: bool, window: int | None
) -> list[list[bool]]:
    """The block mask with explicit loops: rows = blocks in order, keys = context then rows."""
    context = [(s, j) for s, tokens in enumerate(seqs) for j in range(len(tokens))]
    rows = [
        (s, blk, a, a + i)
        for s, anchor_list in enumerate(anchors)
        for blk, a in enumerate(anchor_list)
        for i in range(b)
    ]
    mask = []
    for s, blk, a, p in rows:
        line = []
        for cs, j in context:
            ok = cs == s and j < a
            if window is not None:
                ok = ok and p - j < window
            line.append(ok)
        for ks, kblk, _, kp in rows:
            ok = ks == s and kblk == blk
            if causal:
                ok = ok and kp <= p
            if window is not None:
                ok = ok and p - kp < window and (causal or kp - p < window)
            line.append(ok)
        mask.append(line)
    return mask


@pytest.mark.parametrize("causal,window", [(False, None), (True, 3), (False, 3), (True, None)])
def test_block_mask_matches_brute_force(causal: bool, window: int | None) -> None:
    g = torch.Generator().manual_seed(1)
    b = 4
    seqs = [torch.randint(4, VOCAB, (n,), generator=g).tolist() for n in (11, 6, 15)]
    anchors = [[2, 5, 9], [4], [3, 12, 13]]  # 9, 12, 13: blocks run past the sequence end
    layout = pack_blocks(seqs, [torch.tensor(a) for a in anchors], b, MASK_ID)
    mask = build_block_mask(layout, causal, window)
    assert mask.tolist() == reference_mask(seqs, anchors, b, causal, window)
    row = 0
    for tokens, anchor_list in zip(seqs, anchors, strict=True):
        for a in anchor_list:
            for i in range(b):
                assert layout.q_pos[row] == a + i
                assert layout.block_ids[row] == (tokens[a] if i == 0 else MASK_ID)
                label = tokens[a + i] if 0 < i and a + i < len(tokens) else IGNORE_INDEX
                assert layout.labels[row] == label
                row += 1


# ---------------------------------------------------------------------------------------------
# The training forward is the drafter of the engine and of z-lab
# ---------------------------------------------------------------------------------------------


def build_drafter(
    setup: dict[str, Path], **kw: object
) -> tuple[DFlashDrafter, dict, TargetFeatures]:
    """A fresh drafter for the test target, its config.json dict, and its target's features.
    A DFlash2 drafter (`dflash2=DFlash2Shape(...)`) gets random convolutions, not identities."""
    target, tokenizer, hf = load_target(
        str(setup["target"]), torch.float32, torch.device("cpu"), 256
    )
    cfg = drafter_hf_config(hf, mask_token_id=default_mask_token_id(tokenizer, hf), **kw)
    dcfg, drafter_class = resolve_drafter(cfg)
    drafter = drafter_class(dcfg, target, 256)
    init_drafter_weights(drafter, seed=3, std=0.1)  # large weights: a sharp comparison
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "_conv." in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            if name.endswith("base_kernel"):
                p[:, 0] += 1.0
    target.capture_layer_ids = drafter.cfg.target_layer_ids
    return drafter, cfg, TargetFeatures(target)


def packed_case(
    drafter: DFlashDrafter, b: int
) -> tuple[list[list[int]], list[torch.Tensor], BlockLayout]:
    """Three sequences, nine blocks; some blocks start at 0 or run past the sequence end."""
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(4, VOCAB, (n,), generator=g).tolist() for n in (17, 9, 24)]
    anchors = [torch.tensor(a) for a in ([3, 8, 15], [1, 7], [0, 11, 20, 22])]
    return seqs, anchors, pack_blocks(seqs, anchors, b, drafter.cfg.mask_token_id)


def train_logits(
    drafter: DFlashDrafter,
    layout: BlockLayout,
    features: torch.Tensor,  # [C, K * hidden]
) -> torch.Tensor:  # [Q, V]
    kinds = set(zip(drafter.cfg.layer_causal, drafter.cfg.layer_window, strict=True))
    attend = dense_attend(drafter, {k: build_block_mask(layout, *k) for k in kinds})
    with torch.no_grad():
        hidden = drafter_train_forward(
            drafter,
            features,
            layout.ctx_pos,
            layout.block_ids,
            layout.q_pos,
            attend,
            block_len=layout.block_size,
        )
        return drafter.compute_logits(hidden)


@pytest.mark.parametrize("kind", ["full", "sliding", "dflash2"])
def test_packed_forward_matches_zlab_per_block(
    setup: dict[str, Path], tmp_path: Path, kind: str
) -> None:
    """Every block of a packed batch gets the logits z-lab's DFlashDraftModel (DFlash2DraftModel:
    its convolutions within the block) computes for that block alone (context = the target's
    hidden states before its anchor), after a save and a load by z-lab with every tensor in
    place; and our load_drafter reproduces the trained module bit for bit."""
    import dflash.model as zlab

    b = 6
    extra = {
        "full": {},
        "sliding": dict(
            num_layers=2,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=4,
            target_layer_ids=[0, 3],
        ),
        "dflash2": dict(num_layers=2, dflash2=DFlash2Shape(3, 16, 8, 6)),
    }[kind]
    drafter, cfg, target_features = build_drafter(setup, block_size=b, **extra)
    out = save_drafter(drafter, cfg, tmp_path / "drafter", torch.float32)
    seqs, anchors, layout = packed_case(drafter, b)
    features = target_features(layout.input_ids, layout.seq_lens)
    ours = train_logits(drafter, layout, features)

    loaded = load_drafter(
        str(out),
        target_features.target,
        256,
        torch.float32,
        torch.device("cpu"),
        drafter_class=type(drafter),
    )
    assert torch.equal(train_logits(loaded, layout, features), ours)

    hf_target = load_hf_target(setup["target"])
    ref_model = load_zlab_dflash2_strict(out) if kind == "dflash2" else load_zlab_drafter(out)
    row = 0
    for tokens, anchor_list in zip(seqs, anchors, strict=True):
        ids = torch.tensor([tokens])
        with torch.no_grad():
            states = hf_target(ids, output_hidden_states=True).hidden_states
            context = zlab.extract_context_feature(states, ref_model.target_layer_ids)
            for a in anchor_list.tolist():
                block = torch.full((1, b), drafter.cfg.mask_token_id)
                block[0, 0] = tokens[a]
                hidden = ref_model(
                    position_ids=torch.arange(a + b)[None],
                    noise_embedding=hf_target.get_input_embeddings()(block),
                    target_hidden=context[:, :a],
                )
                ref = ref_model.compute_logits(hidden, hf_target.lm_head)[0]
                got = ours[row : row + b]
                assert (got - ref).abs().max() / ref.abs().max() < 1e-4, (a, kind)
                row += b


def test_engine_and_zlab_agree_on_a_trained_checkpoint(
    setup: dict[str, Path], tmp_path: Path
) -> None:
    """A checkpoint written by the trainer: the engine's first draft equals z-lab's, and the
    engine's acceptance length is what the evaluation reports."""
    cfg = train_config(setup, tmp_path / "out", steps=3, eval_holdout=3, eval_max_tokens=12)
    trainer = Trainer(cfg)
    result = trainer.fit()
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["dflash_config"] == {"mask_token_id": MASK_ID, "target_layer_ids": [2]}
    assert config["block_size"] == 8 and config["num_target_layers"] == 4
    prompt = load_samples(setup["data"])[-1].input_ids[:9]
    ref = zlab_first_draft_logits(setup["target"], tmp_path / "out", prompt)
    llm = LLM(
        str(setup["target"]),
        speculative_config={
            "method": "dflash",
            "model": str(tmp_path / "out"),
            "num_speculative_tokens": 7,
            "num_speculative_tokens_by_batch": None,  # drafts from the first step
        },
    )
    seen = spy_draft_logits(llm)
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert (seen[0] - ref).abs().max() / ref.abs().max() < 1e-4
    assert result.eval_acceptance_length is not None and result.eval_acceptance_length >= 1.0
    saved = json.loads((tmp_path / "out" / "eval.json").read_text())
    assert saved["eval_acceptance_length"] == result.eval_acceptance_length


@pytest.mark.slow
def test_flex_attention_matches_dense(setup: dict[str, Path]) -> None:
    """FlexAttention (eager; torch has no CPU backward for it, so forward only) over padded
    lengths gives the dense path's hidden states and loss, on causal sliding and full layers."""
    from torch.nn.attention.flex_attention import flex_attention

    from blockdraft.train.blocks import MaskTensors, build_flex_block_mask
    from blockdraft.train.drafter import flex_attend

    b = 4
    drafter, _, target_features = build_drafter(
        setup,
        num_layers=2,
        block_size=b,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=3,
    )
    _, _, layout = packed_case(drafter, b)
    features = target_features(layout.input_ids, layout.seq_lens)
    kinds = set(zip(drafter.cfg.layer_causal, drafter.cfg.layer_window, strict=True))
    assert kinds == {(True, 3), (False, None)}
    pad_c, pad_q = 128, 128
    tensors = MaskTensors.from_layout(layout, pad_c, pad_q)
    attend = flex_attend(
        drafter,
        {k: build_flex_block_mask(tensors, *k) for k in kinds},
        layout.num_context,
        layout.num_queries,
        pad_c,
        pad_q,
        flex_attention,
    )
    dense = dense_attend(drafter, {k: build_block_mask(layout, *k) for k in kinds})
    rows = (layout.labels != IGNORE_INDEX).nonzero().squeeze(1)
    weights = torch.exp(-(layout.offsets[rows] - 1).float() / 7)
    with torch.no_grad(), pytest.warns(UserWarning, match="without torch.compile"):
        args = (features, layout.ctx_pos, layout.block_ids, layout.q_pos)
        h_flex = drafter_train_forward(drafter, *args, attend)
    with torch.no_grad():
        h_dense = drafter_train_forward(drafter, *args, dense)
        loss_flex = block_loss(drafter, h_flex[rows], layout.labels[rows], weights)[0]
        loss_dense = block_loss(drafter, h_dense[rows], layout.labels[rows], weights)[0]
    assert torch.allclose(h_flex, h_dense, atol=1e-5)
    assert torch.allclose(loss_flex, loss_dense, rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_training_via_cli_lowers_the_loss(setup: dict[str, Path], tmp_path: Path) -> None:
    """`blockdraft train-draft` from raw prompts: regenerates, trains 60 steps, saves, evaluates."""
    out = tmp_path / "drafter"
    cli_main(
        [
            "train-draft",
            "--model",
            str(setup["target"]),
            "--data",
            str(setup["prompts"]),
            "--out",
            str(out),
            "--max-tokens",
            str(MAX_TOKENS),
            "--max-prompt-tokens",
            "64",
            "--steps",
            "60",
            "--batch-size",
            "4",
            "--anchors",
            "16",
            "--block-size",
            "8",
            "--lr",
            "3e-3",
            "--eval-holdout",
            "4",
            "--eval-max-tokens",
            "16",
            "--quiet",
        ]
    )
    assert [s.input_ids for s in load_samples(out / "data.jsonl")] == [
        s.input_ids for s in load_samples(setup["data"])
    ]
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in log]
    assert [r["step"] for r in log] == list(range(1, 61))
    first, last = sum(losses[:5]) / 5, sum(losses[-10:]) / 10
    assert last < first - 1.0, losses
    assert len(log[-1]["accuracy"]) == 7
    # The engine with the trained drafter accepts more than a random drafter would (~1).
    tau = json.loads((out / "eval.json").read_text())["eval_acceptance_length"]
    assert tau > 1.2
    assert (out / "model.safetensors").is_file()


def test_resume_continues_from_the_saved_step(setup: dict[str, Path], tmp_path: Path) -> None:
    straight = Trainer(train_config(setup, tmp_path / "a", steps=6, grad_accum=2))
    full = straight.fit()
    first = Trainer(
        train_config(setup, tmp_path / "b", steps=6, grad_accum=2, save_every=2, stop_after=3)
    )
    part = first.fit()
    assert part.step == 3 and [s.step for s in part.history] == [1, 2, 3]
    saved = sorted(p.name for p in (tmp_path / "b" / "checkpoints").iterdir())
    assert saved == ["step_000002", "step_000003"]
    resumed = Trainer(
        train_config(setup, tmp_path / "b", steps=6, grad_accum=2, save_every=2, resume=True)
    )
    assert resumed.step == 3
    rest = resumed.fit()
    assert [s.step for s in rest.history] == [4, 5, 6]
    for a, b in zip(full.history[3:], rest.history, strict=True):
        assert a.loss == pytest.approx(b.loss, rel=1e-5)
        assert a.lr == pytest.approx(b.lr, rel=1e-9)
    for (name, p), q in zip(
        straight.drafter.named_parameters(), resumed.drafter.parameters(), strict=True
    ):
        assert torch.allclose(p, q, atol=1e-6), name


def test_time_limit_stops_with_a_resumable_checkpoint(
    setup: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A spent wall-clock budget stops training at a step boundary with a checkpoint, and a
    resumed run (whose RNG state comes back as CPU tensors) finishes the schedule."""
    import blockdraft.train.trainer as trainer_module

    clock = iter(range(1000))  # each reading of the clock: one "second" later
    monkeypatch.setattr(trainer_module.time, "monotonic", lambda: float(next(clock)))
    first = Trainer(train_config(setup, tmp_path, steps=8, time_limit_s=3.5))
    part = first.fit()
    assert 0 < part.step < 8
    saved = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert saved == [f"step_{part.step:06d}"]
    monkeypatch.undo()
    rest = Trainer(train_config(setup, tmp_path, steps=8, resume=True)).fit()
    assert rest.step == 8 and rest.history[0].step == part.step + 1
    assert (tmp_path / "model.safetensors").is_file()


def test_grown_drafter_starts_as_the_trained_one(
    setup: dict[str, Path], tmp_path: Path, rng
) -> None:
    """--grow-layers: the trained layers are loaded, the added ones start as the identity
    (zero output projections, other weights random), so the deeper drafter's logits equal the
    trained drafter's; the target layers stay pinned; it trains and saves as a z-lab
    checkpoint with the new depth."""
    small = Trainer(train_config(setup, tmp_path / "small", steps=2, num_layers=2))
    small.fit()
    grown = Trainer(
        train_config(
            setup, tmp_path / "grown", steps=2, init_drafter=str(tmp_path / "small"), grow_layers=2
        )
    )
    params = dict(grown.drafter.named_parameters())
    assert grown.dcfg.body.num_layers == 4
    assert grown.dcfg.target_layer_ids == small.dcfg.target_layer_ids
    for name, p in small.drafter.named_parameters():
        if p.requires_grad:
            assert torch.equal(params[name], p), name
    for i in (2, 3):
        assert not params[f"layers.{i}.self_attn.o_proj.weight"].any()
        assert not params[f"layers.{i}.mlp.down_proj.weight"].any()
        assert params[f"layers.{i}.self_attn.q_proj.weight"].abs().sum() > 0

    b = small.cfg.block_size
    seqs = [torch.randint(4, VOCAB, (n,), generator=rng).tolist() for n in (19, 11)]
    anchors = [torch.tensor([2, 9, 15]), torch.tensor([0, 6])]
    layout = pack_blocks(seqs, anchors, b, small.dcfg.mask_token_id)
    features = small.features(layout.input_ids, layout.seq_lens)
    ref = train_logits(small.drafter, layout, features)
    got = train_logits(grown.drafter, layout, features)
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5)

    grown.fit()
    saved = json.loads((tmp_path / "grown" / "config.json").read_text())
    assert saved["num_hidden_layers"] == 4 and len(saved["layer_types"]) == 4
    assert saved["dflash_config"]["target_layer_ids"] == list(small.dcfg.target_layer_ids)
    loaded = load_drafter(
        str(tmp_path / "grown"), grown.target, 256, torch.float32, torch.device("cpu")
    )
    assert loaded.layers[3].self_attn.o_proj.weight.abs().sum() > 0  # it trained
    with pytest.raises(ValueError, match="grow_layers"):
        train_config(setup, tmp_path / "bad", grow_layers=1)
    gguf_drafter = tmp_path / "drafter.gguf"  # the engine loads these; training starts from z-lab's
    gguf_drafter.write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="give a z-lab directory"):
        train_config(setup, tmp_path / "bad", init_drafter=str(gguf_drafter))
