"""The Llama family (Llama, Qwen3 dense) through the paged path equals transformers: prefill and
per-step decode logits; its decoder layers fuse the residual adds into the norms and the KV
store into RoPE, and add + norm into the skinny GEMMs, without changing their outputs."""

from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from blockdraft import LLM
from blockdraft.engine.sequence import Sequence
from blockdraft.kernels import triton_attention, triton_rope
from blockdraft.kernels.forward_context import PAD_SLOT_ID, forward_context
from blockdraft.kernels.triton_kv_store import triton_store_kv
from blockdraft.kernels.triton_linear import skinny_linear
from blockdraft.kernels.triton_rmsnorm import triton_rms_norm
from blockdraft.kernels.triton_rope import triton_qk_norm_rope_store
from blockdraft.layers import linear as linear_layer
from blockdraft.layers.linear import fuse_projections
from blockdraft.layers.norm import RMSNorm, final_norm
from blockdraft.layers.rotary import RotaryEmbedding
from blockdraft.models.llama import DecoderLayer, DecoderLM
from blockdraft.models.model_config import TransformerConfig
from blockdraft.runtime.host_batch import build_attention_metadata
from blockdraft.sampling_params import SamplingParams

from checkpoints import make_llama_checkpoint, make_qwen3_checkpoint
from kernel_inputs import (
    ATOL,
    DEVICE,
    assert_same_slots,
    eager_rms_norm,
    needs_triton,
    paged_batch,
    randn,
    tiny_qwen3_config,
)

CASES = {
    # name: (builder, kwargs) covering tied/untied, llama3 rope scaling, GQA 1/2/4, odd head_dim
    "qwen3-untied-gqa2-hd24": (
        make_qwen3_checkpoint,
        dict(num_heads=4, num_kv_heads=2, head_dim=24, tie_word_embeddings=False),
    ),
    "qwen3-tied-gqa1": (
        make_qwen3_checkpoint,
        dict(num_heads=4, num_kv_heads=4, tie_word_embeddings=True),
    ),
    "llama-llama3rope-gqa4": (
        make_llama_checkpoint,
        dict(num_heads=4, num_kv_heads=1, llama3_rope_scaling=True),
    ),
    "llama-untied-hd8": (
        make_llama_checkpoint,
        dict(
            num_heads=4,
            num_kv_heads=2,
            head_dim=8,
            tie_word_embeddings=False,
            llama3_rope_scaling=False,
        ),
    ),
}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory) -> Path:
    builder, kwargs = CASES[request.param]
    return builder(tmp_path_factory.mktemp(request.param), **kwargs)


def paged_logits(llm: LLM, token_ids: list[int], chunks: list[int]) -> torch.Tensor:
    """Logits at every position, computing the sequence in the given chunk sizes (a chunk of 1
    is a decode step reading the cache)."""
    engine = llm.engine
    seq = Sequence("probe", None, token_ids, SamplingParams(), 0, 1)
    assert engine.block_manager.ensure_capacity(seq, len(token_ids))
    out, start = [], 0
    for n in chunks:
        meta = build_attention_metadata(
            [seq.block_table], [start], [n], engine.config.block_size, engine.device
        )
        with torch.inference_mode(), forward_context(meta):
            hidden, _ = engine.model(
                torch.tensor(token_ids[start : start + n]), torch.arange(start, start + n)
            )
        out.append(engine.model.compute_logits(hidden))
        start += n
    engine.block_manager.free(seq)
    return torch.cat(out)


def test_prefill_and_decode_logits_match_transformers(checkpoint: Path, rng) -> None:
    ref_model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    llm = LLM(str(checkpoint), block_size=4)
    vocab = ref_model.config.vocab_size
    ids = torch.randint(4, vocab, (37,), generator=rng).tolist()
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0]
    # Prefill 21 tokens in chunks of 16 and 5, then decode the rest one token at a time.
    ours = paged_logits(llm, ids, [16, 5] + [1] * 16)
    assert rel_err(ours[:21], ref[:21]) < 1e-4
    assert rel_err(ours[21:], ref[21:]) < 1e-4


# --- decoder layers: residual adds fused into the norms ------------------------------------


def layer_stack(
    rng: torch.Generator, dtype: torch.dtype, num_layers: int = 2
) -> tuple[nn.ModuleList, RMSNorm]:
    """Qwen3-shaped layers (q/k norms, GQA 2) and a final norm with random weights."""
    cfg = TransformerConfig(
        architecture="qwen3",
        vocab_size=64,
        hidden_size=48,
        intermediate_size=80,
        num_layers=num_layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attention_bias=False,
        qk_norm=True,
    )
    with torch.device(DEVICE):  # the rotary tables too: the compiled kernels read them
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, None)
        layers = nn.ModuleList(DecoderLayer(cfg, rotary) for _ in range(num_layers))
        final = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    for name, p in [*layers.named_parameters(), *final.named_parameters(prefix="final")]:
        # Norm weights around 1, projections at about 1/sqrt(fan_in): activations stay O(1).
        init = 1 + 0.1 * randn(rng, *p.shape) if "norm" in name else 0.2 * randn(rng, *p.shape)
        p.data = init
    return layers.to(dtype).requires_grad_(False), final.to(dtype).requires_grad_(False)


def unfused_stack(
    layers: nn.ModuleList,
    final: RMSNorm,
    x: torch.Tensor,  # [num_tokens, hidden]
    positions: torch.Tensor,  # [num_tokens] int64
) -> torch.Tensor:  # [num_tokens, hidden]
    """The pre-norm blocks as written before the fusion: eager adds, then a torch norm."""

    def norm(module: RMSNorm, h: torch.Tensor) -> torch.Tensor:
        return eager_rms_norm(h, module.weight, module.eps)

    for layer in layers:
        x = x + layer.self_attn(norm(layer.input_layernorm, x), positions)
        x = x + layer.mlp(norm(layer.post_attention_layernorm, x))
    return norm(final, x)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_decoder_layers_fused_residual_norm(
    rng, monkeypatch, set_policy, backend: str, dtype: torch.dtype
) -> None:
    # Only the norms change backend: attention stays on the torch twin, as the interpreter's
    # bf16 dots are not faithful (tests/engine/test_llm_engine.py covers the kernels together,
    # in fp32).
    set_policy(backend="torch")
    if backend == "triton":
        monkeypatch.setattr("blockdraft.layers.norm.get_rms_norm_backend", lambda d: counting)
    fused_calls = []

    def counting(*args: object, **kwargs: object) -> object:
        fused_calls.append(len(args) > 3 and args[3] is not None)
        return triton_rms_norm(*args, **kwargs)

    layers, final = layer_stack(rng, dtype)
    # A prefill chunk, a decode row and a verify block over scattered pages.
    starts, query_lens = [5, 9, 3], [6, 1, 4]
    meta, key_cache, _ = paged_batch(rng, starts, query_lens, 4, 2, 16)
    for layer in layers:
        attn = layer.self_attn.attn
        attn.key_cache = randn(rng, *key_cache.shape).to(dtype)
        attn.value_cache = randn(rng, *key_cache.shape).to(dtype)
    positions = torch.cat(
        [torch.arange(s, s + n) for s, n in zip(starts, query_lens, strict=True)]
    ).to(DEVICE)
    x = randn(rng, sum(query_lens), 48).to(dtype)
    with torch.inference_mode(), forward_context(meta):
        expected = unfused_stack(layers, final, x, positions)
        h, residual = x, None
        for layer in layers:
            h, residual = layer(h, positions, residual)
        got = final_norm(final, h, residual)
    if backend == "torch":  # today's numerics, bit for bit
        torch.testing.assert_close(got, expected, atol=0, rtol=0)
        return
    # Every norm but the first input norm (no residual yet) fused an add; the q/k norms run
    # inside the RoPE kernel's torch twin here (only the RMSNorm modules switch backend).
    assert fused_calls.count(True) == 2 * len(layers)
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=1e-4)
    else:
        # bf16: another rounding of rstd moves values by a bf16 ulp, which the following
        # layers carry on.
        torch.testing.assert_close(got, expected, atol=3e-2, rtol=3e-2)


@pytest.mark.slow
@needs_triton
def test_decoder_fuses_kv_store_into_rope(rng, monkeypatch, set_policy) -> None:
    """With fuse_kv_store_into_rope, Qwen3 layers on the Triton path (fused q/k/v: strided
    heads) store their keys and values from the RoPE kernel and attend without the store
    kernel, and the drafter's context rows (`write_kv`) likewise: the same outputs and caches,
    bit for bit, as the separate store."""
    set_policy(backend="triton")
    calls = {"store": 0, "rope+store": 0}

    def counting_store(*args: object) -> None:
        calls["store"] += 1
        triton_store_kv(*args)

    def counting_rope_store(*args: object, **kwargs: object) -> object:
        calls["rope+store"] += 1
        return triton_qk_norm_rope_store(*args, **kwargs)

    monkeypatch.setattr("blockdraft.kernels.triton_kv_store.triton_store_kv", counting_store)
    for module in (triton_rope, triton_attention):  # the drafter's context path, the layers'
        monkeypatch.setattr(module, "triton_qk_norm_rope_store", counting_rope_store)
    layers, final = layer_stack(rng, torch.float32)
    fuse_projections(layers)
    # A prefill chunk, a decode row and a verify block over scattered pages.
    starts, query_lens = [5, 9, 3], [3, 1, 4]
    meta, key_cache, _ = paged_batch(rng, starts, query_lens, 4, 2, 16)
    caches = [(randn(rng, *key_cache.shape), randn(rng, *key_cache.shape)) for _ in layers]
    positions = torch.cat(
        [torch.arange(s, s + n) for s, n in zip(starts, query_lens, strict=True)]
    ).to(DEVICE)
    x = randn(rng, sum(query_lens), 48)
    # Context rows as the drafter writes them, one PAD among them, into slots the block
    # forward does not touch (the pool's spare blocks but the last).
    ctx_slots = torch.tensor([0, PAD_SLOT_ID, 2, 5], device=DEVICE)
    ctx_slots[ctx_slots >= 0] += (key_cache.shape[0] - 3) * 4
    ctx_positions = torch.tensor([7, 0, 8, 9], device=DEVICE)
    ctx = randn(rng, 4, 48)

    def run(fuse: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        set_policy(backend="triton", fuse_kv_store_into_rope=fuse)
        for layer, (k, v) in zip(layers, caches, strict=True):
            layer.self_attn.attn.key_cache, layer.self_attn.attn.value_cache = k.clone(), v.clone()
        with torch.inference_mode(), forward_context(meta):
            h, residual = x, None
            for layer in layers:
                layer.self_attn.write_kv(ctx, ctx_positions, ctx_slots, counting_store)
                h, residual = layer(h, positions, residual)
            out = final_norm(final, h, residual)
        attns = [layer.self_attn.attn for layer in layers]
        return out, [c for a in attns for c in (a.key_cache, a.value_cache)]

    expected, expected_caches = run(False)
    assert calls == {"store": 2 * len(layers), "rope+store": 0}
    calls.update(store=0)
    got, got_caches = run(True)
    assert calls == {"store": 0, "rope+store": 2 * len(layers)}
    assert torch.equal(got, expected)
    for g, e in zip(got_caches, expected_caches, strict=True):
        # All but the pool's reserved last slot, where the torch store sends PAD rows.
        assert_same_slots(g, e)


# --- decoder layers: add + RMSNorm fused into the skinny GEMM ------------------------------


class StubAttention(nn.Module):
    """A cheap deterministic stand-in for PagedAttention (no KV cache or metadata needed)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return 0.5 * q + v.repeat_interleave(q.shape[1] // v.shape[1], dim=1) - k.mean(1, True)


@pytest.mark.slow
@needs_triton
# The flag off changes nothing in any dtype: float32 shows it.
@pytest.mark.parametrize(
    ("fuse", "dtype"),
    [(False, torch.float32), (True, torch.float32), (True, torch.float16)],
    ids=["unfused-fp32", "fused-fp32", "fused-fp16"],
)
def test_decoder_fuses_norms_into_skinny(
    rng, monkeypatch, set_policy, fuse: bool, dtype: torch.dtype
) -> None:
    """With fuse_norm_into_skinny, a Qwen3-style model (q/k norms) with fused projections runs
    each layer's two add + norms in the q/k/v and gate/up GEMMs up to norm_prologue_max_rows rows,
    bit for bit the unfused outputs (hidden states and captured features, which the next
    layer's input norm writes); past that, or with the flag off, nothing changes. The features
    are each captured layer's output (the final-normed one for the last layer)."""
    # Skinny up to 4 rows, its prologues up to norm_prologue_max_rows (2) only. The stub
    # below replaces the paged cache, so K/V take the separate store (the stub's no-op).
    policy = dict(
        backend="triton", skinny_device_type=DEVICE.type, skinny_max_rows=4,
        fuse_kv_store_into_rope=False,
    )  # fmt: skip
    calls = []

    def counting(device: torch.device):
        def run(x, weight, bias, **kwargs):
            calls.append("norm+linear" if "rms_norm" in kwargs else "linear")
            return skinny_linear(x, weight, bias, **kwargs)

        return run

    monkeypatch.setattr(linear_layer, "get_linear_backend", counting)
    cfg = tiny_qwen3_config(num_layers=3)
    with torch.device(DEVICE):
        lm = DecoderLM(cfg)
    for name, p in lm.named_parameters():
        p.data = 1 + 0.1 * randn(rng, *p.shape) if "norm" in name else 0.3 * randn(rng, *p.shape)
    lm = lm.to(dtype).requires_grad_(False)
    fuse_projections(lm)
    for layer in lm.model.layers:
        layer.self_attn.attn = StubAttention()
    # Layer 0 starts the stream (no residual), layers 1 and 2 add one; a capture has the next
    # layer's input norm (or the final norm's copy) write the stream into its features.
    # Listed in any order, a layer maybe twice (z-lab's default ids for a shallow target).
    subsets = [(0,), (1,), (2,), (0, 2), (1, 2), (0, 1, 2), (1, 1, 1), (2, 0, 2)]
    lm.capture_layer_ids = subsets[int(torch.randint(len(subsets), (1,), generator=rng))]
    outputs = []
    for layer in lm.model.layers:
        layer.register_forward_hook(lambda m, i, out: outputs.append(out[0] + out[1]))
    for rows in [1, 2, 3, 5]:
        ids = torch.randint(0, cfg.vocab_size, (rows,), generator=rng).to(DEVICE)
        positions = torch.arange(rows, device=DEVICE)
        set_policy(**policy, fuse_norm_into_skinny=False)
        outputs.clear()
        expected = lm(ids, positions)
        captured = [outputs[i] if i < 2 else expected[0] for i in lm.capture_layer_ids]
        assert torch.equal(expected[1], torch.cat(captured, dim=-1)), lm.capture_layer_ids
        set_policy(**policy, fuse_norm_into_skinny=fuse)
        calls.clear()
        outputs.clear()
        got = lm(ids, positions)
        if rows > 4:
            assert calls == []
        elif rows > 2:  # skinny, without prologues
            assert calls == ["linear"] * 12
        elif fuse:  # per layer: norm+qkv, o_proj, norm+gate_up, down
            assert calls == ["norm+linear", "linear", "norm+linear", "linear"] * 3
        else:
            assert calls == ["linear"] * 12
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
