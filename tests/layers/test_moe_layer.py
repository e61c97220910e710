"""`blockdraft.layers.moe.SparseMoE` against transformers' sparse blocks with the same state dict
(Qwen3-MoE; Qwen3-Next's gated shared expert), the backend indirection it calls, per-expert
checkpoint tensors stacked into its parameters at load, and the MoE config's validation."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3NextConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

from blockdraft.kernels import moe as moe_kernels
from blockdraft.kernels.forward_context import use_kernel_policy
from blockdraft.kernels.policy import KernelPolicy
from blockdraft.layers.moe import SparseMoE
from blockdraft.models.loader import load_weights
from blockdraft.models.model_config import MoEConfig
from blockdraft.models.qwen3_moe import Qwen3MoeForCausalLM, qwen3_moe_config

from kernel_inputs import DEVICE, needs_triton

HIDDEN, EXPERTS, TOP_K, INTER, SHARED = 32, 6, 2, 16, 24


def randomize(module: torch.nn.Module, rng: torch.Generator) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=rng) * 0.3)


@pytest.mark.parametrize(
    "backend,num_tokens",
    [
        ("torch", 7),
        pytest.param("triton", 1, marks=needs_triton),
        pytest.param("triton", 12, marks=needs_triton),
    ],
)
@pytest.mark.parametrize("shared", [False, True], ids=["qwen3-moe", "qwen3-next-shared"])
def test_matches_transformers_block(rng, shared: bool, backend: str, num_tokens: int) -> None:
    common = dict(
        hidden_size=HIDDEN,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        moe_intermediate_size=INTER,
        norm_topk_prob=not shared,
    )
    if shared:
        cfg = Qwen3NextConfig(**common, shared_expert_intermediate_size=SHARED)
        ref = Qwen3NextSparseMoeBlock(cfg).float().eval()
    else:
        ref = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(**common)).float().eval()
    randomize(ref, rng)
    ours = SparseMoE(HIDDEN, EXPERTS, TOP_K, INTER, not shared, SHARED if shared else 0)
    ours.load_state_dict(ref.state_dict(), strict=True)  # the same parameter names
    # Triton: 1 token takes the decode path (T * k <= 16), 12 the grouped GEMMs.
    x = torch.randn(num_tokens, HIDDEN, generator=rng)
    with torch.no_grad():
        expected = ref(x[None])
        expected = expected[0] if isinstance(expected, tuple) else expected
    # Triton: the interpreter on the CPU, the compiled kernels on a GPU (TRITON_INTERPRET=0).
    device = DEVICE if backend == "triton" else torch.device("cpu")
    with torch.no_grad(), use_kernel_policy(KernelPolicy(backend=backend)):
        got = ours.to(device)(x.to(device)).cpu()
    tol = 1e-5 if device.type == "cpu" else 1e-4  # fp32 tensor-core dots round differently
    torch.testing.assert_close(got, expected.reshape(x.shape), rtol=tol, atol=tol)


@pytest.mark.parametrize(
    "backend,num_tokens",
    [
        ("torch", 9),
        pytest.param("triton", 1, marks=needs_triton),
        pytest.param("triton", 2, marks=needs_triton),
        pytest.param("triton", 12, marks=needs_triton),
    ],
)
def test_shared_expert_fused_as_one_more_expert(rng, backend: str, num_tokens: int) -> None:
    """With the shared expert as wide as the routed ones, `fuse_projections` stacks it after
    them and its gate row after the router's: the layer then matches transformers' block and
    its own unfused forward, whether the shared expert runs as a routed slot or apart (by the
    policy's token limit), keeps its state dict and holds each weight once (the shared
    expert's parameters are views of the stack)."""
    cfg = Qwen3NextConfig(
        hidden_size=HIDDEN,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        moe_intermediate_size=INTER,
        shared_expert_intermediate_size=INTER,
        norm_topk_prob=True,
    )
    ref = Qwen3NextSparseMoeBlock(cfg).float().eval()
    randomize(ref, rng)
    ours = SparseMoE(HIDDEN, EXPERTS, TOP_K, INTER, True, INTER)
    ours.load_state_dict(ref.state_dict(), strict=True)
    x = torch.randn(num_tokens, HIDDEN, generator=rng)
    device = DEVICE if backend == "triton" else torch.device("cpu")
    ours, xd = ours.to(device), x.to(device)
    routes = []
    route_fn, experts_fn = moe_kernels.moe_backend(device)

    def route_spy(*args, **kwargs):
        routes.append(kwargs.get("shared_expert", False))
        return route_fn(*args, **kwargs)

    ours._backend = lambda device: (route_spy, experts_fn)
    with torch.no_grad():
        with use_kernel_policy(KernelPolicy(backend=backend)):
            unfused = ours(xd).cpu()
            ours.fuse_projections()
            ours.shared_expert.fuse_projections()  # as the loader reaches it: left as adopted
        fused = {}  # the shared expert as a routed slot (tokens <= the limit), else apart
        for limit in (num_tokens, num_tokens - 1):
            policy = KernelPolicy(backend=backend, moe_shared_slot_max_tokens=limit)
            with use_kernel_policy(policy):
                fused[limit] = ours(xd).cpu()
        expected = ref(x[None])
    assert routes == [False, True, False]
    expected = (expected[0] if isinstance(expected, tuple) else expected).reshape(x.shape)
    tol = 1e-5 if device.type == "cpu" else 1e-4
    for got in fused.values():
        torch.testing.assert_close(got, expected, rtol=tol, atol=tol)
        torch.testing.assert_close(got, unfused, rtol=tol, atol=tol)
    state = ours.state_dict()
    assert state.keys() == ref.state_dict().keys()
    for name, value in ref.state_dict().items():
        assert torch.equal(state[name].cpu(), value), name
    gate_up, down = ours._stacked
    assert gate_up.shape[0] == down.shape[0] == EXPERTS + 1
    shared = ours.shared_expert
    for param, owner in [
        (ours.experts.gate_up_proj, gate_up),
        (shared.gate_proj.weight, gate_up),
        (shared.up_proj.weight, gate_up),
        (ours.experts.down_proj, down),
        (shared.down_proj.weight, down),
        (ours.shared_expert_gate.weight, ours._router),
    ]:
        assert param.untyped_storage().data_ptr() == owner.untyped_storage().data_ptr()


def test_shared_expert_of_another_width_stays_apart(rng) -> None:
    """A shared expert wider than the routed ones cannot stack with them: the layer keeps its
    own shared-expert path after `fuse_projections`, with the same output."""
    layer = SparseMoE(HIDDEN, EXPERTS, TOP_K, INTER, True, SHARED)
    randomize(layer, rng)
    x = torch.randn(5, HIDDEN, generator=rng)
    with torch.no_grad():
        before = layer(x)
        layer.fuse_projections()
        after = layer(x)
    assert layer._stacked is None
    torch.testing.assert_close(after, before, rtol=0, atol=0)


def test_calls_the_backend_pair(rng, monkeypatch) -> None:
    """The layer routes and runs its experts through `moe_backend`, with its own top-k and
    renormalisation."""
    calls = []

    def route(logits, top_k, renormalize):
        calls.append(("route", logits.shape, top_k, renormalize))
        return moe_kernels.route_torch(logits, top_k, renormalize)

    def experts(*args):
        calls.append(("experts", args[0].shape))
        return moe_kernels.experts_torch(*args)

    monkeypatch.setattr("blockdraft.layers.moe.moe_backend", lambda device: (route, experts))
    layer = SparseMoE(HIDDEN, EXPERTS, TOP_K, INTER, renormalize=True)
    randomize(layer, rng)
    layer(torch.randn(3, HIDDEN, generator=rng))
    assert calls == [("route", (3, EXPERTS), TOP_K, True), ("experts", (3, HIDDEN))]


def tiny_hf_config(**kw) -> dict:
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "vocab_size": 50,
        "hidden_size": HIDDEN,
        "intermediate_size": 40,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "num_local_experts": EXPERTS,  # how transformers 5 writes num_experts
        "num_experts_per_tok": TOP_K,
        "moe_intermediate_size": INTER,
        "mlp_only_layers": [0],
        **kw,
    }


def test_per_expert_tensors_stack_into_the_parameters(rng) -> None:
    """A checkpoint with one tensor per expert fills the stacked parameters ([gate; up] rows of
    gate_up_proj); one expert missing leaves the parameter unfilled, which is an error."""
    model = Qwen3MoeForCausalLM(qwen3_moe_config(tiny_hf_config()))
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == ["MLP", "SparseMoE"]
    stacked = {k: torch.randn(v.shape, generator=rng) for k, v in model.state_dict().items()}
    tensors = {}
    for name, tensor in stacked.items():
        prefix, _, kind = name.rpartition(".")
        if kind == "gate_up_proj":
            for e in range(EXPERTS):
                tensors[f"{prefix}.{e}.gate_proj.weight"] = tensor[e, :INTER]
                tensors[f"{prefix}.{e}.up_proj.weight"] = tensor[e, INTER:]
        elif kind == "down_proj" and prefix.endswith("experts"):
            for e in range(EXPERTS):
                tensors[f"{prefix}.{e}.down_proj.weight"] = tensor[e]
        else:
            tensors[name] = tensor
    params = dict(model.named_parameters())
    load_weights(params, tensors.items(), "ckpt", locate=model.checkpoint_slice)
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, stacked[name], rtol=0, atol=0, msg=name)
    tensors.pop("model.layers.1.mlp.experts.4.up_proj.weight")
    with pytest.raises(ValueError, match=r"missing tensors \['model.layers.1.mlp.experts.gate_up"):
        load_weights(params, tensors.items(), "ckpt", locate=model.checkpoint_slice)
    tensors["model.layers.1.mlp.experts.4.up_proj.weight"] = torch.zeros(INTER + 1, HIDDEN)
    with pytest.raises(ValueError, match=r"experts.4.up_proj.weight' has shape \(17, 32\)"):
        load_weights(params, tensors.items(), "ckpt", locate=model.checkpoint_slice)


@pytest.mark.parametrize(
    "edit, message",
    [
        (dict(num_experts_per_tok=EXPERTS + 1), "num_experts_per_tok 7 must be between 1 and"),
        (dict(num_experts_per_tok=None), "num_experts_per_tok"),
        (dict(moe_intermediate_size=0), "moe_intermediate_size >= 1"),
        (dict(decoder_sparse_step=-1), "decoder_sparse_step must be >= 1"),
    ],
)
def test_bad_moe_configs_are_rejected(edit: dict, message: str) -> None:
    hf = {k: v for k, v in tiny_hf_config(**edit).items() if v is not None}
    with pytest.raises(ValueError, match=message):
        qwen3_moe_config(hf)


def test_sparse_layers_follow_step_and_mlp_only_layers() -> None:
    moe = MoEConfig(8, 2, 16, True, decoder_sparse_step=2, mlp_only_layers=(3,))
    assert [moe.is_sparse(i) for i in range(6)] == [False, True, False, False, False, True]
