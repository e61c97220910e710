"""`dynamic_conv.grouped_dynamic_causal_conv_torch` in one launch: each program convolves a
slice of one row's channels (float32 accumulation), reading the previous rows of its own block
only. The torch twin is about eight launches per call, four calls per DFlash2 drafter layer."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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
    t = row % block_len  # the row's offset in its block: earlier offsets see zeros
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for o in tl.static_range(KERNEL_SIZE):
        seen = ok & (t >= o)
        xv = tl.load(x_ptr + (row - o) * stride_x + offs, mask=seen, other=0.0).to(tl.float32)
        bv = tl.load(base_ptr + o * hidden + offs, mask=ok, other=0.0).to(tl.float32)
        dyn = dyn_ptr + row * stride_dyn_row + o * stride_dyn_k + offs // GROUP_SIZE
        dv = tl.load(dyn, mask=ok, other=0.0).to(tl.float32)
        acc += (bv + dv) * xv
    tl.store(out_ptr + row * hidden + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


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
