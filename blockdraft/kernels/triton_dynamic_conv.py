"""`dynamic_conv.grouped_dynamic_causal_conv_torch` in one launch: each program convolves a
slice of one row's channels (float32 accumulation), reading the previous rows of its own block
only. The torch twin is about eight launches per call, four calls per DFlash2 drafter layer.

`triton_conv_rms_norm` is `dynamic_conv.conv_rms_norm_torch`: a sub-block's closing convolution
and the residual add + RMSNorm after it, one program per row, rounded as the two kernels
(this one and `triton_rmsnorm`) round, so the result is theirs bit for bit in one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _conv_row(
    x_ptr, dyn_ptr, base_ptr, row, offs, ok, stride_x, stride_dyn_row, stride_dyn_k, hidden,
    block_len, GROUP_SIZE: tl.constexpr, KERNEL_SIZE: tl.constexpr,
):  # fmt: skip
    t = row % block_len  # the row's offset in its block: earlier offsets see zeros
    acc = tl.zeros(offs.shape, dtype=tl.float32)
    for o in tl.static_range(KERNEL_SIZE):
        seen = ok & (t >= o)
        xv = tl.load(x_ptr + (row - o) * stride_x + offs, mask=seen, other=0.0).to(tl.float32)
        bv = tl.load(base_ptr + o * hidden + offs, mask=ok, other=0.0).to(tl.float32)
        dyn = dyn_ptr + row * stride_dyn_row + o * stride_dyn_k + offs // GROUP_SIZE
        dv = tl.load(dyn, mask=ok, other=0.0).to(tl.float32)
        acc += (bv + dv) * xv
    return acc


@triton.jit
def _dynamic_conv_kernel(
    x_ptr,  # [rows, hidden], unit column stride
    dyn_ptr,  # [rows, kernel_size, groups], unit group stride
    base_ptr,  # [kernel_size, hidden], contiguous
    out_ptr,  # [rows, hidden], contiguous
    stride_x,
    stride_dyn_row,
    stride_dyn_k,
    hidden,
    block_len,
    GROUP_SIZE: tl.constexpr,
    KERNEL_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < hidden
    acc = _conv_row(
        x_ptr, dyn_ptr, base_ptr, row, offs, ok, stride_x, stride_dyn_row, stride_dyn_k, hidden,
        block_len, GROUP_SIZE, KERNEL_SIZE,
    )  # fmt: skip
    tl.store(out_ptr + row * hidden + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _conv_rms_norm_kernel(
    x_ptr,  # [rows, hidden], unit column stride
    dyn_ptr,  # [rows, kernel_size, groups], unit group stride
    base_ptr,  # [kernel_size, hidden], contiguous
    residual_ptr,  # [rows, hidden], contiguous
    weight_ptr,  # [hidden]
    out_ptr,  # [rows, hidden], contiguous
    residual_out_ptr,  # [rows, hidden], contiguous
    stride_x,
    stride_dyn_row,
    stride_dyn_k,
    hidden,
    block_len,
    eps,
    GROUP_SIZE: tl.constexpr,
    KERNEL_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < hidden
    acc = _conv_row(
        x_ptr, dyn_ptr, base_ptr, row, offs, ok, stride_x, stride_dyn_row, stride_dyn_k, hidden,
        block_len, GROUP_SIZE, KERNEL_SIZE,
    )  # fmt: skip
    dtype = x_ptr.dtype.element_ty
    r = tl.load(residual_ptr + row * hidden + offs, mask=ok, other=0.0).to(tl.float32)
    # The convolution's output and the sum each rounded to the activation dtype, then the
    # norm as triton_rmsnorm computes it.
    s = (acc.to(dtype).to(tl.float32) + r).to(dtype)
    tl.store(residual_out_ptr + row * hidden + offs, s, mask=ok)
    s32 = s.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(s32 * s32, axis=0) / hidden + eps)
    normed = (s32 * rstd).to(dtype).to(tl.float32)
    w = tl.load(weight_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * hidden + offs, (normed * w).to(out_ptr.dtype.element_ty), mask=ok)


def triton_grouped_dynamic_causal_conv(
    x: torch.Tensor,  # [num_blocks * block_len, hidden]
    dynamic: torch.Tensor,  # [num_blocks * block_len, kernel_size, groups]
    base: torch.Tensor,  # [kernel_size, hidden]
    block_len: int,
) -> torch.Tensor:  # [num_blocks * block_len, hidden]
    rows, hidden = x.shape
    kernel_size, groups = dynamic.shape[1:]
    if rows % block_len or hidden % groups:
        raise ValueError(
            f"{rows} rows are not whole blocks of {block_len}, or {groups} groups do not "
            f"divide hidden {hidden}"
        )
    if x.stride(1) != 1:
        x = x.contiguous()
    if dynamic.stride(2) != 1:
        dynamic = dynamic.contiguous()
    base = base.contiguous()
    out = torch.empty(rows, hidden, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    block = min(1024, triton.next_power_of_2(hidden))
    _dynamic_conv_kernel[(rows, triton.cdiv(hidden, block))](
        x,
        dynamic,
        base,
        out,
        x.stride(0),
        dynamic.stride(0),
        dynamic.stride(1),
        hidden,
        block_len,
        GROUP_SIZE=hidden // groups,
        KERNEL_SIZE=kernel_size,
        BLOCK=block,
        num_warps=max(1, min(4, block // 256)),
    )
    return out


def triton_conv_rms_norm(
    x: torch.Tensor,  # [num_blocks * block_len, hidden]
    dynamic: torch.Tensor,  # [num_blocks * block_len, kernel_size, groups]
    base: torch.Tensor,  # [kernel_size, hidden]
    block_len: int,
    norm_weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor,  # [num_blocks * block_len, hidden], x's dtype
) -> tuple[torch.Tensor, torch.Tensor]:  # normed, the new residual stream
    """`dynamic_conv.conv_rms_norm_torch` in one launch."""
    rows, hidden = x.shape
    kernel_size, groups = dynamic.shape[1:]
    if rows % block_len or hidden % groups or residual.shape != x.shape:
        raise ValueError(
            f"{rows} rows are not whole blocks of {block_len}, {groups} groups do not divide "
            f"hidden {hidden}, or residual {tuple(residual.shape)} differs from x"
        )
    if residual.dtype != x.dtype:  # as triton_rms_norm: the layer sends mixed dtypes to torch
        raise ValueError(f"residual dtype {residual.dtype} differs from x's {x.dtype}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if dynamic.stride(2) != 1:
        dynamic = dynamic.contiguous()
    residual = residual.contiguous()
    out = torch.empty(rows, hidden, dtype=torch.promote_types(norm_weight.dtype, x.dtype),
                      device=x.device)  # fmt: skip
    residual_out = torch.empty_like(residual)
    if rows == 0:
        return out, residual_out
    block = triton.next_power_of_2(hidden)
    _conv_rms_norm_kernel[(rows,)](
        x,
        dynamic,
        base.contiguous(),
        residual,
        norm_weight.contiguous(),
        out,
        residual_out,
        x.stride(0),
        dynamic.stride(0),
        dynamic.stride(1),
        hidden,
        block_len,
        eps,
        GROUP_SIZE=hidden // groups,
        KERNEL_SIZE=kernel_size,
        BLOCK=block,
        num_warps=min(16, max(1, block // 256)),
    )
    return out, residual_out
