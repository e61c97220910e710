"""The published drafter formats, read into one form: z-lab's.

- a z-lab directory: `config.json` (`architectures: ["DFlashDraftModel"]`, Qwen3 fields,
  `dflash_config`) and safetensors with `layers.{i}.*`, `fc`, `hidden_norm`, `norm`;
- a vLLM speculators directory: `config.json` with `speculators_model_type`, translated by
  `speculators_config`; its tensors already carry z-lab's names, plus `d2t` / `t2d` for a
  reduced draft vocabulary;
- a llama.cpp GGUF file (`general.architecture` "dflash"), read by `gguf_drafter`.

Every reader returns the config as a z-lab `config.json` dict (extended with
`draft_vocab_size` where the drafter scores only part of the vocabulary) and the tensors under
z-lab's names, so `DFlashConfig.from_hf` and `load_drafter` see a single format.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from blockdraft.models.loader import iter_checkpoint_tensors, read_checkpoint, read_json


@dataclass
class DrafterCheckpoint:
    hf_config: dict  # z-lab's config.json form
    read_tensors: Callable[[], Iterator[tuple[str, torch.Tensor]]]  # z-lab names, read on call


def read_drafter_checkpoint(path: str) -> DrafterCheckpoint:
    """The config of the drafter at `path` (read now) and its tensors (read when asked)."""
    p = Path(path).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        from blockdraft.models.gguf_drafter import read_gguf_drafter

        return read_gguf_drafter(str(p))
    hf = read_json(p / "config.json")
    if "speculators_model_type" in hf:
        from blockdraft.models.speculators_config import dflash_config_from_speculators

        hf = dflash_config_from_speculators(hf)
    return DrafterCheckpoint(hf, lambda: iter_checkpoint_tensors(read_checkpoint(str(p))))
