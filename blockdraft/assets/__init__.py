"""Files shipped inside the package: the trained DFlash drafter of the default target."""

from __future__ import annotations

import importlib.resources
import os

DEFAULT_DRAFTER = "default"  # the name that selects the shipped drafter
DEFAULT_DRAFTER_DIR = "smollm2_135m_dflash"


def default_drafter_path() -> str:
    """Directory of the DFlash drafter trained for the embedded SmolLM2-135M-Instruct target
    (z-lab format; how it was trained: README.md beside it)."""
    resource = importlib.resources.files(__package__) / DEFAULT_DRAFTER_DIR
    if not (resource / "model.safetensors").is_file():
        raise ValueError(f"the shipped drafter is missing from {resource}: reinstall blockdraft")
    return os.fspath(resource)
