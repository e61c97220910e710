"""Correctness checks that need GPUs, on tiny random checkpoints (tests/checkpoints.py) in
float32: the CPU suite checks the same paths with gloo and eager steps; this runs them with NCCL
and CUDA graphs.

    python -m benchmarks.gpu_checks [--tp 2]

- CUDA graphs: a Qwen3.5 (Gated DeltaNet + gated attention) target with and without its
  DFlash drafter (sliding-window layers: their own pages), a Qwen3.5-MoE with one, and a dense
  Qwen3 with its DFlash and its DFlash2 drafter (z-lab's classes: needs the `dflash` package),
  give the same tokens with graphs as eager; the hybrid's DFlash run gives them with the chunked
  form of the Gated DeltaNet verify kernel as with the row kernel;
- tensor parallel (when --tp > 1 GPUs are visible): dense Qwen3 (with and without DFlash),
  Qwen3-MoE and Qwen3.5 give at TP N the tokens of one GPU, greedy and seeded-sampled.
Prints one line per check and exits 1 when one differs.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from blockdraft import LLM, SamplingParams  # noqa: E402
from blockdraft.kernels.policy import KernelPolicy  # noqa: E402

from checkpoints import (  # noqa: E402
    make_dflash_drafter,
    make_hybrid_moe_checkpoint,
    make_qwen3_5_checkpoint,
    make_qwen3_checkpoint,
    make_qwen3_moe_checkpoint,
)
from dflash2_checkpoints import make_dflash2_drafter  # noqa: E402

VOCAB = 150


def generate(target: Path, drafter: Path | None, prompts: list[list[int]], **kw) -> list:
    spec = drafter and {
        "model": str(drafter),
        "num_speculative_tokens": 3,
        "num_speculative_tokens_by_batch": None,
    }
    params = [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=11, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, top_k=30, seed=12, max_tokens=24),
    ]
    with LLM(str(target), speculative_config=spec, device="cuda", dtype="float32",
             max_num_batched_tokens=16, block_size=4, **kw) as llm:  # fmt: skip
        outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=2)
    args = p.parse_args()
    root = Path(tempfile.mkdtemp())
    qwen3 = make_qwen3_checkpoint(root / "qwen3", vocab_size=VOCAB, num_layers=2)
    hybrid = make_qwen3_5_checkpoint(
        root / "hybrid", vocab_size=VOCAB, num_layers=4, linear_heads=(4, 8), seed=7
    )
    moe = make_qwen3_moe_checkpoint(root / "moe", vocab_size=VOCAB, num_layers=2)
    hybrid_moe = make_hybrid_moe_checkpoint(
        root / "hybrid_moe", "qwen3_5_moe", vocab_size=VOCAB, num_layers=4, linear_heads=(2, 4)
    )
    drafters = {
        "qwen3": make_dflash_drafter(root / "d_qwen3", qwen3, target_layer_ids=[0, 1]),
        # Sliding layers: their own pages (engine/window_pages.py), freed behind the window.
        "hybrid": make_dflash_drafter(
            root / "d_hybrid",
            hybrid,
            target_layer_ids=[0, 3],
            sliding_window=6,
            layer_types=["sliding_attention", "full_attention"],
        ),
        "hybrid_moe": make_dflash_drafter(
            root / "d_hybrid_moe", hybrid_moe, target_layer_ids=[0, 3]
        ),
    }
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, VOCAB, (n,), generator=gen).tolist() for n in (3, 9, 21)]
    failed = False

    def check(name: str, got: list, expected: list) -> None:
        nonlocal failed
        same = got == expected
        failed |= not same
        print(f"{'same' if same else 'DIFFERENT':9s}  {name}", flush=True)
        if not same:
            print(f"    expected {expected}\n    got      {got}")

    two_layers = {"target_layer_ids": [0, 1]}  # z-lab's default needs more target layers
    graph_cases = [
        ("hybrid", hybrid, None),
        ("hybrid + DFlash", hybrid, drafters["hybrid"]),
        ("hybrid MoE + DFlash", hybrid_moe, drafters["hybrid_moe"]),
        ("qwen3 + DFlash", qwen3, drafters["qwen3"]),
        ("qwen3 + DFlash2", qwen3, make_dflash2_drafter(root / "d2_qwen3", qwen3, **two_layers)),
    ]
    for name, target, drafter in graph_cases:
        eager = generate(target, drafter, prompts, enforce_eager=True)
        check(f"{name}: CUDA graphs = eager", generate(target, drafter, prompts), eager)
    chunked, rows = (KernelPolicy(chunked_gated_deltanet_verify_min_rows=n) for n in (1, None))
    check(
        "hybrid + DFlash: chunked verify = row kernel",
        generate(hybrid, drafters["hybrid"], prompts, kernel_policy=chunked),
        generate(hybrid, drafters["hybrid"], prompts, kernel_policy=rows),
    )
    if args.tp > 1 and torch.cuda.device_count() >= args.tp:
        cases = [
            ("qwen3", qwen3, None),
            ("qwen3 + DFlash", qwen3, drafters["qwen3"]),
            ("qwen3-moe", moe, None),
            ("qwen3.5 + DFlash", hybrid, drafters["hybrid"]),
        ]
        for name, target, drafter in cases:
            one = generate(target, drafter, prompts)
            split = generate(target, drafter, prompts, tensor_parallel_size=args.tp)
            check(f"{name}: TP {args.tp} = one GPU", split, one)
    else:
        print(f"tensor parallel: skipped ({torch.cuda.device_count()} GPU(s) visible)")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
