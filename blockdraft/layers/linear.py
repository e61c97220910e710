"""Linear projections with the kernel choice behind them: a few rows on the GPU run the Triton
skinny GEMM (which only streams the weight, and may form its input in its loads: a residual add
+ RMSNorm or the MLP's SiLU·mul prologue), everything else `F.linear`. Projections that read one
input are fused into one matrix (`fuse_linears`) so each forward reads the weight once."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from blockdraft.kernels.select import get_linear_backend, needs_autograd
from blockdraft.layers.norm import RMSNorm

# At most this many rows (decode: the batch; verify: batch * (1 + N)), a linear on the GPU runs
# the skinny GEMM, which only streams the weight; more rows are cuBLAS's. On the H200 it is faster
# than cuBLAS at 1-2 rows on every Qwen3-8B projection, not reliably at 4-16 alone, but whole
# steps are as fast or faster at 16 rows (gpu_bench --ablate: AR batch 8 5.76 -> 5.45 ms, DFlash
# verify 16 rows 6.26 -> 6.15).
SKINNY_MAX_ROWS = 16
# Compiled Triton only: in the interpreter the kernel would crawl through every projection.
SKINNY_DEVICE_TYPE = "cuda"
# Where a layer's fused q/k/v and gate/up projections run the skinny GEMM, form the residual
# add + RMSNorm before each in the GEMM's loads (two norm kernels' launches less per layer).
FUSE_NORM_INTO_SKINNY = True
# The norm prologue runs for at most this many rows even where SKINNY_MAX_ROWS is larger: at 16
# rows (a batch-1 verify) the two prologues together double the H200's step (gpu_bench --ablate).
PROLOGUE_MAX_ROWS = 2


def skinny(
    x: torch.Tensor,  # [num_tokens, in_features]
    *params: torch.Tensor | None,
) -> bool:
    """Whether a linear of x runs the skinny GEMM: few rows, on the GPU, outside autograd."""
    return (
        x.device.type == SKINNY_DEVICE_TYPE
        and x.shape[:-1].numel() <= SKINNY_MAX_ROWS
        and not needs_autograd(x, *params)
    )


def prologue_fits(
    x: torch.Tensor,  # [num_tokens, in_features]
    *params: torch.Tensor | None,
    max_rows: int | None = None,  # None: PROLOGUE_MAX_ROWS
) -> bool:
    """Whether the skinny GEMM of x may also form its input in its loads (a prologue)."""
    limit = PROLOGUE_MAX_ROWS if max_rows is None else max_rows
    return x.shape[:-1].numel() <= limit and skinny(x, *params)


def linear(
    x: torch.Tensor,  # [num_tokens, in_features]
    weight: torch.Tensor,  # [out_features, in_features]
    bias: torch.Tensor | None = None,  # [out_features]
) -> torch.Tensor:  # [num_tokens, out_features]
    """`F.linear`, through `get_linear_backend` (the Triton skinny GEMM) for a few rows on the
    GPU outside autograd; CPU and training run F.linear itself."""
    if skinny(x, weight, bias):
        return get_linear_backend(x.device)(x, weight, bias)
    return F.linear(x, weight, bias)


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
    """Whether norms can go into the skinny GEMMs after them (FUSE_NORM_INTO_SKINNY): few
    enough rows, and one dtype for the activations, the residual and the norm weights."""
    if not FUSE_NORM_INTO_SKINNY:
        return False
    dtypes = {x.dtype, *(w.dtype for w in norm_weights)}
    if residual is not None:
        dtypes.add(residual.dtype)
    return len(dtypes) == 1 and prologue_fits(x, residual, *params, *norm_weights)


def norm_linear(
    norm: RMSNorm,
    x: torch.Tensor,  # [num_tokens, hidden]
    residual: torch.Tensor | None,  # [num_tokens, hidden]; None: x is the stream
    weight: torch.Tensor,  # [out_features, hidden]
    bias: torch.Tensor | None,  # [out_features]
) -> tuple[torch.Tensor, torch.Tensor]:  # (linear(norm(x + residual)), x + residual)
    """`norm` (with its residual add) and the skinny GEMM after it, in one kernel."""
    if residual is None:
        return skinny_linear(x, weight, bias, rms_norm=(norm.weight, norm.eps)), x
    stream = torch.empty_like(x, memory_format=torch.contiguous_format)
    out = skinny_linear(
        x, weight, bias, rms_norm=(norm.weight, norm.eps), residual=residual, residual_out=stream
    )
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
