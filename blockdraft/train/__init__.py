"""Training DFlash drafters: regenerate responses with the target, then train the drafter.

from blockdraft.train import TrainConfig, regenerate, train_drafter

regenerate("prompts.jsonl", "data.jsonl", model=TARGET, max_tokens=512)
result = train_drafter(TrainConfig(out_dir="drafter", data="data.jsonl", model=TARGET))
LLM(TARGET, speculative_config={"method": "dflash", "model": "drafter"})
"""

from blockdraft.train.blocks import build_block_mask, pack_blocks, sample_anchors
from blockdraft.train.config import StepStats, TrainConfig, TrainResult
from blockdraft.train.data import (
    Sample,
    load_prompts,
    load_samples,
    load_sharegpt_chats,
    load_sharegpt_prompts,
    regenerate,
)
from blockdraft.train.evaluate import block_acceptance_length, evaluate_acceptance
from blockdraft.train.trainer import train_drafter

__all__ = [
    "Sample",
    "StepStats",
    "TrainConfig",
    "TrainResult",
    "block_acceptance_length",
    "build_block_mask",
    "evaluate_acceptance",
    "load_prompts",
    "load_samples",
    "load_sharegpt_chats",
    "load_sharegpt_prompts",
    "pack_blocks",
    "regenerate",
    "sample_anchors",
    "train_drafter",
]
