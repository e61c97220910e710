"""Probe (Hopper): would a TMA + wgmma skinny GEMM stream weights faster than the skinny kernel?

    python benchmarks/tma_gemm_probe.py

A minimal kernel streams W through tensor-memory-accelerator copies into a multi-stage
shared-memory ring and multiplies on tensor cores (x padded to 16 rows by the copy's zero
fill; split-K partials summed by torch). For each Qwen3-8B projection at M = 1 and 16 it sweeps
block shape, stages and split-K and prints the best TB/s next to `skinny_linear` with its
default table, both timed as benchmarks/gemv_bench.py times (CUDA graphs, weights cycled past
the L2). On an H200 it is no better at M = 1 and 1-6% better at M = 16, so the engine keeps
its kernel (docs/benchmark-history.md). CUDA (sm_90) only.
"""

import itertools
import math
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.gemv_bench import ROTATE_BYTES, SHAPES, time_per_call  # noqa: E402
from blockdraft.kernels.triton_linear import skinny_linear  # noqa: E402


@triton.jit
def _tma_skinny_kernel(
    w_desc,  # TMA descriptor of W [N, K], box [BLOCK_N, BLOCK_K]
    x_desc,  # TMA descriptor of x [M, K], box [16, BLOCK_K]
    out_ptr,  # [M, N] x's dtype, or with split-K the fp32 workspace [SPLIT, M, N]
    M,
    N,
    k_per_split,
    stride_os,
    stride_om,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n0 = pid_n * BLOCK_N
    k0 = pid_k * k_per_split
    acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    for k in tl.range(k0, k0 + k_per_split, BLOCK_K, num_stages=NUM_STAGES):
        w = w_desc.load([n0, k])  # [BLOCK_N, BLOCK_K]
        x = x_desc.load([0, k])  # [16, BLOCK_K], rows past M zero
        acc = tl.dot(w, tl.trans(x), acc)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, 16)
    ptrs = out_ptr + pid_k * stride_os + offs_m[None, :] * stride_om + offs_n[:, None]
    tl.store(
        ptrs, acc.to(out_ptr.dtype.element_ty), mask=(offs_n < N)[:, None] & (offs_m < M)[None, :]
    )


def make_call(
    x: torch.Tensor, w: torch.Tensor, block_n: int, block_k: int, stages: int, split: int
):  # -> a function computing x @ w.T into one output buffer
    warps = 4
    m, k = x.shape
    n = w.shape[0]
    k_per_split = k // split
    w_desc = TensorDescriptor(w, shape=[n, k], strides=[k, 1], block_shape=[block_n, block_k])
    x_desc = TensorDescriptor(x, shape=[m, k], strides=[k, 1], block_shape=[16, block_k])
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    ws = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    grid = (triton.cdiv(n, block_n), split)

    def call():
        _tma_skinny_kernel[grid](
            w_desc,
            x_desc,
            ws,
            m,
            n,
            k_per_split,
            ws.stride(0),
            ws.stride(-2),
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            NUM_STAGES=stages,
            num_warps=warps,
            num_stages=stages,
        )
        if split > 1:
            out.copy_(ws.sum(0))
        return out

    return call


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("tma_gemm_probe.py times CUDA kernels and needs a Hopper GPU; none is visible.")
    torch.manual_seed(0)
    t0 = time.perf_counter()
    for name, (n, k, _) in SHAPES.items():
        nbytes = n * k * 2
        copies = max(2, math.ceil(ROTATE_BYTES / nbytes))
        weights = [torch.randn(n, k, device="cuda").div_(math.sqrt(k)).bfloat16()]
        weights += [weights[0].clone() for _ in range(copies - 1)]
        for m in (1, 16):
            x = torch.randn(m, k, device="cuda").bfloat16()
            ref = x.float() @ weights[0].float().T
            base = time_per_call([lambda w=w, x=x: skinny_linear(x, w) for w in weights], 20, 3)
            best = None
            for bn, bk, st, split in itertools.product(
                (64, 128), (64, 128, 256), (3, 4, 6), (1, 2, 4)
            ):
                if k % (bk * split):
                    continue
                try:
                    calls = [make_call(x, w, bn, bk, st, split) for w in weights]
                    got = calls[0]()
                    torch.cuda.synchronize()
                    err = (got.float() - ref).abs().max().item() / ref.abs().max().item()
                    if not err < 1e-2:
                        raise RuntimeError(f"err {err}")
                    t = time_per_call(calls, 20, 3)
                except Exception as e:  # noqa: BLE001
                    print(f"  skip {name} M={m} {bn}x{bk} st{st} s{split}: {str(e)[:100]}")
                    continue
                if best is None or t < best[0]:
                    best = (t, f"{bn}x{bk} st{st} s{split}")
            tma = f"{nbytes / best[0] / 1e12:.2f} TB/s {best[1]}" if best else "none"
            print(
                f"{name:>8} M={m:<2} skinny {nbytes / base / 1e12:.2f} TB/s  tma {tma}  "
                f"[{time.perf_counter() - t0:.0f}s]",
                flush=True,
            )
        del weights
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
