"""Speculative-decoding counters (as vLLM reports them)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_speculative_tokens: int
    num_drafts: int = 0  # verify steps, summed over requests
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # acceptance length (accepted drafts + 1) -> count, before any truncation
    histogram: dict[int, int] = field(default_factory=dict)
    # draft tokens verified at once (N, which may depend on the batch size) -> verify steps
    drafts_by_num_tokens: dict[int, int] = field(default_factory=dict)
    # N the engine chose for a step's drafts (0: none, a plain decode next) -> engine steps
    steps_by_num_drafts: dict[int, int] = field(default_factory=dict)

    def record(self, num_accepted: int, num_draft_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        length = num_accepted + 1
        self.histogram[length] = self.histogram.get(length, 0) + 1
        by_n = self.drafts_by_num_tokens
        by_n[num_draft_tokens] = by_n.get(num_draft_tokens, 0) + 1

    def record_step(self, num_drafts: int) -> None:
        by_n = self.steps_by_num_drafts
        by_n[num_drafts] = by_n.get(num_drafts, 0) + 1

    @property
    def mean_acceptance_length(self) -> float:
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def summary(self) -> str:
        steps = " ".join(f"{k}:{v}" for k, v in sorted(self.steps_by_num_drafts.items()))
        chosen = f"; steps by chosen N {steps}" if steps else ""
        if not self.num_drafts:
            return f"speculative decoding: no verify steps{chosen}"
        hist = " ".join(f"{k}:{v}" for k, v in sorted(self.histogram.items()))
        text = (
            f"speculative decoding: {self.num_drafts} drafts, {self.num_draft_tokens} draft "
            f"tokens, {self.num_accepted_tokens} accepted, mean acceptance length "
            f"{self.mean_acceptance_length:.2f} (histogram {hist})"
        )
        if len(self.drafts_by_num_tokens) > 1:  # the batch-size schedule changed N
            by_n = " ".join(f"{k}:{v}" for k, v in sorted(self.drafts_by_num_tokens.items()))
            text += f"; drafts by N {by_n}"
        return text + chosen
