"""Fused RMSNorm, optionally preceded by the residual add of a pre-norm transformer block.

`rms_norm_torch` (in `blockdraft.kernels.rmsnorm`) is the specification and what
`blockdraft.layers.norm.RMSNorm` runs off the Triton path: normalise in float32, round back to
the activation dtype, then scale by the weight in the dtype torch promotion gives (weight * x).
With a residual, the sum `x + residual` is rounded to the activation dtype first (as an eager
`x + residual` would be), returned as the new residual stream, and normalised. The kernel reads
each row once and writes the outputs once, instead of the ~8 elementwise passes of the eager
version. With `offset` (Qwen3.5's norms, weights stored as offsets from one) the scale is
`1 + weight` in float32 before the one rounding, as `rms_norm_torch(..., offset=True)`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from blockdraft.kernels.pdl import launch_options, pdl_enabled, pdl_start
from blockdraft.kernels.rmsnorm import rms_norm_torch

__all__ = ["rms_norm_torch", "triton_rms_norm"]


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [num_rows, hidden]
    residual_ptr,  # [num_rows, hidden]; read when HAS_RESIDUAL
    weight_ptr,  # [hidden]
    out_ptr,  # [num_rows, hidden]
    residual_out_ptr,  # [num_rows, hidden]; written when HAS_RESIDUAL
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    hidden,
    eps,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    OFFSET: tl.constexpr,  # scale by 1 + weight in float32, one rounding
    PDL: tl.constexpr,  # launched with programmatic dependent launch (blockdraft.kernels.pdl)
):
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=ok, other=0.0)
        # Round the sum to the activation dtype, as the eager add does, so both paths
        # normalise (and carry forward) the very same residual stream.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + offs, x, mask=ok)
    x32 = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / hidden + eps)
    w = tl.load(weight_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    if OFFSET:
        out = x32 * rstd * (1.0 + w)
    else:
        out = (x32 * rstd).to(x_ptr.dtype.element_ty).to(tl.float32) * w
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=ok)


def triton_rms_norm(
    x: torch.Tensor,  # [..., hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., hidden], same dtype as x
    *,
    out: torch.Tensor | None = None,  # [..., hidden] preallocated normed output
    residual_out: torch.Tensor | None = None,  # [..., hidden]; may be `residual` (in place)
    offset: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # normed [..., hidden] (, new residual)
    hidden = x.shape[-1]
    rows = x.reshape(-1, hidden)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out_dtype = x.dtype if offset else torch.promote_types(weight.dtype, x.dtype)
    if out is None:
        out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    out_rows = out.view(-1, hidden)
    if residual is not None:
        if residual.dtype != x.dtype:
            raise ValueError(f"residual dtype {residual.dtype} differs from x's {x.dtype}")
        res_rows = residual.reshape(-1, hidden)
        if res_rows.stride(-1) != 1:
            res_rows = res_rows.contiguous()
        if residual_out is None:
            residual_out = torch.empty_like(x, memory_format=torch.contiguous_format)
        res_out_rows = residual_out.view(-1, hidden)
    else:
        res_rows = res_out_rows = rows  # unused without HAS_RESIDUAL
    num_rows = rows.shape[0]
    if num_rows:
        block = triton.next_power_of_2(hidden)
        pdl = pdl_enabled(x.device)
        _rms_norm_kernel[(num_rows,)](
            rows,
            res_rows,
            weight,
            out_rows,
            res_out_rows,
            rows.stride(0),
            res_rows.stride(0),
            out_rows.stride(0),
            res_out_rows.stride(0),
            hidden,
            eps,
            BLOCK=block,
            HAS_RESIDUAL=residual is not None,
            OFFSET=offset,
            PDL=pdl,
            num_warps=min(16, max(1, block // 256)),
            **launch_options(pdl),
        )
    return out if residual is None else (out, residual_out)
