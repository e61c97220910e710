"""The Triton MoE (`blockdraft.kernels.triton_moe`: router + experts) against its torch twins at
Qwen3-30B-A3B shapes (hidden 2048, 128 experts, top-8, expert intermediate 768), bf16, or
Qwen3.5-35B-A3B's (256 experts of 512, and the shared expert as a ninth routed slot).

    python benchmarks/moe_bench.py [--shape qwen3.5-35b-a3b] [--tokens 1 8 16 512] [--sweep]
        [--json moe.json]
    python benchmarks/moe_bench.py --tiny        # a tiny fp32 shape; on the CPU (interpreter)

One MoE layer's routing and expert compute per call (the router's input logits given), for T
tokens: 1 (batch-1 decode, the per-pair GEMV path), 8 and 16 (a verify block of 1 + 15 tokens,
grouped), 512 (32 requests x 16). Each call routes a fresh random batch (cycling through
`--sets` of them), so the experts it reads change from call to call, as across layers. The
Triton time is per call in a CUDA graph of `--iters` calls, best of `--reps` replays (so the
capture also proves the path has no host sync); the twin, which syncs, runs eagerly under
`triton.testing.do_bench`.

GB/s counts the expert weight bytes a call must read: the distinct experts its routing hits x
3 * hidden * intermediate * 2 bytes (gate, up, down), averaged over the sets; `E[distinct]` is
the expectation under uniform random top-k routing, E * (1 - (1 - k/E)^T). `--sweep` also
times candidate launch configs per T and prints the best as lines for the tables of
`triton_moe` (`GROUPED_CONFIGS`, `DECODE_CONFIG`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import hardware, print_table, time_eager, time_graph  # noqa: E402

# (hidden, experts, top_k, intermediate, dtype)
FULL = (2048, 128, 8, 768, torch.bfloat16)
SHAPES = {
    "qwen3-30b-a3b": FULL,
    # The routed experts; the shared expert (as wide) is stacked after them as one more slot.
    "qwen3.5-35b-a3b": (2048, 256, 8, 512, torch.bfloat16),
}
SHARED = {"qwen3-30b-a3b": False, "qwen3.5-35b-a3b": True}
TINY = (64, 8, 2, 32, torch.float32)
FULL_TOKENS = [1, 8, 16, 32 * 16]
TINY_TOKENS = [1, 3, 16]

# (block_m, block_n, block_k, num_warps, num_stages) tried by --sweep on the grouped path.
GROUPED_SWEEP = [
    (16, 32, 128, 4, 3),
    (16, 64, 128, 4, 3),
    (16, 64, 256, 4, 3),
    (16, 128, 64, 4, 4),
    (16, 64, 128, 8, 4),
    (32, 64, 64, 4, 3),
    (32, 64, 128, 4, 3),
    (64, 64, 64, 4, 3),
    (64, 128, 64, 8, 3),
    (128, 128, 64, 8, 3),
]
# (block_n, gate_up_block_k, down_block_k, num_warps, num_stages) on the decode path.
DECODE_SWEEP = [
    (16, 256, 512, 4, 1),
    (8, 256, 512, 4, 1),
    (16, 512, 512, 4, 1),
    (32, 128, 256, 4, 1),
    (16, 256, 512, 4, 3),
    (8, 512, 1024, 4, 3),
    (16, 256, 256, 8, 1),
]


def expected_distinct(num_experts: int, top_k: int, num_tokens: int) -> float:
    """Mean distinct experts among num_tokens tokens' top-k under uniform random routing."""
    return num_experts * (1 - (1 - top_k / num_experts) ** num_tokens)


@dataclass
class Case:
    """One token count's inputs: `sets` random batches and their router logits."""

    xs: list[torch.Tensor]  # [T, hidden] each
    logits: list[torch.Tensor]  # [T, experts] each
    w_gate_up: torch.Tensor  # [experts, 2 * intermediate, hidden]
    w_down: torch.Tensor  # [experts, hidden, intermediate]
    top_k: int
    shared: bool = False  # the last expert and logit column are a shared expert's

    def triton(self, i: int, config: object = None) -> torch.Tensor:
        from blockdraft.kernels.triton_moe import triton_experts, triton_route

        weights, ids = triton_route(self.logits[i], self.top_k, True, self.shared)
        return triton_experts(self.xs[i], self.w_gate_up, self.w_down, weights, ids, config)

    def twin(self, i: int) -> torch.Tensor:
        from blockdraft.kernels.moe import experts_torch, route_torch

        weights, ids = route_torch(self.logits[i], self.top_k, True, self.shared)
        return experts_torch(self.xs[i], self.w_gate_up, self.w_down, weights, ids)


def time_triton(case: Case, config: object, iters: int, reps: int) -> float:
    """ms per Triton call: in a CUDA graph on the GPU, eager (interpreted) on the CPU."""
    calls = [partial(case.triton, i, config) for i in range(len(case.xs))]
    return time_graph(calls, iters, reps) if torch.cuda.is_available() else time_eager(calls, 2)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    parser.add_argument(
        "--tiny", action="store_true", help="tiny fp32 widths (the --shape's shared slot), CPU-able"
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=None)
    parser.add_argument("--sets", type=int, default=8, help="random routings cycled")
    parser.add_argument("--iters", type=int, default=50, help="calls per CUDA graph")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--sweep", action="store_true", help="time candidate launch configs")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda:
        if not args.tiny:
            raise SystemExit("moe_bench needs a CUDA GPU; --tiny runs on the CPU")
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported
    from blockdraft.kernels.moe import route_torch
    from blockdraft.kernels.triton_moe import (
        DECODE_MAX_PAIRS,
        DecodeConfig,
        GroupedConfig,
        pick_grouped_config,
    )

    device = torch.device("cuda" if cuda else "cpu")
    hidden, experts, top_k, inter, dtype = TINY if args.tiny else SHAPES[args.shape]
    shared = SHARED[args.shape]
    stacked = experts + int(shared)  # the weights' experts: the shared one last
    tokens_list = args.tokens or (TINY_TOKENS if args.tiny else FULL_TOKENS)
    sets = max(1, args.sets if cuda else 2)
    gen = torch.Generator(device=device).manual_seed(0)
    w_gate_up = (torch.randn(stacked, 2 * inter, hidden, device=device, generator=gen) * 0.02).to(
        dtype
    )
    w_down = (torch.randn(stacked, hidden, inter, device=device, generator=gen) * 0.02).to(dtype)
    expert_bytes = 3 * hidden * inter * w_down.element_size()
    print(
        f"MoE layer: hidden {hidden}, {experts} experts, top-{top_k}"
        f"{' + a shared expert as a slot' if shared else ''}, intermediate {inter}, "
        f"{dtype}, {expert_bytes / 1e6:.2f} MB an expert, on {hardware()}"
    )

    rows, best_lines = [], []
    for tokens in tokens_list:
        case = Case(
            [
                torch.randn(tokens, hidden, device=device, generator=gen).to(dtype)
                for _ in range(sets)
            ],
            [
                torch.randn(tokens, stacked, device=device, generator=gen).to(dtype)
                for _ in range(sets)
            ],
            w_gate_up,
            w_down,
            top_k,
            shared,
        )
        routed = [route_torch(lg, top_k, True, shared) for lg in case.logits]
        distinct = sum(torch.unique(ids).numel() for _, ids in routed) / sets
        mbytes = distinct * expert_bytes / 1e6
        ref = case.twin(0).float()
        err = (case.triton(0).float() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30)
        twin_ms = time_eager([partial(case.twin, i) for i in range(sets)], args.reps)

        ms = time_triton(case, None, args.iters, args.reps)
        pairs = tokens * (top_k + int(shared))
        path = "decode" if pairs <= DECODE_MAX_PAIRS else "grouped"
        row = {
            "tokens": tokens,
            "path": path,
            "distinct": distinct,
            "expected_distinct": expected_distinct(experts, top_k, tokens) + int(shared),
            "expert_MB": mbytes,
            "twin_ms": twin_ms,
            "triton_ms": ms,
            "speedup": twin_ms / ms,
            "GB_s": mbytes / ms,  # MB / ms = GB / s
            "max_rel_err": err,
        }
        if args.sweep and cuda:
            if path == "decode":
                configs = [DecodeConfig(*c) for c in DECODE_SWEEP]
            else:
                configs = [pick_grouped_config(pairs)]
                configs += [GroupedConfig(*c) for c in GROUPED_SWEEP]
            timed = []
            for config in dict.fromkeys(configs):
                try:
                    timed.append((time_triton(case, config, args.iters, args.reps), config))
                except Exception as exc:  # noqa: BLE001 - a config that fails to compile
                    print(f"  T={tokens} {config}: {type(exc).__name__}")
            best_ms, best = min(timed, key=lambda t: t[0])
            row["best_config"], row["best_GB_s"] = repr(best), mbytes / best_ms
            best_lines.append(
                f"    # T={tokens}: {best_ms * 1e3:.1f} us, {mbytes / best_ms:.0f} GB/s"
            )
            best_lines.append(f"    {pairs}: {best!r},")
        rows.append(row)

    header = ["T", "path", "distinct", "E[distinct]", "expert MB", "twin ms", "triton ms"]
    header += ["speed-up", "GB/s", "max rel err"]
    print_table(
        "MoE layer (router + experts), Triton vs torch twin",
        header,
        [
            [r["tokens"], r["path"], r["distinct"], r["expected_distinct"], r["expert_MB"]]
            + [r["twin_ms"], r["triton_ms"], r["speedup"], r["GB_s"], f"{r['max_rel_err']:.1e}"]
            for r in rows
        ],
    )
    if best_lines:
        print("\nbest config per T (pairs: config), for triton_moe's tables:")
        print("\n".join(best_lines))
    if args.json:
        args.json.write_text(json.dumps({"hardware": hardware(), "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
