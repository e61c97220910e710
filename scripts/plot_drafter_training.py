"""Plots the shipped drafter's training curves, round after round, from its training logs
(train_log_roundN.jsonl, one JSON line a step, in results/drafter): the weighted block loss and
the estimated acceptance length on the training batches, both as 50-step means. The shipped
rounds' logs live in git history: `git show 9579be2:docs/drafter/train_log_round11.jsonl`.

    python scripts/plot_drafter_training.py [--logs results/drafter] \
        [--out results/drafter/training.png]
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

WINDOW = 50


def rolling_mean(values: list[float]) -> np.ndarray:
    kernel = np.ones(min(WINDOW, len(values))) / min(WINDOW, len(values))
    return np.convolve(values, kernel, mode="valid")


def round_of(path: Path) -> int:
    return int(re.search(r"round(\d+)", path.name).group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--logs", type=Path, default=Path("results/drafter"))
    ap.add_argument("--out", type=Path, default=Path("results/drafter/training.png"))
    args = ap.parse_args()
    logs = sorted(args.logs.glob("train_log_round*.jsonl"), key=round_of)
    if not logs:
        raise SystemExit(f"no train_log_round*.jsonl in {args.logs}")
    fig, (ax_loss, ax_tau) = plt.subplots(1, 2, figsize=(12, 4.2))
    offset = 0
    for path in logs:
        steps = [json.loads(line) for line in path.open() if line.strip()]
        label = f"round {round_of(path)}"
        loss = rolling_mean([s["loss"] for s in steps])
        tau = rolling_mean([s["acceptance_length"] for s in steps])
        x = offset + np.arange(len(loss)) + min(WINDOW, len(steps))
        ax_loss.plot(x, loss, label=label)
        ax_tau.plot(x, tau, label=label)
        offset += len(steps)
    ax_loss.set_yscale("log")
    ax_loss.set_ylabel(f"weighted block loss ({WINDOW}-step mean)")
    ax_tau.set_ylabel("estimated τ on training batches")
    for ax in (ax_loss, ax_tau):
        ax.set_xlabel("optimizer step (rounds with a kept log, end to end)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, ncol=2)
    fig.suptitle("SmolLM2-135M DFlash drafter, H200 (3 layers; 5 from round 10)")
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=100)
    print(f"[plot in {args.out}]")


if __name__ == "__main__":
    main()
