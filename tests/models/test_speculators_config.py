"""vLLM speculators drafter configs: translated into z-lab's DFlash config, and every field we
would not run exactly as trained refused by name."""

import copy
import json
from pathlib import Path

import pytest

from blockdraft.models.dflash_drafter import DFlashConfig
from blockdraft.models.speculators_config import QWEN3_DEFAULTS, dflash_config_from_speculators

from checkpoints import make_dflash_drafter, make_qwen3_checkpoint, make_speculators_drafter


@pytest.fixture(scope="module")
def drafters(tmp_path_factory) -> tuple[dict, dict]:
    """(z-lab config.json, the same drafter's speculators config.json with 40 draft tokens)."""
    root = tmp_path_factory.mktemp("spec-config")
    target = make_qwen3_checkpoint(root / "target")
    zlab = make_dflash_drafter(root / "zlab", target, num_layers=3, block_size=8)
    spec = make_speculators_drafter(root / "spec", zlab, target, list(range(0, 120, 3)))
    return tuple(json.loads((d / "config.json").read_text()) for d in (zlab, spec))


def test_translates_to_the_zlab_config(drafters) -> None:
    zlab, spec = drafters
    assert "hidden_act" not in spec["transformer_layer_config"]  # left out at its default
    ours, theirs = (
        DFlashConfig.from_hf(dflash_config_from_speculators(spec)),
        DFlashConfig.from_hf(zlab),
    )
    assert ours.target_layer_ids == theirs.target_layer_ids  # aux ids are z-lab's + 1
    assert ours.draft_vocab_size == 40 and theirs.draft_vocab_size is None
    assert ours.num_target_layers is None
    for field in ("body", "block_size", "mask_token_id", "layer_causal", "layer_window"):
        assert getattr(ours, field) == getattr(theirs, field), field


def test_defaults_are_qwen3_configs() -> None:
    from transformers import Qwen3Config

    defaults = Qwen3Config().to_dict()
    assert {k: defaults[k] for k in QWEN3_DEFAULTS} == QWEN3_DEFAULTS


def _layer(c: dict) -> dict:
    return c["transformer_layer_config"]


def _proposal(c: dict) -> dict:
    return c["speculators_config"]["proposal_methods"][0]


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c.update(sample_from_anchor=True), "sample_from_anchor"),
        (lambda c: c.update(speculators_model_type="eagle3"), "speculators_model_type 'eagle3'"),
        (
            lambda c: _layer(c).update(
                layer_types=["sliding_attention", "full_attention", "full_attention"],
                sliding_window=4,
            ),
            "sliding_attention",
        ),
        (lambda c: c.update(target_hidden_size=128), "target_hidden_size 128"),
        (lambda c: c.update(aux_hidden_state_layer_ids=[0, 2]), "aux_hidden_state_layer_ids"),
        (lambda c: c.pop("aux_hidden_state_layer_ids"), "aux_hidden_state_layer_ids"),
        (lambda c: c.pop("mask_token_id"), "mask_token_id"),
        (lambda c: _proposal(c).update(verifier_accept_k=3), "verifier_accept_k 3"),
        (lambda c: _proposal(c).update(proposal_type="tree"), "proposal_type 'tree'"),
        (lambda c: c["speculators_config"].update(algorithm="eagle3"), "algorithm 'eagle3'"),
        (lambda c: _layer(c).update(model_type="llama"), "model_type 'llama'"),
        (lambda c: _layer(c).update(hidden_act="gelu"), "hidden_act 'gelu'"),
        (lambda c: c.pop("transformer_layer_config"), "transformer_layer_config"),
    ],
)
def test_refuses_what_it_does_not_implement(drafters, edit, message) -> None:
    spec = copy.deepcopy(drafters[1])
    edit(spec)
    with pytest.raises(ValueError, match=message):
        dflash_config_from_speculators(spec)


def test_missing_d2t_is_named_at_load(drafters, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from blockdraft import LLM

    root = tmp_path
    target = make_qwen3_checkpoint(root / "target")
    zlab = make_dflash_drafter(root / "zlab", target)
    spec = make_speculators_drafter(root / "spec", zlab, target, list(range(0, 120, 3)))
    tensors = load_file(spec / "model.safetensors")
    del tensors["d2t"]
    save_file(tensors, spec / "model.safetensors")
    with pytest.raises(ValueError, match="no d2t tensor"):
        LLM(str(target), speculative_config={"method": "dflash", "model": str(spec)})
