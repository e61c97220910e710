"""Spies on a speculative LLM's drafter (what it computed, recorded while it runs), and on the
kernel functions a forward calls."""

from __future__ import annotations

import torch


def spy_proposals(llm) -> list[torch.Tensor]:
    """Records the draft tokens [R, N] of every propose step of `llm`."""
    seen: list[torch.Tensor] = []
    propose = llm.engine.proposer.propose

    def spy(*args, **kwargs):
        tokens, probs = propose(*args, **kwargs)
        seen.append(tokens.clone())
        return tokens, probs

    llm.engine.proposer.propose = spy
    return seen


def spy_draft_logits(llm) -> list[torch.Tensor]:
    """Records every `compute_logits` result [R, V] of `llm`'s drafter."""
    drafter, seen = llm.engine.proposer.drafter, []
    compute_logits = drafter.compute_logits

    def spy(hidden: torch.Tensor, **kwargs: object) -> torch.Tensor:
        seen.append(compute_logits(hidden, **kwargs))
        return seen[-1]

    drafter.compute_logits = spy
    return seen


def spy_context_writes(llm) -> list[int]:
    """Records the rows of every context K/V write of `llm`'s drafter."""
    drafter, seen = llm.engine.proposer.drafter, []
    write_context = drafter.write_context

    def spy(features: torch.Tensor, *args: torch.Tensor) -> None:
        seen.append(features.shape[0])
        write_context(features, *args)

    drafter.write_context = spy
    return seen


def count_calls(
    monkeypatch, module: object, name: str, calls: list[str] | None = None
) -> list[str]:
    """Wraps `module.name` for the test: `name` is appended to the returned list (`calls`, to
    record several functions in the order they run) at each call."""
    calls = [] if calls is None else calls
    fn = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(name) or fn(*a, **k))
    return calls
