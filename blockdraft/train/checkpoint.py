"""What a training checkpoint holds beyond the drafter's weights: the state file that marks a
complete `checkpoints/step_N/` (optimizer, scheduler, step, RNG states, for `resume`), the
RNG state capture and restore, and the config of a drafter grown by identity layers
(`--grow-layers`).

Apart from the training loop so that what makes a run resumable reads in one place.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from blockdraft.models.registry import resolve_drafter

STATE_FILE = "trainer_state.pt"


def checkpoint_dirs(out_dir: Path) -> list[Path]:
    root = out_dir / "checkpoints"
    found = [p for p in root.glob("step_*") if (p / STATE_FILE).is_file()] if root.is_dir() else []
    return sorted(found, key=lambda p: int(p.name.removeprefix("step_")))


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# A layer whose residual branches end in zeros adds nothing to the stream: the identity.
OUTPUT_PROJECTIONS = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


def grow_drafter_config(hf: dict, grow_layers: int) -> dict:
    """`hf` (a drafter's config.json) with `grow_layers` more layers, each of the last layer's
    attention type; the target layers it reads are pinned (z-lab's default rule depends on the
    layer count)."""
    if not grow_layers:
        return hf
    layer_ids = list(resolve_drafter(hf)[0].target_layer_ids)
    hf = dict(hf)
    hf["dflash_config"] = {**hf.get("dflash_config", {}), "target_layer_ids": layer_ids}
    n = hf["num_hidden_layers"]
    hf["num_hidden_layers"] = n + grow_layers
    if hf.get("layer_types"):
        hf["layer_types"] = list(hf["layer_types"]) + [hf["layer_types"][-1]] * grow_layers
    if hf.get("max_window_layers") == n:
        hf["max_window_layers"] = n + grow_layers
    return hf
