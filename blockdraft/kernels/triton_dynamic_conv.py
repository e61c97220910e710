"""`dynamic_conv.grouped_dynamic_causal_conv_torch` in one launch: each program convolves a
slice of one row's channels (float32 accumulation), reading the previous rows of its own block
only. The torch twin is about eight launches per call, four calls per DFlash2 drafter layer.

`triton_conv_rms_norm` is `dynamic_conv.conv_rms_norm_torch`: a sub-block's closing convolution
and the residual add + RMSNorm after it, one program per row, rounded as the two kernels
(this one and `triton_rmsnorm`) round, so the result is theirs bit for bit in one launch.

`triton_projected_dynamic_conv` is `dynamic_conv.projected_dynamic_conv_torch`: a sub-block's
opening, the kernel projection and the convolution with its first kernel, in one launch instead
of a GEMM (two with split-K) and a convolution. A channel's convolution needs only its own
group's dynamic values, so each program projects a few groups' rows of the weight (both
kernels) and convolves those groups' channels: no program waits on another.
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


# The projection only streams its weight: its groups are spread over about this many programs
# (~ one per SM of an H100 / H200; a program takes at most the 16 projection columns of one
# tensor-core tile). Not yet tuned on a GPU.
FILL_PROGRAMS = 128


@triton.jit
def _projected_conv_kernel(
    x_ptr,  # [rows, hidden], unit column stride
    w_ptr,  # [2 * KERNEL_SIZE * groups, hidden], unit column stride
    base_ptr,  # [KERNEL_SIZE, hidden], contiguous: the opening convolution's static kernel
    out_ptr,  # [rows, hidden], contiguous
    dyn_ptr,  # [rows, 2 * KERNEL_SIZE * groups], contiguous: both dynamic kernels
    rows,
    hidden,
    groups,
    block_len,
    stride_x,
    stride_w,
    GROUP_SIZE: tl.constexpr,
    KERNEL_SIZE: tl.constexpr,
    GROUPS_PER_PROGRAM: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows a program takes, >= 16 (tensor-core tiles)
    BLOCK_N: tl.constexpr,  # power of two >= 2 * KERNEL_SIZE * GROUPS_PER_PROGRAM, >= 16
    BLOCK_K: tl.constexpr,
    BLOCK_C: tl.constexpr,  # power of two >= GROUPS_PER_PROGRAM * GROUP_SIZE, >= 16
):
    g0 = tl.program_id(0) * GROUPS_PER_PROGRAM
    ms = tl.program_id(1).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = ms < rows
    # Projection column n is (half, offset, group g0 + j) of this program's groups: its weight
    # row is that of `dynamic[:, half, offset, g]` in the [rows, 2, KERNEL_SIZE, groups] output.
    ns = tl.arange(0, BLOCK_N)
    half = ns // (KERNEL_SIZE * GROUPS_PER_PROGRAM)
    offset = (ns // GROUPS_PER_PROGRAM) % KERNEL_SIZE
    j = ns % GROUPS_PER_PROGRAM
    n_ok = (ns < 2 * KERNEL_SIZE * GROUPS_PER_PROGRAM) & (g0 + j < groups)
    w_row = (half * KERNEL_SIZE + offset) * groups + g0 + j
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        xt = tl.load(
            x_ptr + ms[:, None] * stride_x + ks[None, :], mask=m_ok[:, None] & k_ok[None, :],
            other=0.0,
        )  # fmt: skip
        wt = tl.load(
            w_ptr + w_row[None, :].to(tl.int64) * stride_w + ks[:, None],
            mask=n_ok[None, :] & k_ok[:, None], other=0.0,
        )  # fmt: skip
        # fp32 stays fp32 ("ieee"), as F.linear without TF32; ignored for 16-bit inputs.
        acc = tl.dot(xt, wt, acc, input_precision="ieee")
    dyn = acc.to(dyn_ptr.dtype.element_ty)  # rounded as the GEMM's output would be
    dyn_stride = 2 * KERNEL_SIZE * groups
    tl.store(
        dyn_ptr + ms[:, None] * dyn_stride + w_row[None, :], dyn,
        mask=m_ok[:, None] & n_ok[None, :],
    )  # fmt: skip
    # The convolution of this program's channels. Each offset's dynamic values, one a group,
    # are spread over the group's channels by a product with a 0/1 matrix (exact: one term).
    cl = tl.arange(0, BLOCK_C)
    cs = g0 * GROUP_SIZE + cl
    c_ok = (cl < GROUPS_PER_PROGRAM * GROUP_SIZE) & (cs < hidden)
    t = ms % block_len  # the row's offset in its block: earlier offsets see zeros
    out = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
    for o in tl.static_range(KERNEL_SIZE):
        spread = (half == 0) & (offset == o) & n_ok
        spread = spread[:, None] & (j[:, None] == cl[None, :] // GROUP_SIZE)
        spread = spread.to(dyn_ptr.dtype.element_ty)
        dv = tl.dot(dyn, spread, input_precision="ieee")
        seen = m_ok & (t >= o)
        xv = tl.load(
            x_ptr + (ms - o)[:, None] * stride_x + cs[None, :],
            mask=seen[:, None] & c_ok[None, :], other=0.0,
        ).to(tl.float32)  # fmt: skip
        bv = tl.load(base_ptr + o * hidden + cs, mask=c_ok, other=0.0).to(tl.float32)
        out += (bv[None, :] + dv) * xv
    tl.store(
        out_ptr + ms[:, None] * hidden + cs[None, :], out.to(out_ptr.dtype.element_ty),
        mask=m_ok[:, None] & c_ok[None, :],
    )  # fmt: skip


def _check_blocks(rows: int, block_len: int, hidden: int, groups: int) -> None:
    if rows % block_len or hidden % groups:
        raise ValueError(
            f"{rows} rows are not whole blocks of {block_len}, or {groups} groups do not "
            f"divide hidden {hidden}"
        )


def triton_grouped_dynamic_causal_conv(
    x: torch.Tensor,  # [num_blocks * block_len, hidden]
    dynamic: torch.Tensor,  # [num_blocks * block_len, kernel_size, groups]
    base: torch.Tensor,  # [kernel_size, hidden]
    block_len: int,
) -> torch.Tensor:  # [num_blocks * block_len, hidden]
    rows, hidden = x.shape
    kernel_size, groups = dynamic.shape[1:]
    _check_blocks(rows, block_len, hidden, groups)
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


def triton_projected_dynamic_conv(
    x: torch.Tensor,  # [num_blocks * block_len, hidden]
    weight: torch.Tensor,  # [2 * kernel_size * groups, hidden], the kernel projection
    base: torch.Tensor,  # [kernel_size, hidden], the opening convolution's static kernel
    block_len: int,
    groups_per_program: int | None = None,  # None: see FILL_PROGRAMS
    block_m: int = 16,
    block_k: int = 128,
    num_warps: int = 4,
    num_stages: int = 3,
) -> tuple[torch.Tensor, torch.Tensor]:  # out [rows, hidden], dynamic [rows, 2, kernel_size, G]
    """`dynamic_conv.projected_dynamic_conv_torch` in one launch."""
    rows, hidden = x.shape
    kernel_size = base.shape[0]
    if weight.shape[1] != hidden or weight.shape[0] % (2 * kernel_size):
        raise ValueError(
            f"kernel projection {tuple(weight.shape)} does not map hidden {hidden} to 2 x "
            f"{kernel_size} dynamic kernels"
        )
    groups = weight.shape[0] // (2 * kernel_size)
    _check_blocks(rows, block_len, hidden, groups)
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    out = torch.empty(rows, hidden, dtype=x.dtype, device=x.device)
    dynamic = torch.empty(rows, 2, kernel_size, groups, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out, dynamic
    gpp = groups_per_program or max(1, min(8 // kernel_size, groups // FILL_PROGRAMS))
    gpp = min(gpp, groups)
    group_size = hidden // groups
    _projected_conv_kernel[(triton.cdiv(groups, gpp), triton.cdiv(rows, block_m))](
        x, weight, base.contiguous(), out, dynamic, rows, hidden, groups, block_len,
        x.stride(0), weight.stride(0),
        GROUP_SIZE=group_size, KERNEL_SIZE=kernel_size, GROUPS_PER_PROGRAM=gpp,
        BLOCK_M=max(16, block_m), BLOCK_N=max(16, triton.next_power_of_2(2 * kernel_size * gpp)),
        BLOCK_K=max(16, min(block_k, triton.next_power_of_2(hidden))),
        BLOCK_C=max(16, triton.next_power_of_2(gpp * group_size)),
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out, dynamic
