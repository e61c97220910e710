"""Programmatic dependent launch (`blockdraft.kernels.pdl`): where the kernel policy puts it,
and that the PDL variants of the decode path's kernels compile for Hopper (sm_90) with their
wait / launch-dependents instructions, which the CPU can check: Triton compiles to a cubin here,
only the launch needs a GPU."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from blockdraft.kernels import pdl  # noqa: E402
from blockdraft.kernels.forward_context import (  # noqa: E402
    AttentionMetadata,
    forward_context,
    use_kernel_policy,
)
from blockdraft.kernels.policy import KernelPolicy  # noqa: E402


def _metadata(max_query_len: int) -> AttentionMetadata:
    empty = torch.zeros(0, dtype=torch.int64)
    return AttentionMetadata(empty, empty, empty, empty.view(0, 1), max_query_len, 64, 16)


def test_policy_decode_forwards_only(monkeypatch) -> None:
    """The default policy: PDL only inside a forward whose requests each have one query row
    (decode), on a device that has it; never on the CPU; `pdl=False` nowhere;
    `pdl_max_query_len` raises the row limit."""
    monkeypatch.setattr(pdl, "_device_has_pdl", lambda index: True)
    cuda = torch.device("cuda", 0)
    assert not pdl.pdl_enabled(cuda)  # outside a forward (the LM head, samplers)
    with forward_context(_metadata(1)):
        assert pdl.pdl_enabled(cuda) and not pdl.pdl_enabled(torch.device("cpu"))
        with use_kernel_policy(KernelPolicy(pdl=False)):
            assert not pdl.pdl_enabled(cuda)
        assert pdl.pdl_enabled(cuda)
    with forward_context(_metadata(16)):  # verify / drafter block
        assert not pdl.pdl_enabled(cuda)
    wide = KernelPolicy(pdl_max_query_len=16)
    with forward_context(_metadata(16), wide):
        assert pdl.pdl_enabled(cuda)
    with forward_context(_metadata(17), wide):  # a prefill chunk
        assert not pdl.pdl_enabled(cuda)
    with forward_context(_metadata(1), dataclasses.replace(wide, pdl=False)):
        assert not pdl.pdl_enabled(cuda)
    monkeypatch.setattr(pdl, "_device_has_pdl", lambda index: False)  # pre-Hopper / old Triton
    with forward_context(_metadata(1)):
        assert not pdl.pdl_enabled(cuda)


def test_only_on_cuda() -> None:
    with forward_context(_metadata(1)):
        assert not pdl.pdl_enabled(torch.device("cpu"))
    assert pdl.launch_options(False) == {} and pdl.launch_options(True) == {"launch_pdl": True}


# Compiles each kernel for sm_90 with PDL on and off and prints, per variant, how many
# griddepcontrol instructions its PTX has. A subprocess: the test session runs
# Triton's interpreter, whose kernels cannot be compiled.
COMPILE_SCRIPT = r"""
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from blockdraft.kernels.triton_attention import (
    _paged_attention_kernel, _paged_attention_reduce_kernel)
from blockdraft.kernels.triton_gated_deltanet_step import _gated_deltanet_decode_kernel
from blockdraft.kernels.triton_linear import _skinny_matmul_kernel
from blockdraft.kernels.triton_activation import _silu_mul_kernel
from blockdraft.kernels.triton_rmsnorm import _rms_norm_kernel
from blockdraft.kernels.triton_rope import _qk_norm_rope_kernel

F32 = ("part_out_ptr", "part_max_ptr", "part_sum_ptr", "cos_ptr", "sin_ptr", "state_ptr")
I32 = ("query_start_loc_ptr", "seq_lens_ptr", "block_tables_ptr", "counters_ptr")
I64 = ("positions_ptr", "slot_mapping_ptr", "slots_ptr")  # the attention's rope inputs too

def signature(kernel, const, out_f32):
    sig = {}
    for name in kernel.arg_names:
        if name in const:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = ("*fp32" if name in F32 or (out_f32 and name == "out_ptr") else
                         "*i32" if name in I32 else "*i64" if name in I64 else
                         "*i1" if name == "fresh_ptr" else "*bf16")
        else:
            sig[name] = "fp32" if name.endswith("eps") or name.endswith("scale") else "i32"
    return sig

def count(kernel, const, out_f32=False, **options):
    src = ASTSource(fn=kernel, signature=signature(kernel, const, out_f32), constexprs=const)
    opts = {"launch_pdl": True, **options} if const["PDL"] else options
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    ptx = c.asm["ptx"]
    return {"wait": ptx.count("griddepcontrol.wait"),
            "launch": ptx.count("griddepcontrol.launch_dependents"), "cubin": len(c.asm["cubin"]),
            "atomics": ptx.count("atom."), "local": ptx.count("st.local")}

skinny = dict(BLOCK_N=32, BLOCK_K=256, SPLIT_K=1, EVEN_K=True, HAS_BIAS=False, SILU_MUL=False,
              RMS_NORM=0, HAS_RESIDUAL=False, NORM_BLOCK=1, NUM_STAGES=3)
# A split decode-shaped attention launch; the variants below change what they name.
attention = dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_M=16, BLOCK_N=64, GROUP=4, CAUSAL=True,
                 USE_WINDOW=False, SPLIT=True, MERGE=False, MERGE_SPLITS=1, ROPE=False,
                 ONE_ROW=False, HAS_QK_NORM=False, INPUT_PRECISION="tf32")
variants = {
    "skinny dot": (_skinny_matmul_kernel, dict(skinny, BLOCK_M=16, USE_DOT=True), {}),
    "skinny dot split-k": (_skinny_matmul_kernel,
                           dict(skinny, BLOCK_M=16, USE_DOT=True, SPLIT_K=4), {"out_f32": True}),
    "skinny 1 row + norm": (_skinny_matmul_kernel,
                            dict(skinny, BLOCK_M=1, USE_DOT=False, BLOCK_K=512, RMS_NORM=1,
                                 HAS_RESIDUAL=True, NORM_BLOCK=4096), {}),
    "skinny 2 rows + offset norm (Qwen3.5)": (
        _skinny_matmul_kernel,
        dict(skinny, BLOCK_M=2, USE_DOT=False, BLOCK_K=512, RMS_NORM=2, HAS_RESIDUAL=True,
             NORM_BLOCK=8192), {}),
    "skinny 1 row": (_skinny_matmul_kernel, dict(skinny, BLOCK_M=1, USE_DOT=False), {}),
    "attention split": (_paged_attention_kernel, attention, {}),
    "attention verify + rope": (
        _paged_attention_kernel,
        dict(attention, BLOCK_M=64, BLOCK_N=32, ROPE=True, HAS_QK_NORM=True), {"num_warps": 4}),
    "attention split, decode merge + rope": (
        _paged_attention_kernel,
        dict(attention, MERGE=True, MERGE_SPLITS=16, ROPE=True, ONE_ROW=True, HAS_QK_NORM=True),
        {"num_warps": 2}),
    "attention reduce": (_paged_attention_reduce_kernel,
                         dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_S=16), {}),
    "rope + kv store": (_qk_norm_rope_kernel,
                        dict(BLOCK_H=8, BLOCK_D=64, BLOCK_P=16, HAS_Q_NORM=True, HAS_K_NORM=True,
                             NORM_OFFSET=False, PARTIAL=False, STORE_KV=True), {}),
    "rope + kv store, offset norms, partial rotary (Qwen3.5)": (
        _qk_norm_rope_kernel,
        dict(BLOCK_H=4, BLOCK_D=32, BLOCK_P=256, HAS_Q_NORM=True, HAS_K_NORM=True,
             NORM_OFFSET=True, PARTIAL=True, STORE_KV=True), {}),
    "rms norm + residual": (_rms_norm_kernel, dict(BLOCK=4096, HAS_RESIDUAL=True, OFFSET=False),
                            {}),
    "offset rms norm + residual": (_rms_norm_kernel,
                                   dict(BLOCK=8192, HAS_RESIDUAL=True, OFFSET=True), {}),
    "silu mul": (_silu_mul_kernel, dict(BLOCK=1024), {}),
    "gated deltanet decode": (_gated_deltanet_decode_kernel,
                              dict(K=4, KP=4, BK=128, BV=32, ROUND_PRODUCT=True, V_SPLITS=4), {}),
}
out = {}
for name, (kernel, const, kw) in variants.items():
    for flag in (True, False):
        out[f"{name} pdl={flag}"] = count(kernel, dict(const, PDL=flag), **kw)
print(json.dumps(out))
"""


@pytest.mark.slow
def test_pdl_kernels_compile_for_hopper() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    proc = subprocess.run(
        [sys.executable, "-c", COMPILE_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    if proc.returncode and "ptxas" in proc.stderr.lower() and "not found" in proc.stderr.lower():
        pytest.skip("this Triton has no ptxas to compile with")
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, c in counts.items():
        assert c["cubin"] > 0, name
        if name.endswith("pdl=False"):
            assert c["wait"] == c["launch"] == 0, (name, c)
        else:  # short kernels: let the next kernel launch, then wait; a GEMM after its loads
            assert c["wait"] == 1 and c["launch"] == 1, (name, c)
