"""Linear projections with the kernel choice behind them: a few rows on the GPU run the Triton
skinny GEMM (which only streams the weight, and may form its input in its loads: a residual add
+ RMSNorm or the MLP's SiLU·mul prologue), everything else `F.linear`. Projections that read one
input are fused into one matrix (`fuse_linears`) so each forward reads the weight once."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from blockdraft.distributed.tensor_parallel import TensorParallel
from blockdraft.kernels.forward_context import current_kernel_policy
from blockdraft.kernels.policy import CPU_WEIGHT_LEFT_ROWS, cpu_row_count
from blockdraft.kernels.select import get_linear_backend, needs_autograd
from blockdraft.layers.norm import OffsetRMSNorm, RMSNorm


def skinny(
    x: torch.Tensor,  # [num_tokens, in_features]
    *params: torch.Tensor | None,
) -> bool:
    """Whether a linear of x runs the skinny GEMM: few rows, on the GPU, outside autograd
    (`KernelPolicy.skinny_max_rows`, `skinny_device_type`)."""
    policy = current_kernel_policy()
    return (
        x.device.type == policy.skinny_device_type
        and x.shape[:-1].numel() <= policy.skinny_max_rows
        and not needs_autograd(x, *params)
    )


def prologue_fits(
    x: torch.Tensor,  # [num_tokens, in_features]
    *params: torch.Tensor | None,
    max_rows: int | None = None,  # None: KernelPolicy.norm_prologue_max_rows
) -> bool:
    """Whether the skinny GEMM of x may also form its input in its loads (a prologue)."""
    limit = current_kernel_policy().norm_prologue_max_rows if max_rows is None else max_rows
    return x.shape[:-1].numel() <= limit and skinny(x, *params)


def _cpu_weight_left(x: torch.Tensor, *params: torch.Tensor | None) -> bool:
    """Whether a CPU linear of x runs as `weight @ x.T` (`KernelPolicy.cpu_weight_left_rows`;
    with torch 2.13's CPU wheel, one thread, SmolLM2-135M's shapes, on one host 16 rows of the
    MLP's gate_up took 942 us through F.linear and 688 this way)."""
    if x.device.type != "cpu" or x.dim() != 2 or x.shape[0] < 1 or needs_autograd(x, *params):
        return False
    counts = current_kernel_policy().cpu_weight_left_rows
    return cpu_row_count(x.shape[0]) in (CPU_WEIGHT_LEFT_ROWS if counts is None else counts)


def weight_left_linear(
    x: torch.Tensor,  # [rows, in_features]
    weight: torch.Tensor,  # [out_features, in_features]
    bias: torch.Tensor | None = None,  # [out_features]
) -> torch.Tensor:  # [rows, out_features]
    """F.linear's product as `weight @ x.T`; one row runs as two (the BLAS's GEMM, not its
    GEMV), the second dropped."""
    rows = x.shape[0]
    if rows == 1:
        x = torch.cat([x, x])
    if bias is None:
        out = torch.mm(weight, x.t())
    else:
        out = torch.addmm(bias[:, None], weight, x.t())
    return out[:, :rows].t().contiguous()


def linear(
    x: torch.Tensor,  # [num_tokens, in_features]
    weight: torch.Tensor,  # [out_features, in_features]
    bias: torch.Tensor | None = None,  # [out_features]
) -> torch.Tensor:  # [num_tokens, out_features]
    """`F.linear`, through `get_linear_backend` (the Triton skinny GEMM) for a few rows on the
    GPU outside autograd; on the CPU, the row counts `KernelPolicy.cpu_weight_left_rows` names
    as `weight @ x.T` (`weight_left_linear`); training runs F.linear itself."""
    if skinny(x, weight, bias):
        return get_linear_backend(x.device)(x, weight, bias)
    if _cpu_weight_left(x, weight, bias):
        return weight_left_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def row_parallel_linear(
    tp: TensorParallel,
    x: torch.Tensor,  # [num_tokens, in_features / tp.size] this rank's slice of the features
    weight: torch.Tensor,  # [out_features, in_features / tp.size]
    bias: torch.Tensor | None,  # [out_features], held whole by every rank
) -> torch.Tensor:  # [num_tokens, out_features], the same on every rank
    """A linear whose input features are split over the ranks: each rank's partial product,
    summed over the ranks (one all-reduce), then the bias once."""
    out = tp.all_reduce(linear(x, weight))
    return out if bias is None else out + bias


def skinny_linear(
    x: torch.Tensor,  # [num_tokens, in_features] (the prologue's input: see get_linear_backend)
    weight: torch.Tensor,  # [out_features, in_features]
    bias: torch.Tensor | None,  # [out_features]
    **prologue: object,
) -> torch.Tensor:  # [num_tokens, out_features]
    """The skinny GEMM with a prologue, for callers that checked `prologue_fits`."""
    return get_linear_backend(x.device)(x, weight, bias, **prologue)


def norm_prologue_fits(
    x: torch.Tensor,  # [num_tokens, hidden]
    residual: torch.Tensor | None,  # [num_tokens, hidden]
    norm_weights: tuple[torch.Tensor, ...],  # the norms formed in the GEMMs' loads
    *params: torch.Tensor | None,  # the GEMMs' weights and biases
) -> bool:
    """Whether norms can go into the skinny GEMMs after them (`fuse_norm_into_skinny` of the
    kernel policy): few enough rows, and one dtype for the activations, the residual and the
    norm weights."""
    if not current_kernel_policy().fuse_norm_into_skinny:
        return False
    dtypes = {x.dtype, *(w.dtype for w in norm_weights)}
    if residual is not None:
        dtypes.add(residual.dtype)
    return len(dtypes) == 1 and prologue_fits(x, residual, *params, *norm_weights)


def norm_linear(
    norm: RMSNorm | OffsetRMSNorm,
    x: torch.Tensor,  # [num_tokens, hidden]
    residual: torch.Tensor | None,  # [num_tokens, hidden]; None: x is the stream
    weight: torch.Tensor,  # [out_features, hidden]
    bias: torch.Tensor | None,  # [out_features]
    stream_out: torch.Tensor | None = None,  # [num_tokens, hidden] view, unit column stride
) -> tuple[torch.Tensor, torch.Tensor]:  # (linear(norm(x + residual)), x + residual)
    """`norm` (with its residual add) and the skinny GEMM after it, in one kernel; the stream
    x + residual is written to `stream_out` when given (`norm.input_norm`)."""
    prologue = {"rms_norm": (norm.weight, norm.eps), "norm_offset": norm.offset}
    if residual is None:
        if stream_out is not None:
            stream_out.copy_(x)
        return skinny_linear(x, weight, bias, **prologue), x
    stream = stream_out
    if stream is None:
        stream = torch.empty_like(x, memory_format=torch.contiguous_format)
    out = skinny_linear(x, weight, bias, residual=residual, residual_out=stream, **prologue)
    return out, stream


def fuse_linears(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Stacks the weights (and biases) of linears that read the same input into one matrix and
    makes each linear's parameters row views of it: one weight read and one launch per forward
    instead of one per linear, with parameter names, state dicts and memory as before. For
    inference only (the views do not train)."""
    weight = torch.cat([lin.weight.detach() for lin in linears])
    has_bias = linears[0].bias is not None
    bias = torch.cat([lin.bias.detach() for lin in linears]) if has_bias else None
    start = 0
    for lin in linears:
        rows = slice(start, start + lin.out_features)
        lin.weight = nn.Parameter(weight[rows], requires_grad=False)
        if bias is not None:
            lin.bias = nn.Parameter(bias[rows], requires_grad=False)
        start += lin.out_features
    return weight, bias


def fuse_projections(model: nn.Module) -> None:
    """Fuses the projections that read one input (attention q/k/v, MLP gate/up; see
    `fuse_linears`) in every module of `model` that has them: those with a `fuse_projections`
    method."""
    for module in model.modules():
        fuse = getattr(module, "fuse_projections", None)
        if callable(fuse):
            fuse()
