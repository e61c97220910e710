"""Gated DeltaNet, the `linear_attention` token mixer of Qwen3.5 (transformers'
`Qwen3_5GatedDeltaNet`): projections to q/k/v (`in_proj_qkv`), the output gate z (`in_proj_z`),
beta (`in_proj_b`) and the decay input a (`in_proj_a`); a causal depthwise conv (SiLU) over
q/k/v; the gated delta rule with `beta = sigmoid(b)` and `g = -exp(A_log) softplus(a + dt_bias)`;
a per-head RMSNorm gated by silu(z); `out_proj`. Parameter names are the checkpoint's.

Each request's conv state (its last K - 1 conv inputs) and float32 recurrent state live in a
slot of per-layer pools that the engine allocates beside the paged KV cache
(`allocate_states`); the forward context says which slot each sequence uses
(`LinearStateMetadata`). A forward's prefill chunks run the conv and the chunked rule in one
call each, packed end to end, and write their slots; decode rows and verify blocks run the
recurrence as one padded batch. A verify block only reads its slot and keeps its conv inputs
and outputs, g and beta (`stash_*`): `commit_verified` then advances the slot over the
accepted rows with the recurrence alone, so rejected rows leave no trace and the target never
runs twice. On the Triton path a forward of decode rows only, and one of
verify blocks only (with `fuse_gated_deltanet_verify`, which also fuses the commit), runs the
token mixer in one kernel launch.

Under tensor parallelism each rank holds its share of the key heads and of the value heads
(their grouping kept: value head j reads key head j // (Hv / Hk)): the rows of its q, k and v
heads in `in_proj_qkv` and `conv1d` (three ranges of the q|k|v layout), of its value heads in
`in_proj_z`, `in_proj_b`, `in_proj_a`, `dt_bias` and `A_log`; `out_proj` is row-parallel, one
all-reduce after it; the gated norm (per head dim) is whole on every rank. The state pools
hold the rank's heads only.
"""

from __future__ import annotations

import math
from functools import partial

import torch
from torch import nn

from blockdraft.distributed.tensor_parallel import (
    Shard,
    TensorParallel,
    current_tensor_parallel,
    tag_shard,
)
from blockdraft.kernels.forward_context import (
    LinearStateMetadata,
    current_kernel_policy,
    get_attention_metadata,
)
from blockdraft.kernels.gated_delta_rule import (
    causal_conv1d_torch,
    chunk_gated_delta_rule_varlen_torch,
    gate_inputs_torch,
    rms_norm_gated_torch,
    split_heads,
    store_conv_state_torch,
)
from blockdraft.kernels.gated_deltanet_verify import (
    MAX_CHUNK_ROWS,
    MAX_CONV_TAPS,
    gated_deltanet_commit_torch,
)
from blockdraft.kernels.select import (
    GatedDeltaNetDecodeFn,
    GatedDeltaNetVerifyFn,
    PerDevice,
    get_chunk_gated_delta_rule_backend,
    get_gated_delta_rule_backend,
    get_gated_deltanet_commit_backend,
    get_gated_deltanet_decode_backend,
    get_gated_deltanet_verify_backend,
    needs_autograd,
)
from blockdraft.layers.linear import fuse_linears, linear, row_parallel_linear

# A layer's state pools, in the order the commit kernels take them.
STATE_POOLS = ("conv_state", "recurrent_state", "stash_qkv", "stash_mixed", "stash_gb")


class RMSNormGated(nn.Module):
    """`weight * rms_norm(x) * silu(z)` per head (normalised in float32, rounded back to x's
    dtype before the weight, gated in float32), as transformers' `Qwen3_5RMSNormGated`."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self,
        x: torch.Tensor,  # [..., hidden]
        gate: torch.Tensor,  # [..., hidden]
    ) -> torch.Tensor:  # [..., hidden], x's dtype
        return rms_norm_gated_torch(x, gate, self.weight, self.eps)


def _head_shards(
    tp: TensorParallel, num_k_heads: int, num_v_heads: int, k_head_dim: int, v_head_dim: int
) -> tuple[Shard, Shard, Shard]:
    """This rank's rows of the q|k|v projection (and conv), of the value features (z) and of
    the value heads (b, a, dt_bias, A_log): its contiguous share of the key heads and of the
    value heads (config.check_tensor_parallel_shape checks the divisibility)."""
    key_dim, value_dim = num_k_heads * k_head_dim, num_v_heads * v_head_dim
    k_start, k_stop = (h * k_head_dim for h in tp.split(num_k_heads))
    v_start, v_stop = (h * v_head_dim for h in tp.split(num_v_heads))
    more = ((key_dim + k_start, key_dim + k_stop), (2 * key_dim + v_start, 2 * key_dim + v_stop))
    qkv = Shard(0, k_start, k_stop, 2 * key_dim + value_dim, more)
    return qkv, Shard(0, v_start, v_stop, value_dim), Shard(0, *tp.split(num_v_heads), num_v_heads)


class GatedDeltaNet(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_k_heads: int,
        num_v_heads: int,
        k_head_dim: int,
        v_head_dim: int,
        conv_kernel: int,
        eps: float,
    ) -> None:
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError(
                f"linear_num_value_heads {num_v_heads} must be a multiple of "
                f"linear_num_key_heads {num_k_heads}"
            )
        self.tp = tp = current_tensor_parallel()
        if tp is not None:
            shards = _head_shards(tp, num_k_heads, num_v_heads, k_head_dim, v_head_dim)
            num_k_heads, num_v_heads = num_k_heads // tp.size, num_v_heads // tp.size
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.k_head_dim, self.v_head_dim = k_head_dim, v_head_dim
        self.key_dim, self.value_dim = num_k_heads * k_head_dim, num_v_heads * v_head_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel = conv_kernel
        self.in_proj_qkv = nn.Linear(hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden_size, num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden_size, num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=False
        )
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(num_v_heads))
        self.norm = RMSNormGated(v_head_dim, eps)
        self.out_proj = nn.Linear(self.value_dim, hidden_size, bias=False)
        if tp is not None:
            qkv, value, heads = shards
            tag_shard(self.in_proj_qkv.weight, qkv)
            tag_shard(self.conv1d.weight, qkv)
            tag_shard(self.in_proj_z.weight, value)
            for param in (self.in_proj_b.weight, self.in_proj_a.weight, self.dt_bias, self.A_log):
                tag_shard(param, heads)
            tag_shard(self.out_proj.weight, Shard(1, value.start, value.stop, value.full))
        # Bound by `allocate_states`: slot pools, the last slot spare.
        self.conv_state: torch.Tensor | None = None  # [num_slots, K - 1, conv_dim]
        self.recurrent_state: torch.Tensor | None = None  # [num_slots, Hv, Dk, Dv] float32
        # A verify block's inputs, kept for the commit: conv inputs, conv outputs, g and beta.
        self.stash_qkv: torch.Tensor | None = None  # [num_slots, max_verify, conv_dim]
        self.stash_mixed: torch.Tensor | None = None  # [num_slots, max_verify, conv_dim]
        self.stash_gb: torch.Tensor | None = None  # [num_slots, max_verify, 2 * Hv] float32
        self._recurrence = PerDevice(get_gated_delta_rule_backend)  # Triton on CUDA
        self._chunked = PerDevice(get_chunk_gated_delta_rule_backend)  # Triton on CUDA
        self._fused_decode = PerDevice(get_gated_deltanet_decode_backend)  # Triton on CUDA
        self._fused_verify = PerDevice(get_gated_deltanet_verify_backend)  # Triton on CUDA
        self._chunked_verify = PerDevice(partial(get_gated_deltanet_verify_backend, chunked=True))
        self._fused_commit = PerDevice(get_gated_deltanet_commit_backend)  # Triton on CUDA
        # Arrivals of a fused launch's programs, left zeroed: per (sequence, key head) in a
        # decode, per (sequence, value head) in a verify.
        self.arrival_counters: torch.Tensor | None = None  # [num_slots * (Hk + Hv)] int32
        self._in_proj: tuple[torch.Tensor, torch.Tensor | None] | None = None  # fuse_projections

    def fuse_projections(self) -> None:
        """One GEMM for the four input projections (qkv, z, b, a) instead of four."""
        self._in_proj = fuse_linears(
            self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a
        )

    def state_bytes(self, dtype: torch.dtype, max_verify_len: int) -> int:
        """Bytes of one slot of the pools `state_shapes` lists: conv state and verify stash in
        `dtype` (g, beta in float32), recurrent state in float32."""
        shapes = self.state_shapes(1, max_verify_len, dtype).values()
        return sum(math.prod(shape) * dt.itemsize for shape, dt in shapes)

    def state_shapes(
        self, num_slots: int, max_verify_len: int, dtype: torch.dtype
    ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The shape and dtype of each state pool, by attribute name (`STATE_POOLS` order)."""
        hv, dk, dv = self.num_v_heads, self.k_head_dim, self.v_head_dim
        stash = (num_slots, max_verify_len)
        return {
            "conv_state": ((num_slots, self.conv_kernel - 1, self.conv_dim), dtype),
            "recurrent_state": ((num_slots, hv, dk, dv), torch.float32),
            "stash_qkv": ((*stash, self.conv_dim), dtype),
            "stash_mixed": ((*stash, self.conv_dim), dtype),
            "stash_gb": ((*stash, 2 * hv), torch.float32),
        }

    def allocate_states(
        self,
        num_slots: int,
        max_verify_len: int,
        dtype: torch.dtype,
        device: torch.device,
        pools: dict[str, torch.Tensor] | None = None,  # zeroed, by name, as `state_shapes`
    ) -> None:
        """Zeroed pools for num_slots requests; verify blocks of up to max_verify_len rows (0:
        no speculation, no stash). `pools`: tensors made by the caller to use instead (a
        model's pools of every layer stacked, whose commit is then one launch)."""
        if pools is None:
            shapes = self.state_shapes(num_slots, max_verify_len, dtype)
            pools = {name: torch.zeros(shape, dtype=dt, device=device)
                     for name, (shape, dt) in shapes.items()}  # fmt: skip
        for name in STATE_POOLS:
            setattr(self, name, pools[name])
        hv = self.num_v_heads
        # A decode's programs arrive per (sequence, key head), and with split heads also per
        # (sequence, value head); a verify's per (sequence, value head).
        counters = num_slots * (self.num_k_heads + hv)
        self.arrival_counters = torch.zeros(counters, dtype=torch.int32, device=device)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
    ) -> torch.Tensor:  # [num_tokens, hidden]
        if self._in_proj is not None:
            return self.mix_projected(linear(x, *self._in_proj))
        qkv = linear(x, self.in_proj_qkv.weight)  # [num_tokens, conv_dim]
        z = linear(x, self.in_proj_z.weight)  # [num_tokens, value_dim]
        ba = torch.cat((linear(x, self.in_proj_b.weight), linear(x, self.in_proj_a.weight)), -1)
        return self._forward(qkv, z, ba)

    def mix_projected(
        self,
        projected: torch.Tensor,  # [num_tokens, conv_dim + value_dim + 2 * Hv], fused in_proj's
    ) -> torch.Tensor:  # [num_tokens, hidden]
        """The rest of `forward` after the fused input projection (`_in_proj`), for a caller
        that formed it itself (the input norm in the skinny GEMM's loads)."""
        split = (self.conv_dim, self.value_dim, 2 * self.num_v_heads)
        return self._forward(*projected.split(split, dim=-1))

    def _forward(
        self,
        qkv: torch.Tensor,  # [num_tokens, conv_dim]
        z: torch.Tensor,  # [num_tokens, value_dim], the output gate
        ba: torch.Tensor,  # [num_tokens, 2 * Hv], beta then the decay's a
    ) -> torch.Tensor:  # [num_tokens, hidden]
        meta = get_attention_metadata().linear
        if meta is None:
            raise RuntimeError("a linear-attention layer needs LinearStateMetadata")
        weights = (self.conv1d.weight.view(self.conv_dim, -1), self.A_log, self.dt_bias,
                   self.norm.weight, self.norm.eps, self.num_k_heads)  # fmt: skip
        pools = (self.conv_state, self.recurrent_state)
        if (decode := self._decode_kernel(meta, qkv)) is not None:
            fill = current_kernel_policy().gated_deltanet_decode_fill_programs
            out = decode(qkv, ba, z, *weights, *pools, meta.state_slots, meta.fresh,
                         self.arrival_counters, fill_programs=fill)  # fmt: skip
        elif (verify := self._verify_kernel(meta, qkv)) is not None:
            out = verify(
                qkv, ba, z, *weights, *pools, self.stash_qkv, self.stash_mixed, self.stash_gb,
                meta.state_slots, meta.fresh, meta.step.rows, meta.step.lengths,
                self.arrival_counters,
            )  # fmt: skip
        else:
            core = self._mix(qkv, ba, meta)  # [num_tokens, Hv, Dv]
            out = self.norm(core, z.reshape(core.shape)).flatten(1)
        if self.tp is not None:
            return row_parallel_linear(self.tp, out, self.out_proj.weight, None)
        return linear(out, self.out_proj.weight)

    def _decode_kernel(
        self, meta: LinearStateMetadata, qkv: torch.Tensor
    ) -> GatedDeltaNetDecodeFn | None:
        """The one-launch decode kernel when this forward is decode rows only (one row a
        sequence, in order) and the Triton path takes it; None: the step path below."""
        step = meta.step
        if meta.prefill or step is None or step.verify is not None or step.rows.shape[1] != 1:
            return None
        if not current_kernel_policy().fuse_gated_deltanet_decode or needs_autograd(qkv):
            return None
        return self._fused_decode(qkv.device)

    def _verify_kernel(
        self, meta: LinearStateMetadata, qkv: torch.Tensor
    ) -> GatedDeltaNetVerifyFn | None:
        """The one-launch verify kernel when every sequence of this forward is a verify block
        (the step batch then lists them in order) and the Triton path takes it; None: the step
        path below."""
        step = meta.step
        if meta.prefill or step is None or step.verify is None:
            return None
        if step.verify.shape[0] != step.seqs.shape[0]:
            return None
        policy = current_kernel_policy()
        if not policy.fuse_gated_deltanet_verify or needs_autograd(qkv):
            return None
        if self.conv_kernel > MAX_CONV_TAPS:
            return None
        min_rows = policy.chunked_gated_deltanet_verify_min_rows
        if min_rows is not None and min_rows <= step.rows.shape[1] <= MAX_CHUNK_ROWS:
            return self._chunked_verify(qkv.device)
        return self._fused_verify(qkv.device)

    def _mix(
        self,
        qkv: torch.Tensor,  # [num_tokens, conv_dim] before the conv
        ba: torch.Tensor,  # [num_tokens, 2 * Hv]: b then a
        meta: LinearStateMetadata,
    ) -> torch.Tensor:  # [num_tokens, Hv, Dv]
        """Conv and delta rule of every sequence from its slot's state: the prefill chunks with
        the chunked rule, decode rows and verify blocks as one padded recurrence."""
        out = qkv.new_empty(qkv.shape[0], self.num_v_heads, self.v_head_dim)
        if meta.packed is not None:
            out[meta.packed.rows] = self._prefill(qkv, ba, meta)
        step = meta.step
        if step is not None:
            slots, fresh = meta.state_slots[step.seqs], meta.fresh[step.seqs]
            x, b_a = qkv[step.rows], ba[step.rows]  # [S, W, ...]
            core = self._advance(x, b_a, slots, fresh, step.lengths, step.write, step.verify)
            out[step.out_dst] = core.flatten(0, 1)[step.out_src]
        return out

    def commit_verified(
        self,
        slots: torch.Tensor,  # [V] int64 slots of the verified sequences
        lengths: torch.Tensor,  # [V] int64 rows to keep: the accepted drafts + the rows before
    ) -> None:
        """Advances each verified sequence's state over the first `lengths` rows of its last
        verify block (its kept conv outputs, g and beta), as decoding them would have."""
        args = (self.num_k_heads, self.conv_state, self.recurrent_state, self.stash_qkv,
                self.stash_mixed, self.stash_gb, slots, lengths)  # fmt: skip
        fused = None
        if current_kernel_policy().fuse_gated_deltanet_verify:
            fused = self._fused_commit(slots.device)
        if fused is not None:
            fused(*args)
        else:
            gated_deltanet_commit_torch(*args, recurrence=self._recurrence(slots.device))

    def _prefill(
        self,
        qkv: torch.Tensor,  # [num_tokens, conv_dim] before the conv
        ba: torch.Tensor,  # [num_tokens, 2 * Hv]: b then a
        meta: LinearStateMetadata,
    ) -> torch.Tensor:  # [Np, Hv, Dv] the prefill chunks' rows, packed
        """Conv and chunked rule of all prefill chunks at once, from and into their slots: one
        conv over their windows laid end to end, one varlen rule. Every op is elementwise or
        per chunk, so each chunk's numbers are those it gets on its own."""
        batch = meta.packed
        slots, fresh = meta.state_slots[batch.seqs], meta.fresh[batch.seqs]
        keep = ~fresh[:, None, None]
        window_rows, out_rows, state_rows = batch.conv_windows(self.conv_kernel - 1)
        # `where`, not a product: a slot's stale contents never reach a fresh sequence.
        conv_old = torch.where(keep, self.conv_state[slots], 0)
        window = torch.cat((conv_old.flatten(0, 1), qkv.to(conv_old.dtype)))[window_rows]
        mixed = causal_conv1d_torch(window[None], self.conv1d.weight.view(self.conv_dim, -1))
        mixed = mixed[0, out_rows].to(qkv.dtype)  # [Np, conv_dim]
        g, beta = gate_inputs_torch(ba[batch.rows], self.A_log, self.dt_bias)
        q, k, v = (x[0] for x in split_heads(mixed[None], self.num_k_heads, self.k_head_dim,
                                             self.num_v_heads))  # fmt: skip
        state0 = torch.where(keep[..., None], self.recurrent_state[slots], 0)
        rule = self._chunked(qkv.device)
        if needs_autograd(qkv) or not current_kernel_policy().triton_chunked_prefill:
            rule = chunk_gated_delta_rule_varlen_torch
        core, state = rule(q, k, v, g, beta, state0, batch.cu_seqlens, batch.host_cu_seqlens)
        self.recurrent_state[slots] = state
        self.conv_state[slots] = window[state_rows]
        return core

    def _advance(
        self,
        x: torch.Tensor,  # [S, T, conv_dim] conv inputs
        b_a: torch.Tensor,  # [S, T, 2 * Hv]
        slots: torch.Tensor,  # [S] int64
        fresh: torch.Tensor,  # [S] bool: start from zero states
        lengths: torch.Tensor,  # [S] int64 rows each takes
        write: torch.Tensor,  # [S] bool: store the states reached
        verify: torch.Tensor | None = None,  # [V] int64 rows (of S) whose inputs are kept
    ) -> torch.Tensor:  # [S, T, Hv, Dv]
        """Conv and recurrence of S padded sequences (decode rows, verify blocks) from their
        slots' states."""
        keep = ~fresh[:, None, None]
        # `where`, not a product: a slot's stale contents never reach a fresh sequence.
        conv_old = self.conv_state[slots]
        window = torch.cat((torch.where(keep, conv_old, 0), x.to(conv_old.dtype)), dim=1)
        mixed = causal_conv1d_torch(window, self.conv1d.weight.view(self.conv_dim, -1))
        mixed = mixed.to(x.dtype)  # [S, T, conv_dim]
        g, beta = gate_inputs_torch(b_a, self.A_log, self.dt_bias)
        if verify is not None:  # verify blocks keep their inputs for the commit
            v_slots, width = slots[verify], x.shape[1]
            self.stash_qkv[v_slots, :width] = x[verify].to(self.stash_qkv.dtype)
            self.stash_mixed[v_slots, :width] = mixed[verify].to(self.stash_mixed.dtype)
            self.stash_gb[v_slots, :width] = torch.cat((g, beta.float()), -1)[verify]
        q, k, v = split_heads(mixed, self.num_k_heads, self.k_head_dim, self.num_v_heads)
        recurrence = self._recurrence(x.device)
        core = recurrence(q, k, v, g, beta, self.recurrent_state, slots, fresh, lengths, write)
        store_conv_state_torch(self.conv_state, window, conv_old, slots, lengths, write)
        return core
