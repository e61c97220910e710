"""What a batch-1 decode step's short kernels cost on Qwen3-8B shapes (random bf16 weights):
the step timed whole, then with parts of each layer's attention block left out (timing only,
the tokens are garbage).

A decode step runs under PDL, so its kernels overlap and a profile's per-kernel times overstate
them; leaving a kernel out and timing the step says what it adds to the critical path.
Variants: "full"; "no-attention" (q/k norm + RoPE + KV store kept, the attention and its
merge left out: the o projection reads the rotated queries); "no-rope" (attention over the
cache without this step's keys, on the unrotated queries); "gemms-only" (neither: the o
projection reads the q projection's output). Needs an NVIDIA GPU.

    python benchmarks/decode_breakdown.py [--variants full gemms-only ...] [--steps 60]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import print_table  # noqa: E402
from benchmarks.gpu_bench import mean_step_ms  # noqa: E402
from benchmarks.shapes import SHAPES  # noqa: E402
from blockdraft import LLM  # noqa: E402
from blockdraft.kernels.forward_context import get_attention_metadata  # noqa: E402
from blockdraft.layers.linear import linear  # noqa: E402
from blockdraft.layers.self_attention import SelfAttention  # noqa: E402

VARIANTS = ("full", "no-attention", "no-rope", "gemms-only")
_FULL = SelfAttention.attend_qkv


def attend_qkv_without(variant: str) -> Callable:
    """A `SelfAttention.attend_qkv` that leaves out what `variant` names (module doc)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
    if variant == "full":
        return _FULL

    def attend_qkv(
        self: SelfAttention,
        q: torch.Tensor,  # [num_tokens, num_heads * head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
        positions: torch.Tensor,  # [num_tokens] int64
    ) -> torch.Tensor:  # [num_tokens, hidden]
        heads = (-1, self.num_heads, self.head_dim)
        kv_heads = (-1, self.num_kv_heads, self.head_dim)
        out = q.view(heads)
        attn = self.attn
        if variant == "no-attention":
            slots = get_attention_metadata().slot_mapping
            out, _ = self.rotary.forward_store(
                positions, out, k.view(kv_heads), v.view(kv_heads), attn.key_cache,
                attn.value_cache, slots, *self._norms(),
            )  # fmt: skip
        elif variant == "no-rope":
            out = attn.attend(out)
        return linear(out.flatten(1), self.o_proj.weight, self.o_proj.bias)

    return attend_qkv


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--steps", type=int, default=60, help="steps per timed pass (3 passes)")
    p.add_argument("--prompt-len", type=int, default=512)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("decode_breakdown.py needs a CUDA device")
    target, _ = SHAPES["qwen3-8b"].dirs()
    kw = dict(load_format="dummy", max_model_len=args.prompt_len + 320, max_num_seqs=8)
    prompt = torch.randint(1000, 100_000, (args.prompt_len,)).tolist()
    rows = []
    try:
        for variant in args.variants:
            # Patched before the engine is built: its CUDA graphs capture the patched forward.
            SelfAttention.attend_qkv = attend_qkv_without(variant)
            llm = LLM(str(target), **kw)
            passes = [mean_step_ms(llm, prompt, 1, args.steps) for _ in range(3)]
            rows.append([variant, statistics.median(passes), min(passes), max(passes)])
            del llm
            gc.collect()
            torch.cuda.empty_cache()
    finally:
        SelfAttention.attend_qkv = _FULL
    full = next((r[1] for r in rows if r[0] == "full"), float("nan"))
    print_table(
        f"batch-1 decode step, Qwen3-8B shapes, {args.prompt_len}-token prompt (ms; median, "
        f"min, max of 3 x {args.steps} steps)",
        ["variant", "step", "min", "max", "full - this"],
        [[*r, full - r[1]] for r in rows],
    )


if __name__ == "__main__":
    main()
