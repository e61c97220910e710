"""Fused chunked linear + weighted cross-entropy for drafter training (a frozen LM head).

`linear_cross_entropy_torch` (in `blockdraft.kernels.cross_entropy`) is the specification:
logits = hidden @ weight.T in the compute dtype (bf16 under autocast), copied to float32, then
`sum(w * CE(logits, labels))` and `argmax(logits) == labels`, chunked with the logits recomputed
in backward. That path makes some 18 passes over [rows, V] tensors per chunk, most of them
float32 (the copy, log_softmax and its backward, argmax, the recompute, the cast back).

Here, per chunk of rows: one cuBLAS matmul writes the logits in the compute dtype into a
reused [chunk, V] buffer; one Triton program per row reads its logits twice: first an online
log-sum-exp, the argmax and the label's logit (all in float32), giving the loss
`w * (lse - logit[label])`; then it overwrites the logits in place with the gradient of that
loss, `w * (softmax - onehot)`. A second matmul turns it into the chunk's grad_hidden
(`grad_logits @ weight`), kept for backward. The loss is linear in the call's output, so
backward is only `grad_hidden * grad_loss`. Five passes over the logits in the compute dtype
(matmul write, two kernel reads, kernel write, matmul read) and two matmuls instead of three
(no recompute). Memory: one [chunk, V] buffer and [rows, H] for grad_hidden.

The LM head must be frozen (the target's): no gradient is computed for it. Rows whose label is
outside [0, V) (e.g. -100) count as ignored: no loss, no gradient, never correct.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from blockdraft.kernels.cross_entropy import linear_cross_entropy_torch

__all__ = ["linear_cross_entropy_torch", "triton_linear_cross_entropy"]

MAX_BLOCK_V = 8192  # vocabulary tile per loop iteration (a guess: to be tuned on the GPU)


@triton.jit
def _cross_entropy_fwd_bwd_kernel(
    logits_ptr,  # [R, V] logits in; w * (softmax - onehot) out, in place, when COMPUTE_GRAD
    labels_ptr,  # [R] int64; outside [0, V): row ignored
    weights_ptr,  # [R] fp32
    loss_ptr,  # [R] fp32 out: w * (lse - logit[label])
    correct_ptr,  # [R] int8 out: argmax == label
    stride_row,
    vocab,
    BLOCK_V: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    label = tl.load(labels_ptr + row)
    w = tl.load(weights_ptr + row).to(tl.float32)
    valid = (label >= 0) & (label < vocab)
    offs = tl.arange(0, BLOCK_V)

    # Pass 1: online log-sum-exp and the argmax (first index of the maximum, like torch).
    run_max = tl.full((), float("-inf"), tl.float32)
    run_sum = tl.full((), 0.0, tl.float32)
    best = tl.full((), 0, tl.int32)
    for start in range(0, vocab, BLOCK_V):
        cols = start + offs
        x = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        tile_max = tl.max(x, axis=0)
        tile_arg = tl.argmax(x, axis=0).to(tl.int32)
        best = tl.where(tile_max > run_max, start + tile_arg, best)
        new_max = tl.maximum(run_max, tile_max)
        run_sum = run_sum * tl.exp(run_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
        run_max = new_max
    lse = run_max + tl.log(run_sum)
    safe_label = tl.where(valid, label, 0)
    x_label = tl.load(base + safe_label).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(valid, w * (lse - x_label), 0.0))
    tl.store(correct_ptr + row, (valid & (best == safe_label)).to(tl.int8))

    # Pass 2: the gradient of this row's loss, over the logits it was computed from.
    if COMPUTE_GRAD:
        scale = tl.where(valid, w, 0.0)
        for start in range(0, vocab, BLOCK_V):
            cols = start + offs
            ok = cols < vocab
            x = tl.load(base + cols, mask=ok, other=0.0).to(tl.float32)
            g = tl.exp(x - lse) - tl.where(cols == label, 1.0, 0.0)
            tl.store(base + cols, (g * scale).to(logits_ptr.dtype.element_ty), mask=ok)


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every output and work buffer comes from here (tests poison them)."""
    return torch.empty(shape, dtype=dtype, device=device)


def cross_entropy_fwd_bwd(
    logits: torch.Tensor,  # [r, V], row-contiguous; overwritten by the gradient if compute_grad
    labels: torch.Tensor,  # [r] int64
    weights: torch.Tensor,  # [r] fp32
    compute_grad: bool,
    block_v: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # loss per row [r] fp32, correct [r] bool
    rows, vocab = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("logits rows must be contiguous")
    loss = _empty((rows,), torch.float32, logits.device)
    correct = _empty((rows,), torch.int8, logits.device)
    if rows:
        block = block_v or min(MAX_BLOCK_V, triton.next_power_of_2(vocab))
        _cross_entropy_fwd_bwd_kernel[(rows,)](
            logits,
            labels,
            weights,
            loss,
            correct,
            logits.stride(0),
            vocab,
            BLOCK_V=block,
            COMPUTE_GRAD=compute_grad,
            num_warps=min(16, max(4, block // 512)),
        )
    return loss, correct.view(torch.bool)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,  # [R, H]
        weight: torch.Tensor,  # [V, H], frozen
        labels: torch.Tensor,  # [R] int64
        weights: torch.Tensor,  # [R] fp32
        chunk_rows: int,
        compute_dtype: torch.dtype,
        block_v: int | None,
        compute_grad: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # loss sum fp32 scalar, correct [R] bool
        rows, vocab = hidden.shape[0], weight.shape[0]
        device = hidden.device
        w_c = weight.to(compute_dtype)  # no copy for the target's own bf16 head
        labels = labels.to(device=device, dtype=torch.int64).contiguous()
        weights = weights.to(device=device, dtype=torch.float32).contiguous()
        losses = _empty((rows,), torch.float32, device)
        correct = _empty((rows,), torch.bool, device)
        grad_hidden = _empty(hidden.shape, hidden.dtype, device) if compute_grad else None
        chunk = max(1, min(rows, chunk_rows))
        buf = _empty((chunk, vocab), compute_dtype, device)  # [chunk, V] logits, then grads
        with torch.autocast(device.type, enabled=False):
            for s in range(0, rows, chunk):
                e = min(rows, s + chunk)
                logits = buf[: e - s]
                torch.mm(hidden[s:e].to(compute_dtype), w_c.t(), out=logits)
                loss_c, ok_c = cross_entropy_fwd_bwd(
                    logits, labels[s:e], weights[s:e], compute_grad, block_v
                )
                losses[s:e] = loss_c
                correct[s:e] = ok_c
                if grad_hidden is not None:
                    if grad_hidden.dtype == compute_dtype:
                        torch.mm(logits, w_c, out=grad_hidden[s:e])
                    else:
                        grad_hidden[s:e] = torch.mm(logits, w_c)
        ctx.mark_non_differentiable(correct)
        if grad_hidden is not None:
            ctx.save_for_backward(grad_hidden)
        return losses.sum(), correct

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        grad_loss: torch.Tensor,  # [] fp32
        grad_correct: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, ...]:
        grad_hidden = None
        if ctx.needs_input_grad[0]:
            (stored,) = ctx.saved_tensors
            grad_hidden = stored * grad_loss.to(stored.dtype)
        return grad_hidden, None, None, None, None, None, None, None


def triton_linear_cross_entropy(
    hidden: torch.Tensor,  # [R, H]
    weight: torch.Tensor,  # [V, H] the LM head (no bias), frozen
    labels: torch.Tensor,  # [R] int64
    weights: torch.Tensor,  # [R] float32
    chunk_rows: int = 8192,
    *,
    block_v: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # (sum of weighted CE fp32, [R] bool correct)
    """`linear_cross_entropy_torch` without float32 logits; differentiable in `hidden` only.
    The logits are in the autocast dtype when autocast is on for the device, else in hidden's."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        shapes = f"hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}"
        raise ValueError(f"the LM head does not fit the hidden rows: {shapes}")
    if weight.requires_grad and torch.is_grad_enabled():
        raise ValueError("the fused cross-entropy computes no LM head gradient: freeze the head")
    if chunk_rows < 1:
        raise ValueError("chunk_rows must be positive")
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        compute_dtype = torch.get_autocast_dtype(device_type)
    else:
        compute_dtype = hidden.dtype
    compute_grad = torch.is_grad_enabled() and hidden.requires_grad
    return _LinearCrossEntropy.apply(
        hidden, weight, labels, weights, chunk_rows, compute_dtype, block_v, compute_grad
    )
