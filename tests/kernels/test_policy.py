"""The kernel policy: its validation, where kernels find it (forward context, engine), and the
one environment entry point (BLOCKDRAFT_KERNELS, read by blockdraft/config.py)."""

import dataclasses

import pytest
import torch

from blockdraft.config import KERNELS_ENV_VAR, EngineConfig
from blockdraft.kernels.forward_context import (
    AttentionMetadata,
    current_kernel_policy,
    forward_context,
    use_kernel_policy,
)
from blockdraft.kernels.policy import KernelPolicy


def test_defaults_are_the_measured_ones() -> None:
    policy = KernelPolicy()
    assert policy.backend == "auto" and policy.pdl and policy.pdl_max_query_len == 1
    assert policy.skinny_max_rows == 16 and policy.skinny_device_type == "cuda"
    assert policy.norm_prologue_max_rows == policy.silu_mul_prologue_max_rows == 2
    assert policy.fuse_silu_mul_into_down and policy.fuse_norm_into_skinny
    assert policy.fuse_kv_store_into_rope and policy.fuse_decode_split_merge
    assert policy.rope_in_attention_max_query_len == 1
    assert policy.chunked_gated_deltanet_verify_min_rows == 6
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.pdl = False  # type: ignore[misc]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("backend", "flash"),
        ("skinny_device_type", "mps"),
        ("skinny_max_rows", -1),
        ("skinny_max_rows", 2.5),
        ("skinny_max_rows", True),
        ("pdl_max_query_len", "1"),
        ("rope_in_attention_max_query_len", -3),
        ("pdl", 1),
        ("fuse_decode_split_merge", None),
        ("chunked_gated_deltanet_verify_min_rows", 0),
        ("chunked_gated_deltanet_verify_min_rows", 8.0),
        ("chunked_gated_deltanet_verify_min_rows", True),
        ("cpu_weight_left_rows", 16),
        ("cpu_weight_left_rows", [1, 2]),
        ("cpu_weight_left_rows", (5,)),
        ("cpu_weight_left_rows", (2, 1)),
        ("cpu_weight_left_rows", (1, 1)),
        ("cpu_weight_left_rows", (True,)),
    ],
)
def test_bad_fields_are_named(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        KernelPolicy(**{field: value})


def test_zero_row_limits_mean_never() -> None:
    policy = KernelPolicy(rope_in_attention_max_query_len=0, skinny_max_rows=0)
    assert policy.rope_in_attention_max_query_len == policy.skinny_max_rows == 0


def test_forward_context_carries_the_policy() -> None:
    """Outside any scope the defaults; `use_kernel_policy` and `forward_context(meta, policy)`
    set it for their block and restore the previous one after, also on an error; a forward
    context without a policy keeps the active one."""
    assert current_kernel_policy() == KernelPolicy()
    empty = torch.zeros(0, dtype=torch.int64)
    meta = AttentionMetadata(empty, empty, empty, empty.view(0, 1), 1, 1, 16)
    torch_only, no_pdl = KernelPolicy(backend="torch"), KernelPolicy(pdl=False)
    with use_kernel_policy(torch_only):
        assert current_kernel_policy() is torch_only
        with forward_context(meta):
            assert current_kernel_policy() is torch_only
        with forward_context(meta, no_pdl):
            assert current_kernel_policy() is no_pdl
        assert current_kernel_policy() is torch_only
        with pytest.raises(RuntimeError, match="boom"), use_kernel_policy(no_pdl):
            raise RuntimeError("boom")
        assert current_kernel_policy() is torch_only
    assert current_kernel_policy() == KernelPolicy()
    with pytest.raises(TypeError, match="KernelPolicy"), use_kernel_policy({"pdl": False}):
        pass


def test_env_entry_point_read_into_the_config(monkeypatch) -> None:
    """BLOCKDRAFT_KERNELS sets the default policy's backend when a config is made (unset:
    auto); an explicit policy is taken as given; a bad value names the variable."""
    monkeypatch.delenv(KERNELS_ENV_VAR, raising=False)
    assert EngineConfig(device="cpu").kernel_policy == KernelPolicy()
    monkeypatch.setenv(KERNELS_ENV_VAR, " Torch ")
    config = EngineConfig(device="cpu")
    assert config.kernel_policy == KernelPolicy(backend="torch")
    monkeypatch.setenv(KERNELS_ENV_VAR, "triton")  # read once: a made config keeps its policy
    assert config.kernel_policy.backend == "torch"
    explicit = KernelPolicy(pdl_max_query_len=16)
    assert EngineConfig(device="cpu", kernel_policy=explicit).kernel_policy is explicit
    monkeypatch.setenv(KERNELS_ENV_VAR, "cuda")
    with pytest.raises(ValueError, match=KERNELS_ENV_VAR):
        EngineConfig(device="cpu")
    monkeypatch.delenv(KERNELS_ENV_VAR)
    with pytest.raises(ValueError, match="kernel_policy"):
        EngineConfig(device="cpu", kernel_policy={"backend": "torch"})


def test_engine_steps_under_its_policy(tmp_path, monkeypatch) -> None:
    """The engine's forwards and sampling see its config's policy, not the ambient one."""
    from blockdraft import LLM, SamplingParams
    from blockdraft.layers import sampler

    from checkpoints import make_qwen3_checkpoint

    target = make_qwen3_checkpoint(tmp_path / "target", num_layers=1)

    seen: list[KernelPolicy] = []
    sample = sampler.sample

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        seen.append(current_kernel_policy())
        return sample(*args, **kwargs)

    monkeypatch.setattr("blockdraft.engine.model_runner.sample", spy)
    policy = KernelPolicy(backend="torch", pdl=False)
    llm = LLM(str(target), device="cpu", kernel_policy=policy, max_model_len=64)
    llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert seen and all(p is policy for p in seen)
    assert current_kernel_policy() == KernelPolicy()
