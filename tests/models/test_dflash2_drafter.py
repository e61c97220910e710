"""`blockdraft.models.dflash2_drafter` and `blockdraft.layers.dynamic_conv`: z-lab's
`DFlash2DraftModel` checkpoints load (published tensor names too), the convolution and the
selector's scores equal z-lab's, and config fields the engine cannot honour are named in a
ValueError."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from blockdraft.layers.dynamic_conv import GroupedDynamicCausalConv
from blockdraft.models.dflash2_drafter import DFlash2Config, DFlash2Drafter
from blockdraft.models.dflash_drafter import DFlashConfig, DFlashDrafter, load_drafter
from blockdraft.models.llama import DecoderLM, qwen3_config
from blockdraft.models.loader import read_json
from blockdraft.models.registry import resolve_drafter

from checkpoints import make_qwen3_checkpoint
from dflash2_checkpoints import load_zlab_dflash2, make_dflash2_drafter


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("dflash2")
    target = make_qwen3_checkpoint(root / "target")
    return target, make_dflash2_drafter(root / "drafter", target, block_size=8, seed=7)


def _target(target_dir: Path) -> DecoderLM:
    from blockdraft.models.loader import iter_checkpoint_tensors, load_weights, read_checkpoint

    ckpt = read_checkpoint(str(target_dir))
    model = DecoderLM(qwen3_config(ckpt.hf_config))
    load_weights(dict(model.named_parameters()), iter_checkpoint_tensors(ckpt), "target")
    return model.eval()


@pytest.mark.parametrize("fused", [False, True], ids=["", "fused-projection"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_dynamic_conv_matches_zlab_per_block(rng, set_policy, backend: str, fused: bool) -> None:
    """Flat rows of several blocks: each block convolved on its own, as z-lab's module
    convolves a batch of one block; the Triton kernels too, with the opening's projection and
    convolution in one kernel or not."""
    from dflash.model import GroupedDynamicCausalConv as ZlabConv

    set_policy(backend=backend, fuse_conv_projection=fused)

    hidden, kernel, group, block_len, blocks = 24, 3, 8, 5, 3
    ours = GroupedDynamicCausalConv(hidden, kernel, group)
    ref = ZlabConv(hidden, kernel, group)
    with torch.no_grad():
        ref.base_kernel.copy_(torch.randn(ref.base_kernel.shape, generator=rng))
        ref.kernel_projection.weight.copy_(
            torch.randn(ref.kernel_projection.weight.shape, generator=rng) * 0.3
        )
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(blocks * block_len, hidden, generator=rng)
    y = torch.randn(blocks * block_len, hidden, generator=rng)
    with torch.no_grad():  # as the engine runs it (the kernels have no backward)
        out, dynamic = ours.prepare(x, block_len)
        out2 = ours.finish(y, dynamic, block_len)
    for b in range(blocks):
        rows = slice(b * block_len, (b + 1) * block_len)
        want, want_dynamic = ref.prepare(x[None, rows])
        torch.testing.assert_close(out[rows], want[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(
            out2[rows], ref.finish(y[None, rows], want_dynamic)[0], rtol=1e-5, atol=1e-5
        )


def test_loads_zlab_checkpoint_and_selector_scores_match(pair, rng) -> None:
    """Every tensor of z-lab's checkpoint lands in our module (bare codebook names); the
    selector's scores for the chosen predecessors are z-lab's, its greedy path is z-lab's."""
    target_dir, drafter_dir = pair
    cfg, cls = resolve_drafter(read_json(drafter_dir / "config.json"))
    assert cls is DFlash2Drafter and isinstance(cfg, DFlash2Config)
    assert (cfg.conv_kernel_size, cfg.conv_group_size, cfg.selector_rank) == (3, 16, 8)
    assert cfg.selector_top_k == 6
    assert "candidate_selector.predecessor_codebook" in load_file(drafter_dir / "model.safetensors")
    target = _target(target_dir)
    ours = load_drafter(
        str(drafter_dir),
        target,
        256,
        torch.float32,
        torch.device("cpu"),
        cfg=cfg,
        drafter_class=cls,
    )
    ref = load_zlab_dflash2(drafter_dir)
    ref_state = ref.state_dict()
    for name, param in ours.named_parameters():
        if not name.startswith(("embed_tokens", "lm_head")):
            assert torch.equal(param, ref_state[name]), name

    r, n, vocab = 3, 7, cfg.body.vocab_size
    hidden = torch.randn(r, n, cfg.body.hidden_size, generator=rng)
    logits = torch.randn(r, n, vocab, generator=rng) * 3
    anchors = torch.randint(0, vocab, (r,), generator=rng)
    with torch.no_grad():
        candidates, scores = ours.candidate_selector.transition_scores(hidden, logits, anchors)
        path, ref_candidates, _ = ref.candidate_selector.select(hidden, logits, anchors, 0.0)
    assert torch.equal(candidates.sort(-1).values, ref_candidates.sort(-1).values)
    previous = anchors
    for i in range(n):  # the reference's scores of position i after its own pick at i - 1
        sel = ref.candidate_selector
        h = sel.hidden_projection(hidden[:, i])
        want = logits[:, i].gather(1, candidates[:, i]) + torch.einsum(
            "br,bkr->bk",
            sel.predecessor_codebook(previous) * h,
            sel.successor_codebook(candidates[:, i]),
        )
        j = (candidates[:, i - 1] == previous[:, None]).int().argmax(-1) if i else 0
        got = scores[torch.arange(r), i, j]
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-5)
        previous = path[:, i]
        k = scores[torch.arange(r), i, j].argmax(-1)
        assert torch.equal(candidates[torch.arange(r), i, k], previous)


def test_published_tensor_names_load(pair, tmp_path: Path) -> None:
    """`encoder.fc.weight` (the fusion nested under `encoder.`) loads as `fc.weight`; a mask
    embedding shipped with the drafter is refused by name."""
    target_dir, drafter_dir = pair
    target = _target(target_dir)
    renamed = tmp_path / "renamed"
    shutil.copytree(drafter_dir, renamed)
    tensors = load_file(renamed / "model.safetensors")
    tensors["encoder.fc.weight"] = tensors.pop("fc.weight")
    save_file(tensors, renamed / "model.safetensors")
    cfg, cls = resolve_drafter(read_json(renamed / "config.json"))
    a = load_drafter(
        str(drafter_dir),
        target,
        256,
        torch.float32,
        torch.device("cpu"),
        cfg=cfg,
        drafter_class=cls,
    )
    b = load_drafter(
        str(renamed), target, 256, torch.float32, torch.device("cpu"), cfg=cfg, drafter_class=cls
    )
    assert torch.equal(a.fc.weight, b.fc.weight)
    tensors["mask_embedding"] = torch.zeros(tensors["encoder.fc.weight"].shape[0])
    save_file(tensors, renamed / "model.safetensors")
    with pytest.raises(ValueError, match="mask embedding.*'mask_embedding'"):
        load_drafter(
            str(renamed),
            target,
            256,
            torch.float32,
            torch.device("cpu"),
            cfg=cfg,
            drafter_class=cls,
        )


def test_dummy_weights_fill_every_drafter_tensor(pair) -> None:
    """Random weights for a DFlash2 drafter whose config load_drafter reads itself (by the
    drafter class's config_class), its convs and selector included."""
    target_dir, drafter_dir = pair
    target = _target(target_dir)
    drafter = load_drafter(
        str(drafter_dir),
        target,
        256,
        torch.float32,
        torch.device("cpu"),
        True,
        drafter_class=DFlash2Drafter,
    )
    assert isinstance(drafter.cfg, DFlash2Config)
    book = drafter.candidate_selector.successor_codebook.weight
    conv = drafter.layers[0].mlp_conv.base_kernel
    assert book.std() > 0.01 and conv.std() > 0.01


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: c["dflash_config"].pop("selector_top_k"), "no selector_top_k"),
        (lambda c: c["dflash_config"].pop("conv_kernel_size"), "no conv_kernel_size"),
        (lambda c: c["dflash_config"].update(conv_group_size=7), "conv_group_size 7"),
        (lambda c: c["dflash_config"].update(selector_top_k=10_000), "selector_top_k 10000"),
        (lambda c: c["dflash_config"].update(selector_rank=0), "selector_rank=0"),
        (lambda c: c.update(attention_sink_bias=True), "attention_sink_bias"),
        (lambda c: c.update(use_swa=True, swa_window_size=64), "use_swa"),
        (lambda c: c["dflash_config"].update(is_neox_style=False), "is_neox_style"),
        (lambda c: c.update(target_hidden_size=128), "target_hidden_size"),
        (lambda c: c.update(architectures=["Qwen3ForCausalLM"]), "DFlash2DraftModel"),
    ],
)
def test_config_fields_it_cannot_honour_are_named(pair, edit, message) -> None:
    cfg = read_json(pair[1] / "config.json")
    edit(cfg)
    with pytest.raises(ValueError, match=message):
        resolve_drafter(cfg)


def test_harmless_field_values_load(pair) -> None:
    """The published defaults of those fields need no support."""
    cfg = read_json(pair[1] / "config.json")
    cfg.update(attention_sink_bias=False, use_swa=False, swa_window_size=2048, is_neox_style=True)
    cfg["target_hidden_size"] = cfg["hidden_size"]
    parsed, cls = resolve_drafter(cfg)
    assert cls is DFlash2Drafter and parsed.selector_top_k == 6
    dflash = json.loads(json.dumps(cfg))
    dflash["architectures"] = ["DFlashDraftModel"]
    parsed, cls = resolve_drafter(dflash)
    assert cls is DFlashDrafter and type(parsed) is DFlashConfig
