"""GPU timings of the Triton kernels against their torch twins (bf16, Qwen3-8B-like heads).

    python benchmarks/kernel_bench.py [--tune]

Prints one line per case: torch twin time, Triton time, speed-up, and the largest difference
between the two outputs. `--tune` also sweeps the attention launch options per case.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
from collections.abc import Callable
from functools import partial

import torch
import triton.testing

from blockdraft.kernels.dflash_inputs import prepare_dflash_inputs_torch
from blockdraft.kernels.paged_attention import paged_attention, store_kv
from blockdraft.kernels.triton_activation import silu_mul_torch, triton_silu_mul
from blockdraft.kernels.triton_attention import choose_num_splits, triton_paged_attention
from blockdraft.kernels.triton_dflash_inputs import prepare_dflash_inputs
from blockdraft.kernels.triton_kv_store import triton_store_kv
from blockdraft.kernels.triton_rmsnorm import rms_norm_torch, triton_rms_norm
from blockdraft.kernels.triton_rope import qk_norm_rope_torch, triton_qk_norm_rope
from blockdraft.layers.rotary import RotaryEmbedding
from blockdraft.runtime.host_batch import build_attention_metadata

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
INTERMEDIATE = 12288  # Qwen3-8B's MLP width
DTYPE = torch.bfloat16

# name: (cached keys per sequence, query rows per sequence, sequences, causal, window)
ATTENTION_CASES = {
    "decode 64x1 @1k": (1024, 1, 64, True, None),
    "decode 8x1 @8k": (8192, 1, 8, True, None),
    "decode 1x1 @32k": (32768, 1, 1, True, None),
    "verify 32x16 @2k": (2048, 16, 32, True, None),
    "verify 4x16 @16k": (16384, 16, 4, True, None),
    "drafter 32x16 @2k non-causal": (2048, 16, 32, False, None),
    "drafter 32x16 @2k window 512": (2048, 16, 32, True, 512),
    "prefill 1x4096 fresh": (0, 4096, 1, True, None),
    "prefill 4x1024 @2k": (2048, 1024, 4, True, None),
}

TUNE_CASES = ("decode 8x1 @8k", "verify 32x16 @2k", "prefill 1x4096 fresh")


def bench(fn: Callable[[], object]) -> float:  # ms
    return triton.testing.do_bench(fn, warmup=10, rep=50)


def attention_case(
    cached: int, rows: int, seqs: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, object]:
    total = cached + rows
    per_seq = -(-total // BLOCK)
    num_blocks = per_seq * seqs + 1
    perm = torch.randperm(num_blocks - 1).tolist()
    tables = [perm[i * per_seq : (i + 1) * per_seq] for i in range(seqs)]
    meta = build_attention_metadata(tables, [cached] * seqs, [rows] * seqs, BLOCK, device)
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    k = torch.randn(shape, device=device, dtype=DTYPE)
    v = torch.randn(shape, device=device, dtype=DTYPE)
    q = torch.randn(rows * seqs, HEADS, HEAD_DIM, device=device, dtype=DTYPE)
    return q, k, v, meta


def run_attention(device: torch.device, tune: bool) -> None:
    scale = HEAD_DIM**-0.5
    for name, (cached, rows, seqs, causal, window) in ATTENTION_CASES.items():
        q, k, v, meta = attention_case(cached, rows, seqs, device)
        call = (q, k, v, meta, scale, causal, window)
        splits = choose_num_splits(rows, cached + rows, seqs, KV_HEADS, device)
        ref = paged_attention(*call)
        err = (triton_paged_attention(*call).float() - ref.float()).abs().max().item()
        t_torch = bench(partial(paged_attention, *call))
        t_triton = bench(partial(triton_paged_attention, *call))
        extra = ""
        if splits > 1:
            t_unsplit = bench(partial(triton_paged_attention, *call, num_splits=1))
            extra = f" splits={splits} (unsplit {t_unsplit:.3f} ms)"
        print(
            f"attention {name:32s} torch {t_torch:8.3f} ms  triton {t_triton:8.3f} ms  "
            f"x{t_torch / t_triton:6.2f}  max|diff| {err:.3g}{extra}",
            flush=True,
        )
        if not (tune and name in TUNE_CASES):
            continue
        best = []
        for bm, bn, nw, ns in itertools.product((16, 64, 128), (32, 64, 128), (4, 8), (2, 3)):
            opts = dict(block_m=bm, block_n=bn, num_warps=nw, num_stages=ns)
            try:
                best.append((bench(partial(triton_paged_attention, *call, **opts)), opts))
            except Exception as e:  # out of shared memory and the like
                print(f"    {opts}: {type(e).__name__}")
        for t, opts in sorted(best, key=lambda b: b[0])[:3]:
            print(f"    tune {opts}: {t:.3f} ms", flush=True)


def run_others(device: torch.device) -> None:
    for tokens in (64, 8192):
        key = torch.randn(tokens, KV_HEADS, HEAD_DIM, device=device, dtype=DTYPE)
        value = torch.randn_like(key)
        num_blocks = tokens // BLOCK + 2
        kc = torch.zeros(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, device=device, dtype=DTYPE)
        vc = torch.zeros_like(kc)
        slots = torch.randperm((num_blocks - 1) * BLOCK, device=device)[:tokens]
        t_torch = bench(partial(store_kv, key, value, kc, vc, slots))
        t_triton = bench(partial(triton_store_kv, key, value, kc, vc, slots))
        print(
            f"store_kv  {tokens:5d} tokens{'':20s} torch {t_torch:8.3f} ms  "
            f"triton {t_triton:8.3f} ms  x{t_torch / t_triton:6.2f}",
            flush=True,
        )
    for rows in (64, 8192):
        x = torch.randn(rows, 4096, device=device, dtype=DTYPE)
        r = torch.randn_like(x)
        w = torch.randn(4096, device=device, dtype=DTYPE)
        a, ra = rms_norm_torch(x, w, 1e-6, r)
        b, rb = triton_rms_norm(x, w, 1e-6, r)
        err = max((a.float() - b.float()).abs().max().item(), (ra - rb).abs().max().item())
        t_torch = bench(partial(rms_norm_torch, x, w, 1e-6, r))
        t_triton = bench(partial(triton_rms_norm, x, w, 1e-6, r))
        print(
            f"rms_norm+residual {rows:5d}x4096{'':14s} torch {t_torch:8.3f} ms  "
            f"triton {t_triton:8.3f} ms  x{t_torch / t_triton:6.2f}  max|diff| {err:.3g}",
            flush=True,
        )
    run_rope(device)
    run_silu_mul(device)
    num_reqs, n = 64, 15
    num_ctx = torch.randint(1, n + 2, (num_reqs,), device=device)
    rows = torch.full((num_reqs,), n + 1, device=device)
    starts = torch.cumsum(rows, 0) - rows
    positions = torch.randint(100, 4000, (num_reqs,), device=device)
    tables = torch.randint(1, 10000, (128, 4096 // BLOCK + 2), device=device)
    proposers = torch.arange(num_reqs, device=device)  # every request drafts
    tokens = torch.randint(0, 1000, (num_reqs,), device=device)
    args = (tokens, positions, starts, num_ctx, proposers, tables)
    kwargs = dict(
        block_size=BLOCK, num_spec=n, mask_token_id=7, num_reqs_padded=128, num_ctx_rows=4096
    )
    a = prepare_dflash_inputs_torch(*args, **kwargs)
    b = prepare_dflash_inputs(*args, **kwargs)
    same = all(torch.equal(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    t_torch = bench(partial(prepare_dflash_inputs_torch, *args, **kwargs))
    t_triton = bench(partial(prepare_dflash_inputs, *args, **kwargs))
    print(
        f"dflash_inputs 64 reqs N=15{'':14s} torch {t_torch:8.3f} ms  triton {t_triton:8.3f} ms"
        f"  x{t_torch / t_triton:6.2f}  equal {same}",
        flush=True,
    )


def run_rope(device: torch.device) -> None:
    rotary = RotaryEmbedding(HEAD_DIM, 40960, 1e6).to(device)
    for tokens in (1, 64, 8192):
        # q and k as strided views of one qkv projection, Qwen3's q/k norm weights.
        qkv = torch.randn(tokens, HEADS + 2 * KV_HEADS, HEAD_DIM, device=device, dtype=DTYPE)
        q, k = qkv[:, :HEADS], qkv[:, HEADS : HEADS + KV_HEADS]
        positions = torch.randint(0, 40960, (tokens,), device=device)
        q_w = 1 + 0.1 * torch.randn(HEAD_DIM, device=device, dtype=DTYPE)
        k_w = 1 + 0.1 * torch.randn(HEAD_DIM, device=device, dtype=DTYPE)
        call = (q, k, positions, rotary.cos_cache, rotary.sin_cache, q_w, k_w, 1e-6)
        a, b = qk_norm_rope_torch(*call), triton_qk_norm_rope(*call)
        err = max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b, strict=True))
        t_torch = bench(partial(qk_norm_rope_torch, *call))
        t_triton = bench(partial(triton_qk_norm_rope, *call))
        print(
            f"qk_norm+rope {tokens:5d} tokens 32q+8kv{'':9s} torch {t_torch:8.3f} ms  "
            f"triton {t_triton:8.3f} ms  x{t_torch / t_triton:6.2f}  max|diff| {err:.3g}",
            flush=True,
        )


def run_silu_mul(device: torch.device) -> None:
    for rows in (1, 64, 8192):
        gate = torch.randn(rows, INTERMEDIATE, device=device, dtype=DTYPE)
        up = torch.randn_like(gate)
        err = (silu_mul_torch(gate, up).float() - triton_silu_mul(gate, up).float()).abs().max()
        t_torch = bench(partial(silu_mul_torch, gate, up))
        t_triton = bench(partial(triton_silu_mul, gate, up))
        print(
            f"silu_mul {rows:5d}x{INTERMEDIATE}{'':22s} torch {t_torch:8.3f} ms  "
            f"triton {t_triton:8.3f} ms  x{t_torch / t_triton:6.2f}  max|diff| {err.item():.3g}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tune", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    device = torch.device("cuda")
    print(
        torch.cuda.get_device_name(device), "torch", torch.__version__, "triton", triton.__version__
    )
    run_attention(device, args.tune)
    run_others(device)


if __name__ == "__main__":
    main()
