"""Drafter training speed: milliseconds per optimizer step and sequences per second, for the
loss paths (float32 LM head + cross-entropy, or the fused Triton kernel) and batch sizes, on
a SmolLM2-135M-shaped target with random weights (no checkpoint download: training cost does
not depend on the weights' values) and random token sequences shaped like regenerated data.

    python benchmarks/train_bench.py [--batch-sizes 16 32] [--steps 10] [--json OUT]
                                     [--arch dflash2]

The drafter is the shipped one's shape (3 layers, 5 target features, block 16, 256 anchors a
sequence); `--arch dflash2` trains a DFlash2 drafter of that shape (convolutions and the
candidate selector's loss, the published drafters' conv and selector sizes). Each configuration
trains from the same seed on the same sequences, so the first step's loss must agree between
the loss paths (printed beside the timings). `--tiny` shrinks everything for a CPU smoke run.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import SMOLLM2_135M, hardware, print_table  # noqa: E402
from blockdraft.train.trainer import TrainConfig, Trainer  # noqa: E402

TINY = dict(
    SMOLLM2_135M,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=512,
)
MASK_TOKEN_ID = 16  # any id: the weights are random


def write_samples(path: Path, n: int, vocab: int, prompt: int, response: int, seed: int) -> None:
    """Random sequences: a prompt of up to `prompt` tokens, then `response` tokens."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(n):
            p = rng.randint(prompt // 4, prompt)
            ids = [rng.randrange(32, vocab) for _ in range(p + response)]
            f.write(json.dumps({"input_ids": ids, "loss_start": p}) + "\n")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_config(args: argparse.Namespace, work: Path, batch: int, fused: bool) -> dict:
    out = work / f"run_b{batch}_{'fused' if fused else 'fp32'}"
    cfg = TrainConfig(
        out_dir=str(out),
        data=str(work / "samples.jsonl"),
        model=str(work / "target"),
        load_format="dummy",
        arch=args.arch,
        num_layers=3,
        num_target_features=5,
        mask_token_id=MASK_TOKEN_ID,
        batch_size=batch,
        anchors=args.anchors,
        max_seq_len=args.prompt_len + args.response_len,
        steps=args.warmup + args.steps,
        fused_loss=fused,
        use_tqdm=False,
    )
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    trainer = Trainer(cfg)
    first_loss = None
    for _ in range(args.warmup):  # FlexAttention and Triton compile here
        stats = trainer.train_step()
        first_loss = stats.loss if first_loss is None else first_loss
    sync()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        trainer.train_step()
    sync()
    ms = (time.perf_counter() - t0) / args.steps * 1e3
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")
    return {
        "batch_size": batch,
        "loss_path": "fused" if fused else "float32",
        "ms_per_step": ms,
        "sequences_per_s": batch / ms * 1e3,
        "first_step_loss": first_loss,
        "peak_memory_GiB": peak,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 32])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--anchors", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--response-len", type=int, default=384)
    p.add_argument(
        "--loss",
        choices=["both", "float32", "fused"],
        default=None,
        help="loss paths to time (default: both on CUDA, float32 on the CPU)",
    )
    p.add_argument("--arch", choices=["dflash", "dflash2"], default="dflash")
    p.add_argument("--tiny", action="store_true", help="a tiny target (CPU smoke run)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    loss = args.loss or ("both" if torch.cuda.is_available() else "float32")
    paths = {"both": [False, True], "float32": [False], "fused": [True]}[loss]

    work = Path(tempfile.mkdtemp())
    (work / "target").mkdir()
    target = TINY if args.tiny else SMOLLM2_135M
    (work / "target" / "config.json").write_text(json.dumps(target))
    write_samples(
        work / "samples.jsonl",
        256,
        target["vocab_size"],
        args.prompt_len,
        args.response_len,
        seed=0,
    )
    rows = [time_config(args, work, b, fused) for b in args.batch_sizes for fused in paths]
    results = {
        "hardware": hardware(),
        "date": time.strftime("%Y-%m-%d"),
        "target": "tiny" if args.tiny else "SmolLM2-135M shape, random weights",
        "arch": args.arch,
        "anchors": args.anchors,
        "sequence_tokens": f"prompt {args.prompt_len // 4}-{args.prompt_len}, "
        f"response {args.response_len}",
        "runs": rows,
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1))
    print_table(
        f"{results['hardware']}, {results['date']}: drafter training step ({results['target']}, "
        f"3-layer {args.arch} drafter, {args.anchors} anchors a sequence, "
        f"{args.steps} timed steps)",
        ["batch", "loss path", "ms/step", "sequences/s", "first-step loss", "peak GiB"],
        [
            [
                r["batch_size"],
                r["loss_path"],
                r["ms_per_step"],
                r["sequences_per_s"],
                r["first_step_loss"],
                r["peak_memory_GiB"],
            ]
            for r in rows
        ],
    )


if __name__ == "__main__":
    main()
