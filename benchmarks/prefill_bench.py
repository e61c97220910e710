"""Prefill of a hybrid target's shapes: its Gated DeltaNet layers' chunked rule in Triton
(`KernelPolicy.triton_chunked_prefill`, two launches for every prefill chunk of a step) against
the rule's torch twin (a loop over the chunks' sequences), for the whole engine (B prompts of L
tokens, one token out, random bf16 weights made on the GPU) and for the rule alone on the
shape's heads (B sequences packed).

    python -m benchmarks.prefill_bench [--shape qwen3.5-27b] [--prompts 16] [--prompt-len 512]
        [--repeats 3] [--json F]

Needs an NVIDIA GPU.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks.common import hardware, now, print_table
from benchmarks.shapes import SHAPES
from blockdraft.kernels.gated_delta_rule import chunk_gated_delta_rule_varlen_torch
from blockdraft.kernels.policy import KernelPolicy


def rule_inputs(
    lengths: list[int], cfg: dict, device: str, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """Random packed inputs of the chunked rule for sequences of `lengths` on `cfg`'s linear
    attention heads: query, key, value, g, beta, initial states, cu_seqlens."""
    n, hk, hv = sum(lengths), cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    q, k = (torch.randn(n, hk, dk, device=device, dtype=dtype) for _ in range(2))
    v = torch.randn(n, hv, dv, device=device, dtype=dtype)
    g = -torch.rand(n, hv, device=device) * 0.5
    beta = torch.rand(n, hv, device=device, dtype=dtype)
    state = torch.randn(len(lengths), hv, dk, dv, device=device) * 0.1
    cu_seqlens = torch.tensor([0, *lengths], device=device).cumsum(0)
    return q, k, v, g, beta, state, cu_seqlens


def rule_times(
    lengths: list[int], cfg: dict, device: str, dtype: torch.dtype, repeats: int
) -> dict:
    """Mean ms of the Triton rule and of its torch twin over `repeats` calls (after one
    warm-up each), and the Triton outputs' largest error relative to the twin's."""
    from blockdraft.kernels.triton_chunk_gated_delta_rule import triton_chunk_gated_delta_rule

    args = rule_inputs(lengths, cfg, device, dtype)
    host = args[-1].tolist()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def timed(fn) -> tuple[float, tuple[torch.Tensor, torch.Tensor]]:  # noqa: ANN001
        result = fn()
        sync()
        t0 = now()
        for _ in range(repeats):
            fn()
        sync()
        return (now() - t0) / repeats * 1e3, result

    triton_ms, (out, final) = timed(lambda: triton_chunk_gated_delta_rule(*args))
    twin_ms, (out_ref, final_ref) = timed(lambda: chunk_gated_delta_rule_varlen_torch(*args, host))

    def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
        return ((x.float() - ref.float()).abs().max() / ref.float().abs().max()).item()

    return {"triton_ms": triton_ms, "twin_ms": twin_ms,
            "out_rel_err": rel(out, out_ref), "state_rel_err": rel(final, final_ref)}  # fmt: skip


def engine_prefill_ms(
    target: Path, prompts: list[list[int]], policy: KernelPolicy, repeats: int
) -> float:
    """Fastest of `repeats` prefills of all `prompts` at once (one token out) by an engine with
    `policy`, after a warm-up that compiles the kernels."""
    from blockdraft import LLM, SamplingParams

    llm = LLM(
        str(target), load_format="dummy", kernel_policy=policy, max_num_seqs=len(prompts),
        max_model_len=max(map(len, prompts)) + 64, gpu_memory_utilization=0.95,
    )  # fmt: skip
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate(prompts[:2], one, use_tqdm=False)
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = now()
        llm.generate(prompts, one, use_tqdm=False)
        torch.cuda.synchronize()
        times.append(now() - t0)
    llm.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return min(times) * 1e3


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3.5-27b", choices=[n for n in SHAPES if "3.5" in n])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("prefill_bench needs an NVIDIA GPU")
    if min(args.prompts, args.prompt_len, args.repeats) < 1:
        raise SystemExit("--prompts, --prompt-len and --repeats must be >= 1")
    shape = SHAPES[args.shape]
    lengths = [args.prompt_len] * args.prompts
    rule = rule_times(lengths, shape.config, "cuda", torch.bfloat16, max(args.repeats, 5))
    target, _ = shape.dirs()
    vocab = shape.config["vocab_size"]
    prompts = torch.randint(1000, vocab - 1000, (args.prompts, args.prompt_len)).tolist()
    engine = {}
    for name, policy in tqdm(
        [("Triton", KernelPolicy()), ("torch twin", KernelPolicy(triton_chunked_prefill=False))],
        desc="engines",
    ):
        engine[name] = engine_prefill_ms(target, prompts, policy, args.repeats)
    tokens = args.prompts * args.prompt_len
    print_table(
        f"{args.shape} prefill, {args.prompts} x {args.prompt_len} tokens, bf16 ({hardware()})",
        ["what", "Triton ms", "torch twin ms", "twin / Triton"],
        [
            [
                f"engine, {tokens} tokens",
                engine["Triton"],
                engine["torch twin"],
                engine["torch twin"] / engine["Triton"],
            ],
            [
                "chunked rule alone, one layer",
                rule["triton_ms"],
                rule["twin_ms"],
                rule["twin_ms"] / rule["triton_ms"],
            ],
        ],  # fmt: skip
    )
    print(f"rule's largest error relative to the twin: out {rule['out_rel_err']:.1e}, "
          f"final states {rule['state_rel_err']:.1e} (bf16 inputs, tf32 dots)")  # fmt: skip
    result = {"hardware": hardware(), "date": datetime.date.today().isoformat(),
              "args": vars(args), "engine_ms": engine, "rule": rule}  # fmt: skip
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
