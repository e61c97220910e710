"""`dynamic_conv.grouped_dynamic_causal_conv_torch` in one launch: each program convolves a
slice of one row's channels (float32 accumulation), reading the previous rows of its own block
only. The torch twin is about eight launches per call, four calls per DFlash2 drafter layer.

`triton_conv_rms_norm` is `dynamic_conv.conv_rms_norm_torch`: a sub-block's closing convolution
and the residual add + RMSNorm after it, one program per row, rounded as the two kernels
(this one and `triton_rmsnorm`) round, so the result is theirs bit for bit in one launch.

`triton_conv_prepare` is `dynamic_conv.conv_prepare_torch`: the kernel projection of a few rows
and the opening convolution with its first half, in one launch. Alone, the projection is a
GEMM of few rows by a wide weight with few outputs (4096 -> 1024 for a Qwen3-8B drafter), which
leaves most SMs idle and waits on its own launch; here each program projects its rows onto
the kernel weights of a few groups (tensor cores, every K), writes them (the closing
convolution reads the second half), and convolves the channels of those groups with the first
half it has just written.
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


@triton.jit
def _conv_prepare_kernel(
    x_ptr,  # [rows, hidden], unit column stride
    w_ptr,  # [2 * kernel_size * groups, hidden] kernel projection, contiguous
    base_ptr,  # [kernel_size, hidden] the first half's static kernel, contiguous
    dyn_ptr,  # [rows, 2 * kernel_size * groups] out: the projection, contiguous
    out_ptr,  # [rows, hidden] out: x convolved, contiguous
    rows,
    stride_x,
    hidden,
    groups,
    block_len,
    GROUP_SIZE: tl.constexpr,
    KERNEL_SIZE: tl.constexpr,
    GROUPS_PER_PROGRAM: tl.constexpr,
    BLOCK_J: tl.constexpr,  # >= 2 * KERNEL_SIZE * GROUPS_PER_PROGRAM, a power of two
    BLOCK_C: tl.constexpr,  # >= GROUPS_PER_PROGRAM * GROUP_SIZE, a power of two
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,  # float32 inputs: full-precision products, not TF32
):
    pid_m = tl.program_id(0)
    first_group = tl.program_id(1) * GROUPS_PER_PROGRAM
    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    r_ok = r < rows
    r_load = tl.minimum(r, rows - 1).to(tl.int64)  # clamped: unpredicated loads
    # Projection outputs of this program's groups: (half, offset, group) -> weight row.
    j = tl.arange(0, BLOCK_J)
    per_half = KERNEL_SIZE * GROUPS_PER_PROGRAM
    half, o_j, g_j = j // per_half, (j // GROUPS_PER_PROGRAM) % KERNEL_SIZE, j % GROUPS_PER_PROGRAM
    group_j = first_group + g_j
    j_ok = (j < 2 * per_half) & (group_j < groups)
    w_row = tl.where(j_ok, (half * KERNEL_SIZE + o_j) * groups + group_j, 0).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_J), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < hidden
        xv = tl.load(x_ptr + r_load[:, None] * stride_x + k[None, :], mask=k_ok[None, :], other=0.0)
        wv = tl.load(w_ptr + w_row[:, None] * hidden + k[None, :], mask=k_ok[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(xv, tl.trans(wv), input_precision="ieee")
        else:
            acc += tl.dot(xv, tl.trans(wv))
    dtype = x_ptr.dtype.element_ty
    width = 2 * KERNEL_SIZE * groups
    tl.store(
        dyn_ptr + r_load[:, None] * width + w_row[None, :],
        acc.to(dtype),
        mask=r_ok[:, None] & j_ok[None, :],
    )
    tl.debug_barrier()  # the stores above are the loads below (same program)
    # The opening convolution of these groups' channels, from the rounded projection.
    c = first_group * GROUP_SIZE + tl.arange(0, BLOCK_C)
    c_ok = (tl.arange(0, BLOCK_C) < GROUPS_PER_PROGRAM * GROUP_SIZE) & (c < hidden)
    ok = r_ok[:, None] & c_ok[None, :]
    t = r % block_len
    out = tl.zeros((BLOCK_M, BLOCK_C), dtype=tl.float32)
    for o in tl.static_range(KERNEL_SIZE):
        seen = ok & (t >= o)[:, None]
        xv = tl.load(x_ptr + (r_load - o)[:, None] * stride_x + c[None, :], mask=seen, other=0.0)
        bv = tl.load(base_ptr + o * hidden + c, mask=c_ok, other=0.0).to(tl.float32)
        dyn = dyn_ptr + r_load[:, None] * width + o * groups + (c // GROUP_SIZE)[None, :]
        dv = tl.load(dyn, mask=ok, other=0.0).to(tl.float32)
        out += (bv[None, :] + dv) * xv.to(tl.float32)
    tl.store(out_ptr + r_load[:, None] * hidden + c[None, :], out.to(dtype), mask=ok)


def triton_conv_prepare(
    x: torch.Tensor,  # [num_blocks * block_len, hidden]
    weight: torch.Tensor,  # [2 * kernel_size * groups, hidden] the kernel projection
    base: torch.Tensor,  # [kernel_size, hidden] the first half's static kernel
    block_len: int,
    groups_per_program: int | None = None,  # None: the fewest that fill a 16-wide mma
    block_k: int = 256,
    num_warps: int = 4,
    num_stages: int = 3,
) -> tuple[torch.Tensor, torch.Tensor]:  # x convolved [rows, hidden], second half [rows, k, g]
    """`dynamic_conv.conv_prepare_torch` in one launch (the launch parameters: benchmarks)."""
    rows, hidden = x.shape
    kernel_size = base.shape[0]
    groups = weight.shape[0] // (2 * kernel_size)
    if rows % block_len or hidden % groups or weight.shape != (2 * kernel_size * groups, hidden):
        raise ValueError(
            f"{rows} rows are not whole blocks of {block_len}, or the projection "
            f"{tuple(weight.shape)} is not [2 * {kernel_size} * groups, {hidden}] with groups "
            f"dividing {hidden}"
        )
    if x.stride(1) != 1:
        x = x.contiguous()
    dyn = torch.empty(rows, 2 * kernel_size * groups, dtype=x.dtype, device=x.device)
    out = torch.empty(rows, hidden, dtype=x.dtype, device=x.device)
    second = dyn.view(rows, 2, kernel_size, groups)[:, 1]
    if rows == 0:
        return out, second
    group_size = hidden // groups
    # At least 16 projection outputs a program (the mma's least width).
    per_program = groups_per_program or max(1, triton.cdiv(8, kernel_size))
    block_m = 16 if rows <= 16 else 32
    _conv_prepare_kernel[(triton.cdiv(rows, block_m), triton.cdiv(groups, per_program))](
        x,
        weight.contiguous(),
        base.contiguous(),
        dyn,
        out,
        rows,
        x.stride(0),
        hidden,
        groups,
        block_len,
        GROUP_SIZE=group_size,
        KERNEL_SIZE=kernel_size,
        GROUPS_PER_PROGRAM=per_program,
        BLOCK_J=max(16, triton.next_power_of_2(2 * kernel_size * per_program)),
        BLOCK_C=triton.next_power_of_2(per_program * group_size),
        BLOCK_M=block_m,
        BLOCK_K=min(block_k, max(16, triton.next_power_of_2(hidden))),
        IEEE=x.dtype == torch.float32,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out, second


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
