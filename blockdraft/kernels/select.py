"""Chooses between the pure-torch kernels and their Triton twins.

The active `KernelPolicy`'s backend (`blockdraft.kernels.forward_context.current_kernel_policy`)
decides for attention, the KV store, RMSNorm, the q/k norm + rotary embedding (also with the KV
store fused in), the MLP's SiLU-and-multiply, the few-row linears, the DFlash drafter's input
preparation, its training loss (LM head + cross-entropy), DFlash2's dynamic convolution, top-K
and candidate walk, the gated delta rule's recurrence and its chunked form over packed
sequences (hybrid models' linear attention: decode and verify, prefill), and the sampler's
hashed uniforms and exponential race: "auto" is Triton on CUDA when it imports, torch otherwise;
"torch" / "triton" force one. Triton on a CPU tensor only runs under its interpreter, which
reads TRITON_INTERPRET=1 when triton is first imported: so this module imports the Triton
kernels lazily, on the first call that wants them.

Not provided: a Triton rejection sampler. `blockdraft.spec_decode.rejection_sampler` already
runs without a host sync; what a kernel could fuse is the accept/assemble tail over [R, N+1]
tensors (a handful of tiny launches, free under CUDA graphs), while the vocabulary-wide work
(filtering, residual) stays in the sampler's torch code; only its random numbers and the
exponential race have kernels (get_hashed_uniform_backend, get_exponential_race_backend). A
kernel taking a "pre-sampled recovered token per row" would even cost more: it needs the
residual sampled at all N+1 rows instead of only at the first rejection.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

import torch

from blockdraft.kernels.candidate_walk import candidate_walk_torch
from blockdraft.kernels.dflash_inputs import prepare_dflash_inputs_torch
from blockdraft.kernels.dynamic_conv import (
    conv_rms_norm_torch,
    grouped_dynamic_causal_conv_torch,
    projected_dynamic_conv_torch,
)
from blockdraft.kernels.forward_context import current_kernel_policy
from blockdraft.kernels.gated_delta_rule import (
    chunk_gated_delta_rule_varlen_torch,
    recurrent_gated_delta_rule_pool_torch,
)
from blockdraft.kernels.linear import skinny_linear_torch
from blockdraft.kernels.paged_attention import paged_attention, store_kv
from blockdraft.kernels.rmsnorm import rms_norm_torch
from blockdraft.kernels.rope import (
    qk_norm_rope_store_torch,
    qk_norm_rope_torch,
    rope_store_attention_torch,
    silu_mul_torch,
)
from blockdraft.kernels.sampling import exponential_race_torch, hashed_uniform
from blockdraft.kernels.top_k import top_k_torch
from blockdraft.kernels.triton_env import triton_available, triton_interpreting

AttentionFn = Callable[..., torch.Tensor]
StoreKVFn = Callable[..., None]
RMSNormFn = Callable[..., torch.Tensor | tuple[torch.Tensor, torch.Tensor]]
RopeFn = Callable[..., tuple[torch.Tensor | None, torch.Tensor]]
SiluMulFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
DFlashInputsFn = Callable[..., object]
LinearFn = Callable[..., torch.Tensor]
HashedUniformFn = Callable[..., torch.Tensor]
RaceFn = Callable[..., torch.Tensor]
DynamicConvFn = Callable[..., torch.Tensor]
GatedDeltaFn = Callable[..., torch.Tensor]
ChunkGatedDeltaFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
GatedDeltaNetDecodeFn = Callable[..., torch.Tensor]
GatedDeltaNetVerifyFn = Callable[..., torch.Tensor]
GatedDeltaNetCommitFn = Callable[..., None]
CandidateWalkFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
ConvNormFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
ProjectedConvFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
TopKFn = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]

Fn = TypeVar("Fn")


class PerDevice(Generic[Fn]):
    """A backend getter resolved once per (device, policy backend), for modules that need their
    kernel on every forward: the check is a comparison, the getter runs again only when the
    device or the active policy's backend changes."""

    def __init__(self, getter: Callable[[torch.device], Fn]) -> None:
        self.getter = getter
        self._resolved: tuple[torch.device, str, Fn] | None = None

    def __call__(self, device: torch.device) -> Fn:
        backend = current_kernel_policy().backend
        resolved = self._resolved
        if resolved is None or resolved[0] != device or resolved[1] != backend:
            resolved = self._resolved = (device, backend, self.getter(device))
        return resolved[2]


def needs_autograd(*tensors: torch.Tensor | None) -> bool:
    """Whether a call must stay on the torch twin because it is being differentiated (training):
    the Triton kernels have no backward (except the training loss's, made for it)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def use_triton(device: torch.device | str | None = None) -> bool:
    """Whether kernels for tensors on `device` should be the Triton ones, by the active
    policy's backend."""
    device = torch.device(device if device is not None else "cpu")
    backend = current_kernel_policy().backend
    if backend == "torch":
        return False
    if backend == "triton":
        if not triton_available():
            raise RuntimeError("kernel backend 'triton' but triton is not installed")
        if device.type != "cuda" and not triton_interpreting():
            raise RuntimeError(
                f"kernel backend 'triton' on {device.type} needs TRITON_INTERPRET=1 (set before "
                "triton is imported)"
            )
        return True
    return device.type == "cuda" and triton_available()


def get_attention_backend(device: torch.device | str | None = None) -> AttentionFn:
    """`fn(query, key_cache, value_cache, meta, scale, causal, window, *, split_counters)
    -> out`."""
    if use_triton(device):
        from blockdraft.kernels import triton_attention

        return triton_attention.triton_paged_attention
    return paged_attention


def get_store_kv_backend(device: torch.device | str | None = None) -> StoreKVFn:
    """`fn(key, value, key_cache, value_cache, slot_mapping)`, same switch as attention."""
    if use_triton(device):
        from blockdraft.kernels import triton_kv_store

        return triton_kv_store.triton_store_kv
    return store_kv


def get_gated_delta_rule_backend(device: torch.device | str | None = None) -> GatedDeltaFn:
    """`fn(query, key, value, g, beta, state_pool, slots, fresh, lengths, write) -> out`: the
    gated delta rule's recurrence over per-request state slots, same switch."""
    if use_triton(device):
        from blockdraft.kernels import triton_gated_delta_rule

        return triton_gated_delta_rule.triton_recurrent_gated_delta_rule
    return recurrent_gated_delta_rule_pool_torch


def get_chunk_gated_delta_rule_backend(
    device: torch.device | str | None = None,
) -> ChunkGatedDeltaFn:
    """`fn(query, key, value, g, beta, state, cu_seqlens, host_cu_seqlens=None) -> (out,
    final_states)`: the gated delta rule's chunked form over packed variable-length sequences
    (a prefill step's chunks), same switch."""
    if use_triton(device):
        from blockdraft.kernels import triton_chunk_gated_delta_rule

        return triton_chunk_gated_delta_rule.triton_chunk_gated_delta_rule
    return chunk_gated_delta_rule_varlen_torch


def get_gated_deltanet_decode_backend(
    device: torch.device | str | None = None,
) -> GatedDeltaNetDecodeFn | None:
    """`fn(qkv, b_a, z, conv_weight, a_log, dt_bias, norm_weight, norm_eps, num_k_heads,
    conv_pool, state_pool, slots, fresh, counters, *, fill_programs) -> out`: a Gated DeltaNet
    decode step's token mixer in one Triton launch; None off the Triton path, where the layer's
    own torch steps (`gated_deltanet_decode_torch` is what they compute) run."""
    if use_triton(device):
        from blockdraft.kernels import triton_gated_deltanet_step

        return triton_gated_deltanet_step.triton_gated_deltanet_decode
    return None


def get_gated_deltanet_verify_backend(
    device: torch.device | str | None = None, chunked: bool = False
) -> GatedDeltaNetVerifyFn | None:
    """`fn(qkv, b_a, z, conv_weight, a_log, dt_bias, norm_weight, norm_eps, num_k_heads,
    conv_pool, state_pool, stash_qkv, stash_mixed, stash_gb, slots, fresh, rows, lengths,
    counters) -> out`: a Gated DeltaNet verify forward's token mixer in one Triton launch (the
    row kernel, or with `chunked` the delta rule's chunked form); None off the Triton path,
    where the layer's own torch steps (`gated_deltanet_verify_torch` is what they compute) run."""
    if not use_triton(device):
        return None
    if chunked:
        from blockdraft.kernels import triton_gated_deltanet_verify_chunk

        return triton_gated_deltanet_verify_chunk.triton_gated_deltanet_verify_chunked
    from blockdraft.kernels import triton_gated_deltanet_verify

    return triton_gated_deltanet_verify.triton_gated_deltanet_verify


def get_gated_deltanet_commit_backend(
    device: torch.device | str | None = None,
) -> GatedDeltaNetCommitFn | None:
    """`fn(num_k_heads, conv_pool, state_pool, stash_qkv, stash_mixed, stash_gb, slots,
    lengths)`: a Gated DeltaNet layer's state commit after a verify in one Triton launch; None
    off the Triton path (`gated_deltanet_commit_torch` then runs)."""
    if use_triton(device):
        from blockdraft.kernels import triton_gated_deltanet_verify

        return triton_gated_deltanet_verify.triton_gated_deltanet_commit
    return None


def get_rms_norm_backend(device: torch.device | str | None = None) -> RMSNormFn:
    """`fn(x, weight, eps, residual=None) -> normed | (normed, x + residual)`, same switch."""
    if use_triton(device):
        from blockdraft.kernels import triton_rmsnorm

        return triton_rmsnorm.triton_rms_norm
    return rms_norm_torch


def get_rope_backend(device: torch.device | str | None = None) -> RopeFn:
    """`fn(query | None, key, positions, cos_cache, sin_cache, q_norm_weight, k_norm_weight,
    eps) -> (query, key)`: optional per-head RMSNorm then RoPE, same switch."""
    if use_triton(device):
        from blockdraft.kernels import triton_rope

        return triton_rope.triton_qk_norm_rope
    return qk_norm_rope_torch


def get_rope_store_attention_backend(device: torch.device | str | None = None) -> AttentionFn:
    """`fn(query, key, value, positions, cos_cache, sin_cache, q_norm_weight, k_norm_weight,
    eps, key_cache, value_cache, meta, scale, causal, window, *, split_counters) -> out`: the
    rope-store backend's work, then attention of the rotated queries; in one kernel for a
    decode forward on the Triton path; same switch."""
    if use_triton(device):
        from blockdraft.kernels import triton_attention

        return triton_attention.triton_rope_store_attention
    return rope_store_attention_torch


def get_rope_store_backend(device: torch.device | str | None = None) -> RopeFn:
    """`fn(query | None, key, value, positions, cos_cache, sin_cache, q_norm_weight,
    k_norm_weight, eps, key_cache, value_cache, slot_mapping) -> (query, key)`: the rope
    backend's work, then the rotated keys and the values stored at slot_mapping as by the store
    backend, in one kernel on the Triton path; same switch."""
    if use_triton(device):
        from blockdraft.kernels import triton_rope

        return triton_rope.triton_qk_norm_rope_store
    return qk_norm_rope_store_torch


def get_silu_mul_backend(device: torch.device | str | None = None) -> SiluMulFn:
    """`fn(gate, up) -> silu(gate) * up`, same switch."""
    if use_triton(device):
        from blockdraft.kernels import triton_activation

        return triton_activation.triton_silu_mul
    return silu_mul_torch


def get_dflash_inputs_backend(device: torch.device | str | None = None) -> DFlashInputsFn:
    """`fn(anchor_tokens, anchor_positions, ctx_row_start, num_ctx, proposers, block_tables,
    block_size, num_spec, mask_token_id, num_reqs_padded, num_ctx_rows) -> DFlashInputs`, same
    switch."""
    if use_triton(device):
        from blockdraft.kernels import triton_dflash_inputs

        return triton_dflash_inputs.prepare_dflash_inputs
    return prepare_dflash_inputs_torch


def get_linear_backend(device: torch.device | str | None = None) -> LinearFn:
    """`fn(x, weight, bias, *, silu_mul_input=False) -> x @ weight.T + bias`, the skinny GEMM
    for few rows, same switch (silu_mul_input: x is a fused gate_up output and the product is
    of `silu(gate) * up`). Callers keep it to the rows it is made for
    (`blockdraft.layers.linear.linear`)."""
    if use_triton(device):
        from blockdraft.kernels import triton_linear

        return triton_linear.skinny_linear
    return skinny_linear_torch


def get_hashed_uniform_backend(device: torch.device | str | None = None) -> HashedUniformFn:
    """`fn(seed, position, salt, width=None) -> [R] | [R, width] float32`, the counter-based
    uniforms of `blockdraft.kernels.sampling.hashed_uniform`, bit for bit; same switch."""
    if use_triton(device):
        from blockdraft.kernels import triton_sampling

        return triton_sampling.triton_hashed_uniform
    return hashed_uniform


def get_exponential_race_backend(device: torch.device | str | None = None) -> RaceFn:
    """`fn(probs, seed, position, salt) -> [R] int64`, `argmax(probs / -log(u))` with u the
    hashed uniforms of width V (lowest index on ties); same switch. The Triton kernel's log may
    differ from torch's by an ulp, so a near-exact tie between the top two scores can resolve
    the other way."""
    if use_triton(device):
        from blockdraft.kernels import triton_sampling

        return triton_sampling.triton_exponential_race
    return exponential_race_torch


def get_dynamic_conv_backend(device: torch.device | str | None = None) -> DynamicConvFn:
    """`fn(x, dynamic, base, block_len) -> out`, DFlash2's grouped dynamic causal convolution
    (`blockdraft.kernels.dynamic_conv`); same switch."""
    if use_triton(device):
        from blockdraft.kernels import triton_dynamic_conv

        return triton_dynamic_conv.triton_grouped_dynamic_causal_conv
    return grouped_dynamic_causal_conv_torch


def get_projected_conv_backend(device: torch.device | str | None = None) -> ProjectedConvFn:
    """`fn(x, weight, base, block_len) -> (out, dynamic)`, DFlash2's kernel projection and
    opening convolution (`blockdraft.kernels.dynamic_conv.projected_dynamic_conv_torch`); same
    switch."""
    if use_triton(device):
        from blockdraft.kernels import triton_dynamic_conv

        return triton_dynamic_conv.triton_projected_dynamic_conv
    return projected_dynamic_conv_torch


def get_candidate_walk_backend(device: torch.device | str | None = None) -> CandidateWalkFn:
    """`fn(projected, unary, candidates, anchors, predecessor_codebook, successor_codebook,
    temperature, seed, position, salt) -> (tokens, q)`, DFlash2's candidate scores and path
    walk (`blockdraft.kernels.candidate_walk`); same switch."""
    if use_triton(device):
        from blockdraft.kernels import triton_candidate_walk

        return triton_candidate_walk.triton_candidate_walk
    return candidate_walk_torch


def get_top_k_backend(device: torch.device | str | None = None) -> TopKFn:
    """`fn(x, k) -> (values, columns)`, each row's k largest, largest first
    (`blockdraft.kernels.top_k`; the kernel breaks ties by the lowest column); same switch."""
    if use_triton(device):
        from blockdraft.kernels import triton_top_k

        return triton_top_k.triton_top_k
    return top_k_torch


def get_conv_rms_norm_backend(device: torch.device | str | None = None) -> ConvNormFn:
    """`fn(x, dynamic, base, block_len, norm_weight, eps, residual) -> (normed, residual)`,
    DFlash2's closing convolution with the residual add + RMSNorm after it
    (`blockdraft.kernels.dynamic_conv.conv_rms_norm_torch`); same switch."""
    if use_triton(device):
        from blockdraft.kernels import triton_dynamic_conv

        return triton_dynamic_conv.triton_conv_rms_norm
    return conv_rms_norm_torch
