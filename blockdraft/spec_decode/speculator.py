"""An engine's speculative side, built over its loaded drafter: the proposer, the launcher that
queues the drafter's work behind each target step, and the chooser of each step's N. An engine
without a drafter has none of them."""

from __future__ import annotations

from typing import NamedTuple

import torch

from blockdraft.models.dflash_drafter import DFlashDrafter
from blockdraft.runtime.sampling_cache import SamplingTensorCache
from blockdraft.spec_decode.draft_launch import DraftLauncher
from blockdraft.spec_decode.draft_length import DraftLengthChooser
from blockdraft.spec_decode.draft_schedule import DraftSchedule
from blockdraft.spec_decode.proposer import DFlashProposer


class Speculator(NamedTuple):
    proposer: DFlashProposer | None
    draft_launcher: DraftLauncher | None
    draft_length: DraftLengthChooser | None


def build_speculator(
    drafter: DFlashDrafter | None,
    draft_schedule: DraftSchedule | None,  # set with the drafter
    sampling: SamplingTensorCache,  # the model runner's
    block_size: int,
    device: torch.device,
) -> Speculator:
    if drafter is None:
        return Speculator(None, None, None)
    proposer = DFlashProposer(drafter, block_size)
    # N per step: the schedule's for the batch size, or ("auto") chosen from the requests'
    # acceptance and the step costs.
    draft_length = DraftLengthChooser.for_device(
        draft_schedule, device.type, torch.get_num_threads()
    )
    return Speculator(proposer, DraftLauncher(proposer, sampling, device), draft_length)
