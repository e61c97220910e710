"""Fused SiLU-and-multiply of the gated MLP: `silu(gate) * up` in one pass.

`silu_mul_torch` (in `blockdraft.kernels.rope`) is the specification: silu in float32 rounded
to the gate's dtype, then the product rounded to the promoted dtype, as the two eager ops do.
The eager version is two launches and writes (then rereads) the silu activations.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from blockdraft.kernels.pdl import launch_options, pdl_enabled, pdl_start
from blockdraft.kernels.rope import silu_mul_torch

__all__ = ["silu_mul_torch", "triton_silu_mul"]


@triton.jit
def _silu_mul_kernel(
    gate_ptr,  # [num_rows, cols], last dim contiguous
    up_ptr,  # [num_rows, cols]
    out_ptr,  # [num_rows, cols]
    stride_g,
    stride_u,
    stride_o,
    cols,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch (blockdraft.kernels.pdl)
):
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < cols
    g = tl.load(gate_ptr + row * stride_g + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * stride_u + offs, mask=ok, other=0.0).to(tl.float32)
    # F.silu rounds its output to the gate's dtype before the multiply: round the same way.
    s = (g / (1.0 + tl.exp(-g))).to(gate_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (s * u).to(out_ptr.dtype.element_ty), mask=ok)


def triton_silu_mul(
    gate: torch.Tensor,  # [..., intermediate]
    up: torch.Tensor,  # [..., intermediate]
) -> torch.Tensor:  # [..., intermediate], new and contiguous
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    cols = gate.shape[-1]
    out = torch.empty(
        gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype), device=gate.device
    )
    # Halves of a fused gate_up projection keep their row stride; only unit column stride
    # is needed.
    g_rows, u_rows = gate.reshape(-1, cols), up.reshape(-1, cols)
    if g_rows.stride(-1) != 1:
        g_rows = g_rows.contiguous()
    if u_rows.stride(-1) != 1:
        u_rows = u_rows.contiguous()
    out_rows = out.view(-1, cols)
    num_rows = out_rows.shape[0]
    if num_rows == 0 or cols == 0:
        return out
    block = min(1024, triton.next_power_of_2(cols))
    pdl = pdl_enabled(gate.device)
    _silu_mul_kernel[(num_rows, triton.cdiv(cols, block))](
        g_rows,
        u_rows,
        out_rows,
        g_rows.stride(0),
        u_rows.stride(0),
        out_rows.stride(0),
        cols,
        BLOCK=block,
        PDL=pdl,
        num_warps=max(1, min(4, block // 256)),
        **launch_options(pdl),
    )
    return out
