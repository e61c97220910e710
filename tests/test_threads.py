"""The CPU thread count: asked for, or chosen from the cores free at start."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from blockdraft import LLM
from blockdraft import threads as threads_mod

from checkpoints import make_qwen3_checkpoint


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return make_qwen3_checkpoint(tmp_path_factory.mktemp("threads") / "target")


def test_num_threads_is_applied(target: Path) -> None:
    before = torch.get_num_threads()
    try:
        llm = LLM(str(target), num_threads=2)
        assert torch.get_num_threads() == 2 and llm.threads.num_threads == 2
    finally:
        torch.set_num_threads(before)


def test_auto_threads_count_the_free_cores(monkeypatch) -> None:
    monkeypatch.setattr(threads_mod, "_current_ceiling", lambda: 4)
    monkeypatch.setattr(threads_mod, "_usable_cpus", lambda: 4)
    monkeypatch.setattr(threads_mod.os, "cpu_count", lambda: 4)
    for others, expected in [(0.0, 4), (0.2, 4), (1.0, 3), (1.5, 2), (3.9, 1), (12.0, 1)]:
        monkeypatch.setattr(threads_mod, "_other_runnable", lambda o=others: o)
        assert threads_mod.choose_num_threads(None).num_threads == expected, others
    # A container limited to 2 of a busy 16-CPU host: half the host busy -> 1 of our 2 busy.
    monkeypatch.setattr(threads_mod, "_usable_cpus", lambda: 2)
    monkeypatch.setattr(threads_mod.os, "cpu_count", lambda: 16)
    monkeypatch.setattr(threads_mod, "_other_runnable", lambda: 8.0)
    assert threads_mod.choose_num_threads(None).num_threads == 1
    # Never above the process's count (torch's default, or what the application set).
    monkeypatch.setattr(threads_mod, "_current_ceiling", lambda: 1)
    monkeypatch.setattr(threads_mod, "_other_runnable", lambda: 0.0)
    assert threads_mod.choose_num_threads(None).num_threads == 1
    assert threads_mod.choose_num_threads(3).num_threads == 3  # asked for: as asked
    assert threads_mod._other_runnable() >= 0  # the real reading works here


def test_auto_threads_ceiling_follows_the_application_not_blockdraft(monkeypatch) -> None:
    before = torch.get_num_threads()
    monkeypatch.setattr(threads_mod, "_usable_cpus", lambda: 8)
    monkeypatch.setattr(threads_mod.os, "cpu_count", lambda: 8)
    try:
        torch.set_num_threads(3)  # the application's choice: the ceiling
        monkeypatch.setattr(threads_mod, "_other_runnable", lambda: 7.0)  # busy: down to 1
        assert threads_mod.apply_num_threads(None).num_threads == 1
        monkeypatch.setattr(threads_mod, "_other_runnable", lambda: 0.0)  # idle: back up to 3
        assert threads_mod.apply_num_threads(None).num_threads == 3
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)
