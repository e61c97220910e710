"""Drafter step time, DFlash2 against DFlash: the same layers, block and batch, random weights.

A drafter step is what the proposer queues per speculative step once the context K/V is
written: the block forward over [anchor, MASK x N] per request, the LM head over the N draft
rows, and the drafts (DFlash: argmax or sampling; DFlash2: the candidate selector's path walk,
inside the drafter's CUDA graph). On a GPU each step replays the captured graph; on the CPU it
runs eagerly (a smoke run: `--tiny`). The issue's goal: DFlash2 / DFlash <= 1.15.

H200, Qwen3-8B shapes (5 drafter layers, block 16, z-lab's published DFlash2 conv/selector
fields):   python -m benchmarks.drafter_step_bench --shape qwen3-8b
CPU smoke: python -m benchmarks.drafter_step_bench --tiny --steps 2 --batches 1 2

`--fused-conv-projection` also times DFlash2 with `KernelPolicy.fuse_conv_projection` (each
sub-block's kernel projection and opening convolution in one kernel): a column of its own.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from benchmarks.common import (
    DFLASH2_FIELDS,
    device_kernels,
    hardware,
    print_table,
    write_dummy_drafter,
)
from benchmarks.shapes import SHAPES
from blockdraft.engine.kv_cache import allocate_kv_cache
from blockdraft.kernels.forward_context import use_kernel_policy
from blockdraft.kernels.policy import KernelPolicy
from blockdraft.layers.linear import fuse_projections
from blockdraft.layers.sampler import SamplingTensors
from blockdraft.models.dflash_drafter import load_drafter
from blockdraft.models.llama import qwen3_config
from blockdraft.models.loader import init_dummy_weights, read_json
from blockdraft.models.registry import resolve_drafter
from blockdraft.spec_decode.proposer import DFlashProposer

KV_BLOCK = 16
TINY = {
    "architectures": ["Qwen3ForCausalLM"],
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 1024,
}
TINY_DFLASH2 = {
    "conv_kernel_size": 2,
    "conv_group_size": 16,
    "selector_rank": 8,
    "selector_top_k": 8,
}


def build_proposer(
    drafter_dir: Path,
    target_hf: dict,
    max_positions: int,
    num_kv_blocks: int,
    dtype: torch.dtype,
    device: torch.device,
) -> DFlashProposer:
    """The proposer over a drafter with dummy weights; of the target only what the drafter
    borrows (embedding, LM head), also random."""
    target_cfg = qwen3_config(target_hf)
    with torch.device(device):
        target = SimpleNamespace(
            cfg=target_cfg,
            model=SimpleNamespace(
                embed_tokens=nn.Embedding(target_cfg.vocab_size, target_cfg.hidden_size).to(dtype)
            ),
            lm_head=nn.Linear(target_cfg.hidden_size, target_cfg.vocab_size, bias=False).to(dtype),
        )
    init_dummy_weights(target.model.embed_tokens)
    init_dummy_weights(target.lm_head)
    cfg, drafter_class = resolve_drafter(read_json(drafter_dir / "config.json"))
    drafter = load_drafter(
        str(drafter_dir), target, max_positions, dtype, device, True, cfg, drafter_class
    )
    fuse_projections(drafter)
    allocate_kv_cache(drafter.attention_layers, num_kv_blocks, KV_BLOCK, dtype, device)
    return DFlashProposer(drafter, KV_BLOCK)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@torch.inference_mode()
def step_ms(
    proposer: DFlashProposer,
    batch: int,
    num_drafts: int,
    context_len: int,
    temperature: float,
    steps: int,
) -> float:
    """Mean ms of `steps` drafter steps of `batch` requests whose anchors sit at context_len,
    after warm-up (graphs captured on a GPU)."""
    device, q = proposer.device, num_drafts + 1
    width = -(-(context_len + q) // KV_BLOCK)
    i64 = dict(dtype=torch.int64, device=device)
    tables = torch.arange(batch * width, **i64).view(batch, width)
    rows = torch.arange(batch, **i64)
    inputs = proposer.prepare_inputs(
        torch.full((batch,), 5, **i64),  # anchors
        torch.full((batch,), context_len, **i64),
        rows,  # each request's one committed row (the context is written already)
        torch.ones(batch, **i64),
        rows,
        tables,
        num_drafts,
        batch,
    )
    st = SamplingTensors.from_lists(
        [temperature] * batch,
        [0] * batch,
        [1.0] * batch,
        [0.0] * batch,
        list(range(batch)),
        [context_len + 1] * batch,
        device,
    )
    if device.type == "cuda" and q not in proposer.graphs:
        proposer.capture_graphs(num_drafts, [batch], width, None)
    max_seq_len = context_len + q
    for _ in range(3):
        proposer.propose(inputs, tables, max_seq_len, st, num_drafts)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        proposer.propose(inputs, tables, max_seq_len, st, num_drafts)
    sync(device)
    return (time.perf_counter() - t0) / steps * 1e3


def main(argv: list[str] | None = None) -> list[list[object]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    p.add_argument("--tiny", action="store_true", help="a tiny shape (CPU smoke run)")
    p.add_argument("--block", type=int, default=16, help="drafter block size (N + 1)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--context-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--profile", action="store_true", help="top kernels, T=0 (GPU)")
    p.add_argument(
        "--profile-batches", type=int, nargs="+", default=None, help="default: the smallest"
    )
    p.add_argument("--top", type=int, default=10, help="kernels listed by --profile")
    p.add_argument(
        "--fused-conv-projection",
        action="store_true",
        help="also DFlash2 with each sub-block's projection + convolution in one kernel",
    )
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.tiny:
        target_hf, layers, fields = TINY, 2, TINY_DFLASH2
    else:
        shape = SHAPES[args.shape]
        target_hf, layers, fields = shape.config, shape.drafter_layers, DFLASH2_FIELDS
    tmp = Path(tempfile.mkdtemp())
    num_drafts = args.block - 1
    max_positions = args.context_len + 4 * args.block
    width = -(-(args.context_len + args.block) // KV_BLOCK)
    times: dict[tuple[str, int, float], float] = {}
    profiled: list[list[object]] = []
    drafter_dirs: dict[str, Path] = {}

    def make_proposer(drafter_dir: Path) -> DFlashProposer:
        """The drafter's proposer, sized for the largest batch at the context length."""
        return build_proposer(
            drafter_dir, target_hf, max_positions, max(args.batches) * width, dtype, device
        )

    engines = [("DFlash", None, KernelPolicy()), ("DFlash2", fields, KernelPolicy())]
    if args.fused_conv_projection:
        engines.append(("DFlash2 fused", fields, KernelPolicy(fuse_conv_projection=True)))
    for name, dflash2, policy in engines:
        drafter_dir = drafter_dirs[name] = write_dummy_drafter(
            tmp / name.replace(" ", "_"), target_hf, layers, args.block, with_weights=False,
            dflash2=dflash2,
        )  # fmt: skip
        with use_kernel_policy(policy):  # graphs are captured (and CPU steps run) under it
            proposer = make_proposer(drafter_dir)
            for batch in sorted(args.batches, reverse=True):
                proposer.graphs.clear()  # one graph per batch size
                for temperature in args.temperatures:
                    times[name, batch, temperature] = step_ms(
                        proposer, batch, num_drafts, args.context_len, temperature, args.steps
                    )
        del proposer
        if device.type == "cuda":
            torch.cuda.empty_cache()
    # Profiles only after both drafters are timed: the profiler leaves CUPTI attached to the
    # process when it stops (pytorch/pytorch#144455), and what runs after it runs slower (an
    # engine timed after another's profile: 1.14 ms a step against 0.70 without, H100).
    for name, _, policy in engines if args.profile and device.type == "cuda" else []:
        with use_kernel_policy(policy):
            proposer = make_proposer(drafter_dirs[name])
            for batch in args.profile_batches or [min(args.batches)]:
                proposer.graphs.clear()
                profiled += profile_step(
                    proposer, name, batch, num_drafts, args.context_len, args.top
                )
        del proposer
        torch.cuda.empty_cache()
    others = [name for name, _, _ in engines[1:]]
    rows = [
        [batch, f"{temperature:g}", f"{times['DFlash', batch, temperature]:.3f}"]
        + [f"{times[name, batch, temperature]:.3f}" for name in others]
        + [
            f"{times[name, batch, temperature] / times['DFlash', batch, temperature]:.3f}"
            for name in others
        ]
        for batch in args.batches
        for temperature in args.temperatures
    ]
    label = "tiny" if args.tiny else args.shape
    print_table(
        f"Drafter step, {label}, {layers} layers, block {args.block}, context "
        f"{args.context_len}, {device.type} {dtype} ({hardware()}); goal DFlash2/DFlash <= 1.15",
        ["batch", "T", "DFlash ms"]
        + [f"{name} ms" for name in others]
        + [f"{name}/DFlash" for name in others],
        rows,
    )
    if profiled:
        print_table(
            "GPU ms per drafter step by kernel, T = 0",
            ["drafter", "batch", "kernel", "ms"],
            profiled,
        )
    return rows


def profile_step(
    proposer: DFlashProposer, name: str, batch: int, num_drafts: int, context_len: int, top: int
) -> list[list[object]]:
    """The top kernels of the drafter step at `batch` (its graph captured already), T = 0."""
    from torch.profiler import ProfilerActivity, profile

    steps = 10
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step_ms(proposer, batch, num_drafts, context_len, 0.0, steps)
    calls = steps + 3  # step_ms's warm-up calls too
    kernels = device_kernels(prof)
    total = sum(k.self_device_time_total for k in kernels) / 1e3 / calls
    listed = [
        [name, batch, k.key[:70], k.self_device_time_total / 1e3 / calls] for k in kernels[:top]
    ]
    return [[name, batch, "all kernels", total], *listed]


if __name__ == "__main__":
    main()
