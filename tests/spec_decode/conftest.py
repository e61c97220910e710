"""Fixtures shared by the spec_decode tests."""

from pathlib import Path

import pytest

from checkpoints import make_dflash_drafter, make_predictable_target, make_qwen3_checkpoint


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
