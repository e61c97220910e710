"""Fixtures shared by the spec_decode tests."""

from pathlib import Path

import pytest

from checkpoints import (
    make_dflash_drafter,
    make_predictable_target,
    make_qwen3_checkpoint,
    make_qwen3_moe_checkpoint,
)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("pairs")
    random_target = make_qwen3_checkpoint(root / "random")
    agreeing_target = make_predictable_target(root / "agreeing")
    return {
        "random": (random_target, make_dflash_drafter(root / "random-d", random_target)),
        "agreeing": (
            agreeing_target,
            make_dflash_drafter(root / "agreeing-d", agreeing_target, agree_with_target=True),
        ),
    }


@pytest.fixture(scope="module")
def moe_pairs(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """The same two pairs on Qwen3-MoE targets (every layer routes, 8 experts, top 2)."""
    root = tmp_path_factory.mktemp("moe-pairs")
    random_target = make_qwen3_moe_checkpoint(root / "random", num_layers=4)
    agreeing_target = make_predictable_target(root / "agreeing", arch="qwen3_moe")
    return {
        "random": (random_target, make_dflash_drafter(root / "random-d", random_target)),
        "agreeing": (
            agreeing_target,
            make_dflash_drafter(root / "agreeing-d", agreeing_target, agree_with_target=True),
        ),
    }
