"""Plot drafter training logs (train_log.jsonl of `blockdraft train-draft`, one per round,
steps continuing from round to round): loss and the acceptance length estimated per batch.

    python benchmarks/plot_training.py OUT.png round1/train_log.jsonl [round2/train_log.jsonl]
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def smooth(values: list[float], window: int = 50) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def main(dst: str, logs: list[str]) -> None:
    fig, (ax_loss, ax_tau) = plt.subplots(1, 2, figsize=(10, 3.6), dpi=120)
    offset = 0
    for i, path in enumerate(logs):
        rows = [json.loads(line) for line in open(path) if line.strip()]
        steps = [offset + r["step"] for r in rows]
        ax_loss.plot(steps, smooth([r["loss"] for r in rows]), label=f"round {i + 1}")
        ax_tau.plot(steps, smooth([r["acceptance_length"] for r in rows]), label=f"round {i + 1}")
        offset = steps[-1]
    ax_loss.set_ylabel("weighted block loss (50-step mean)")
    ax_loss.set_yscale("log")
    ax_tau.set_ylabel("estimated τ on training batches")
    for ax in (ax_loss, ax_tau):
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("SmolLM2-135M DFlash drafter (3 layers), H200")
    fig.tight_layout()
    fig.savefig(dst)
    print(f"[plot in {dst}]")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
