"""A request as the engine tracks it: its tokens, how far the KV cache has computed them, its
blocks, and the drafts waiting to be verified."""

from __future__ import annotations

from enum import Enum, auto

from blockdraft.sampling_params import SamplingParams
from blockdraft.spec_decode.draft_length import AcceptanceEstimate
from blockdraft.spec_decode.drafts import PendingDrafts

# The input id of a verify row whose draft lives on the device: the model runner overwrites it
# with the draft there, so the host never reads the drafts back.
DRAFT_PLACEHOLDER = 0


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        seed: int,
        max_tokens: int,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.seed = seed  # resolved: the request's own or one drawn from the engine's seed
        self.max_tokens = max_tokens  # resolved against max_model_len
        self.token_ids = list(prompt_token_ids)
        # Its own copy, shared by every output of the request instead of sliced per step.
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose K/V (target and drafter) are in the cache
        self.block_table: list[int] = []
        # Its linear-attention state slot (hybrid models) while it holds blocks; None otherwise.
        self.state_slot: int | None = None
        # Its blocks [start, end) that hold pages of the drafter's window pool (window_pages.py).
        self.window_span = (0, 0)
        self.num_hashed_blocks = 0  # leading blocks registered in the prefix cache
        self.last_block_hash: int | None = None  # of the last one's key: the next one's parent
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache
        self.drafts: PendingDrafts | None = None  # proposed, verified when next scheduled
        self.spec_accept_lengths: list[int] = []
        # Its drafts' acceptance, for choosing N (sampled requests have their own prior).
        self.acceptance = AcceptanceEstimate(sampled=params.temperature > 0)
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_drafts(self) -> int:
        return 0 if self.drafts is None else self.drafts.batch.tokens.shape[1]

    def tokens_to_compute(self, num_drafts: int | None = None) -> list[int]:
        """Tokens not yet in the KV cache, then a verify row per draft to verify: the first
        `num_drafts` pending ones, all by default (placeholders: the drafts themselves stay on
        the device)."""
        if num_drafts is None:
            num_drafts = self.num_drafts
        return self.token_ids[self.num_computed_tokens :] + [DRAFT_PLACEHOLDER] * num_drafts

    def reset_for_recompute(self) -> None:
        self.num_computed_tokens = 0
        self.num_hashed_blocks = 0
        self.last_block_hash = None
        self.drafts = None
        self.status = SequenceStatus.WAITING
