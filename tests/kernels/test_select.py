"""`blockdraft.kernels.select`: the kernel policy's backend picks each kernel or its twin.

Runs on the CPU through Triton's interpreter (TRITON_INTERPRET=1, which tests/conftest.py sets
on a machine without a GPU). With TRITON_INTERPRET=0 on a CUDA machine the same tests run the
compiled kernels on the GPU. Shapes stay small: the interpreter costs about half a millisecond
per program.
"""

import pytest

from blockdraft.kernels import select
from blockdraft.kernels.candidate_walk import candidate_walk_torch
from blockdraft.kernels.dflash_inputs import prepare_dflash_inputs_torch
from blockdraft.kernels.paged_attention import paged_attention, store_kv
from blockdraft.kernels.rope import (
    qk_norm_rope_store_torch,
    qk_norm_rope_torch,
    silu_mul_torch,
)
from blockdraft.kernels.sampling import exponential_race_torch, hashed_uniform
from blockdraft.kernels.top_k import top_k_torch
from blockdraft.kernels.triton_activation import triton_silu_mul
from blockdraft.kernels.triton_attention import (
    triton_paged_attention,
)
from blockdraft.kernels.triton_candidate_walk import triton_candidate_walk
from blockdraft.kernels.triton_dflash_inputs import prepare_dflash_inputs
from blockdraft.kernels.triton_kv_store import triton_store_kv
from blockdraft.kernels.triton_rmsnorm import rms_norm_torch, triton_rms_norm
from blockdraft.kernels.triton_rope import triton_qk_norm_rope, triton_qk_norm_rope_store
from blockdraft.kernels.triton_sampling import triton_exponential_race, triton_hashed_uniform
from blockdraft.kernels.triton_top_k import triton_top_k

from kernel_inputs import (
    DEVICE,
    needs_triton,
)

pytestmark = needs_triton


def test_backend_selection(monkeypatch, set_policy) -> None:
    set_policy(backend="torch")
    assert select.get_attention_backend(DEVICE) is paged_attention
    assert select.get_store_kv_backend(DEVICE) is store_kv
    assert select.get_rms_norm_backend(DEVICE) is rms_norm_torch
    assert select.get_rope_backend(DEVICE) is qk_norm_rope_torch
    assert select.get_rope_store_backend(DEVICE) is qk_norm_rope_store_torch
    assert select.get_silu_mul_backend(DEVICE) is silu_mul_torch
    assert select.get_dflash_inputs_backend(DEVICE) is prepare_dflash_inputs_torch
    assert select.get_hashed_uniform_backend(DEVICE) is hashed_uniform
    assert select.get_exponential_race_backend(DEVICE) is exponential_race_torch
    assert select.get_candidate_walk_backend(DEVICE) is candidate_walk_torch
    assert select.get_top_k_backend(DEVICE) is top_k_torch
    set_policy(backend="triton")
    assert select.get_attention_backend(DEVICE) is triton_paged_attention
    assert select.get_store_kv_backend(DEVICE) is triton_store_kv
    assert select.get_rms_norm_backend(DEVICE) is triton_rms_norm
    assert select.get_rope_backend(DEVICE) is triton_qk_norm_rope
    assert select.get_rope_store_backend(DEVICE) is triton_qk_norm_rope_store
    assert select.get_silu_mul_backend(DEVICE) is triton_silu_mul
    assert select.get_dflash_inputs_backend(DEVICE) is prepare_dflash_inputs
    assert select.get_hashed_uniform_backend(DEVICE) is triton_hashed_uniform
    assert select.get_exponential_race_backend(DEVICE) is triton_exponential_race
    assert select.get_candidate_walk_backend(DEVICE) is triton_candidate_walk
    assert select.get_top_k_backend(DEVICE) is triton_top_k
    set_policy(backend="auto")
    expected = triton_paged_attention if DEVICE.type == "cuda" else paged_attention
    assert select.get_attention_backend(DEVICE) is expected
    with pytest.raises(ValueError, match="backend"):
        set_policy(backend="flash")
    set_policy(backend="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        select.get_attention_backend("cpu")
