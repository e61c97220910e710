"""The skinny GEMM (`blockdraft.kernels.triton_linear`) against F.linear, on fresh random inputs,
with its SiLU-and-multiply and add + RMSNorm prologues.

Runs on the CPU through Triton's interpreter (TRITON_INTERPRET=1, set before triton is
imported). With TRITON_INTERPRET=0 on a CUDA machine the same tests run the compiled kernel on
the GPU. Shapes stay small: the interpreter costs about half a millisecond per program. The
16-bit cases are fp16: Triton 3.7's interpreter gets bf16 `tl.dot` wrong (garbage ~1e10), a
fault of the interpreter, not of the kernel (the broadcast path is right in bf16 there).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

pytest.importorskip("triton")

from blockdraft.kernels import select  # noqa: E402
from blockdraft.kernels.linear import skinny_linear_torch  # noqa: E402
from blockdraft.kernels.triton_linear import (  # noqa: E402
    DEFAULT_CONFIGS,
    FILL_PROGRAMS,
    SPLIT_MIN_DEPTH,
    SkinnyConfig,
    pick_config,
    skinny_linear,
)

from kernel_inputs import DEVICE, inputs, needs_triton, randn  # noqa: E402

pytestmark = needs_triton


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """F.linear in float32, rounded once to x's dtype (what fp32 accumulation gives)."""
    return F.linear(x.float(), w.float(), None if b is None else b.float()).to(x.dtype)


def check(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    expected = reference(x, w, b)
    assert got.shape == expected.shape and got.dtype == x.dtype
    assert not got.isnan().any()
    if x.dtype == torch.float32:
        # Relative to the output's scale (elementwise relative error is meaningless where the
        # sum cancels to about zero).
        tol = dict(rtol=1e-5, atol=1e-5 * max(1.0, expected.abs().max().item()))
    else:  # one rounding of the fp32 sum to 16 bits, both sides
        tol = dict(rtol=2e-3, atol=2e-3 * max(1.0, expected.float().abs().max().item()))
    torch.testing.assert_close(got, expected, **tol)


def poisoned_out(m: int, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A NaN-filled [m, n] output, a column slice of a wider NaN buffer: columns of the buffer
    outside the slice must stay NaN (no stray writes), the slice must lose every NaN."""
    buffer = torch.full((m, n + 9), float("nan"), dtype=dtype, device=DEVICE)
    return buffer, buffer[:, 3 : 3 + n]


SHAPES = [(37, 72), (200, 136), (64, 128)]  # (N, K): odd, odd, aligned


@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 16])
@pytest.mark.parametrize("n,k", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_skinny_linear_default_configs(rng, m: int, n: int, k: int, dtype: torch.dtype) -> None:
    # With a bias and a row-strided x, into a poisoned output ...
    x, w, b = inputs(rng, m, n, k, dtype, bias=True, strided=True)
    buffer, out = poisoned_out(m, n, dtype)
    got = skinny_linear(x, w, b, out=out)
    assert got.data_ptr() == out.data_ptr()
    check(got, x, w, b)
    assert buffer[:, :3].isnan().all() and buffer[:, 3 + n :].isnan().all()
    # ... and without either, into a fresh one.
    x, w, b = inputs(rng, m, n, k, dtype, bias=False, strided=False)
    check(skinny_linear(x, w), x, w, b)


CONFIGS = [
    SkinnyConfig(block_n=16, block_k=32, use_dot=False),
    SkinnyConfig(block_n=8, block_k=64, split_k=3, use_dot=False),
    SkinnyConfig(block_n=16, block_k=32, num_stages=3, use_dot=True),
    SkinnyConfig(block_n=32, block_k=16, split_k=4, use_dot=True),
]


@pytest.mark.slow
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"dot{int(c.use_dot)}-split{c.split_k}")
@pytest.mark.parametrize("m", [1, 3, 16, 19])  # 19: more than one tile of rows
def test_skinny_linear_paths(rng, cfg: SkinnyConfig, m: int) -> None:
    """Both inner products and split-K, forced, on K that does (128) and does not (136) divide
    into whole blocks, and N that is not a multiple of BLOCK_N."""
    for n, k, bias in [(37, 136, True), (50, 128, False)]:
        x, w, b = inputs(rng, m, n, k, torch.float32, bias=bias, strided=True)
        buffer, out = poisoned_out(m, n, torch.float32)
        check(skinny_linear(x, w, b, cfg, out=out), x, w, b)
        assert buffer[:, :3].isnan().all() and buffer[:, 3 + n :].isnan().all()


def test_split_k_deterministic(rng) -> None:
    x, w, b = inputs(rng, 5, 40, 200, torch.float32, bias=True, strided=False)
    cfg = SkinnyConfig(block_n=16, block_k=32, split_k=3, use_dot=True)
    first = skinny_linear(x, w, b, cfg)
    assert torch.equal(first, skinny_linear(x, w, b, cfg))


@pytest.mark.parametrize(
    "bucket,cfg",
    sorted({(key[0], cfg) for key, cfg in DEFAULT_CONFIGS.items()}),
    ids=lambda v: str(v) if isinstance(v, int) else f"{v.block_n}x{v.block_k}s{v.split_k}",
)
def test_skinny_linear_table_configs(rng, bucket: int, cfg: SkinnyConfig) -> None:
    """Every config of the default table, at its M bucket's largest row count, on K past one
    round of blocks (with a partial one)."""
    k = cfg.block_k * cfg.split_k + 24
    x, w, b = inputs(rng, bucket, 21, k, torch.float16, bias=True, strided=True)
    check(skinny_linear(x, w, b, cfg), x, w, b)


def test_pick_config() -> None:
    for key, cfg in DEFAULT_CONFIGS.items():
        assert pick_config(*key) == cfg
    cfg = pick_config(3, 37, 72)  # an untabulated shape: blocks cut down to its short K
    assert cfg.block_k <= 128 and cfg.split_k <= math.ceil(72 / cfg.block_k)
    assert pick_config(3, 4096, 4096) == DEFAULT_CONFIGS[(4, 4096, 4096)]


def test_pick_config_splits_few_rows_of_a_large_weight(rng) -> None:
    """Untabulated weights of >= 1M elements whose nearest config leaves most SMs idle are
    split along K until about FILL_PROGRAMS programs run; smaller ones, and shapes with
    programs enough, keep their nearest config's split."""
    for n, k in ((1024, 4096), (2048, 4096), (1024, 8192)):
        cfg = pick_config(16, n, k)
        programs = -(-n // cfg.block_n)
        assert FILL_PROGRAMS // 2 < programs * cfg.split_k <= FILL_PROGRAMS, (n, k, cfg)
        assert k >= max(cfg.block_k, SPLIT_MIN_DEPTH) * cfg.split_k
    x, w, b = inputs(rng, 16, 256, 4096, torch.float16, bias=True, strided=True)
    assert pick_config(16, 256, 4096).split_k == 4096 // SPLIT_MIN_DEPTH  # depth-bound
    check(skinny_linear(x, w, b), x, w, b)  # the picked split, run
    assert pick_config(16, 2048, 512).split_k == 1  # too shallow to split
    assert pick_config(1, 1024, 4096).split_k == 1  # one row: 64 programs are enough
    small = pick_config(16, 576, 576)  # SmolLM2-135M: latency-bound, no reduce launch
    assert small.split_k == 1
    wide = pick_config(16, 14336, 4096)  # rows enough
    assert wide.split_k == DEFAULT_CONFIGS[(16, 24576, 4096)].split_k == 1


def test_skinny_linear_empty_and_leading_dims(rng) -> None:
    x, w, b = inputs(rng, 0, 24, 40, torch.float32, bias=True, strided=False)
    assert skinny_linear(x, w, b).shape == (0, 24)
    x3 = randn(rng, 2, 3, 40)
    check(skinny_linear(x3, w, b).flatten(0, 1), x3.flatten(0, 1), w, b)
    with pytest.raises(ValueError):
        skinny_linear(x3, w[:, :30])


# --- backend selection and the decoder's helper -----------------------------------------------


def test_linear_backend_selection(set_policy) -> None:
    set_policy(backend="torch")
    assert select.get_linear_backend(DEVICE) is skinny_linear_torch
    set_policy(backend="triton")
    assert select.get_linear_backend(DEVICE) is skinny_linear
    set_policy(backend="auto")
    expected = skinny_linear if DEVICE.type == "cuda" else skinny_linear_torch
    assert select.get_linear_backend(DEVICE) is expected


def test_torch_twin_is_f_linear(rng) -> None:
    x, w, b = inputs(rng, 3, 20, 24, torch.float32, bias=True, strided=True)
    assert torch.equal(skinny_linear_torch(x, w, b), F.linear(x, w, b))


# --- SiLU-and-multiply fused into the down projection --------------------------------------------


def gate_up_input(rng: torch.Generator, m: int, i: int, dtype: torch.dtype) -> torch.Tensor:
    """[m, 2i] gate_up activations (gate then up), a column slice of a wider buffer (row
    stride 2i + 24) like a GEMM output written into a larger one; spread to reach silu's tails."""
    return (3 * randn(rng, m, 2 * i + 24))[:, 5 : 5 + 2 * i].to(dtype)


FUSED_CONFIGS = [
    None,  # the table's pick for the shape
    SkinnyConfig(block_n=16, block_k=32, use_dot=False),
    SkinnyConfig(block_n=8, block_k=64, split_k=3, use_dot=False),
    SkinnyConfig(block_n=16, block_k=32, use_dot=True),
    SkinnyConfig(block_n=32, block_k=16, split_k=4, use_dot=True),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "cfg",
    FUSED_CONFIGS,
    ids=lambda c: "default" if c is None else f"dot{int(c.use_dot)}-split{c.split_k}",
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_skinny_linear_silu_mul_input(rng, cfg: SkinnyConfig | None, dtype: torch.dtype) -> None:
    """The fused prologue against the torch twin, and bit for bit against the unfused path
    (the Triton activation kernel, then the same GEMM): K = I odd (37) and long (200, several
    blocks, a partial one), N odd, into a poisoned output."""
    from blockdraft.kernels.rope import silu_mul_torch
    from blockdraft.kernels.triton_activation import triton_silu_mul

    for m, i, n, bias in [(1, 37, 29, True), (2, 200, 45, False), (3, 200, 29, True)]:
        gate_up = gate_up_input(rng, m, i, dtype)
        w = (randn(rng, n, i) / math.sqrt(i)).to(dtype)
        b = randn(rng, n, dtype=dtype) if bias else None
        buffer, out = poisoned_out(m, n, dtype)
        got = skinny_linear(gate_up, w, b, cfg, out=out, silu_mul_input=True)
        assert got.data_ptr() == out.data_ptr()
        assert buffer[:, :3].isnan().all() and buffer[:, 3 + n :].isnan().all()
        gate, up = gate_up.chunk(2, dim=-1)
        twin = skinny_linear_torch(gate_up, w, b, silu_mul_input=True)
        assert torch.equal(twin, F.linear(silu_mul_torch(gate, up), w, b))
        check(got, silu_mul_torch(gate, up), w, b)  # the twin's operand, fp32 reference
        unfused = skinny_linear(triton_silu_mul(gate, up), w, b, cfg)
        assert torch.equal(got, unfused), (got - unfused).abs().max()
        # Eager F.silu computes exp and the division its own way: its fp32 activations differ
        # from the kernel's by up to ~3 eps (relative), which moves the sum by about 1-2 ulps
        # of the output's scale (measured); in fp16 both round to the same value almost always.
        eager = skinny_linear(silu_mul_torch(gate, up), w, b, cfg)
        ulps = 4 * torch.finfo(dtype).eps * eager.float().abs().max().item()
        assert (got.float() - eager.float()).abs().max().item() <= ulps


def test_skinny_linear_silu_mul_input_errors(rng) -> None:
    w = randn(rng, 8, 5)
    with pytest.raises(ValueError):  # odd gate_up width
        skinny_linear(randn(rng, 1, 11), w, silu_mul_input=True)
    with pytest.raises(ValueError):  # K = I = 6 against a weight of 5 columns
        skinny_linear(randn(rng, 1, 12), w, silu_mul_input=True)


# --- residual add + RMSNorm fused into the skinny GEMM ------------------------------------------


NORM_CASES = [  # (m, k, n, residual, bias): K odd (37) or long (200: blocks and a partial one)
    (1, 37, 29, True, True),
    (1, 200, 45, False, False),
    (2, 37, 45, False, True),
    (2, 200, 29, True, False),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "cfg",
    FUSED_CONFIGS,
    ids=lambda c: "default" if c is None else f"dot{int(c.use_dot)}-split{c.split_k}",
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("offset", [False, True], ids=["weight", "offset"])
def test_skinny_linear_rms_norm(
    rng, cfg: SkinnyConfig | None, dtype: torch.dtype, offset: bool
) -> None:
    """The fused norm prologue bit for bit against the unfused Triton pair (`triton_rms_norm`,
    then the same GEMM), its residual stream against the eager add, both into poisoned
    outputs (row-strided x and residual), and the torch twin against rms_norm_torch + F.linear;
    also in the offset form (`OffsetRMSNorm`'s: scale by 1 + weight, one rounding)."""
    from blockdraft.kernels.rmsnorm import rms_norm_torch
    from blockdraft.kernels.triton_rmsnorm import triton_rms_norm

    norm = {"offset": offset}
    for m, k, n, with_residual, bias in NORM_CASES:
        x = (3 * randn(rng, m, k + 24))[:, 5 : 5 + k].to(dtype)
        residual = randn(rng, m, k + 24)[:, 7 : 7 + k].to(dtype) if with_residual else None
        norm_w = ((0 if offset else 1) + 0.1 * randn(rng, k)).to(dtype)
        w = (randn(rng, n, k) / math.sqrt(k)).to(dtype)
        b = randn(rng, n, dtype=dtype) if bias else None
        buffer, out = poisoned_out(m, n, dtype)
        res_buffer, res_out = poisoned_out(m, k, dtype) if with_residual else (None, None)
        got = skinny_linear(
            x, w, b, cfg, out=out, rms_norm=(norm_w, 1e-6), residual=residual,
            residual_out=res_out, norm_offset=offset,
        )  # fmt: skip
        assert got.data_ptr() == out.data_ptr()
        assert buffer[:, :3].isnan().all() and buffer[:, 3 + n :].isnan().all()
        if with_residual:
            normed, stream = triton_rms_norm(x, norm_w, 1e-6, residual, **norm)
            assert torch.equal(res_out, x + residual) and torch.equal(res_out, stream)
            assert res_buffer[:, :3].isnan().all() and res_buffer[:, 3 + k :].isnan().all()
        else:
            normed = triton_rms_norm(x, norm_w, 1e-6, **norm)
        unfused = skinny_linear(normed, w, b, cfg)
        if DEVICE.type == "cuda":  # compiled, the norm's FMAs may contract differently
            torch.testing.assert_close(got, unfused, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(got, unfused), (got - unfused).abs().max()
        # The twin (torch's norm: rsqrt and its own sum order, so not bit for bit the kernel's).
        twin_stream = None if residual is None else torch.empty_like(x)
        twin = skinny_linear_torch(
            x, w, b, rms_norm=(norm_w, 1e-6), residual=residual, residual_out=twin_stream,
            norm_offset=offset,
        )  # fmt: skip
        if with_residual:
            expected_normed, expected_stream = rms_norm_torch(x, norm_w, 1e-6, residual, **norm)
            assert torch.equal(twin_stream, expected_stream)
        else:
            expected_normed = rms_norm_torch(x, norm_w, 1e-6, **norm)
        assert torch.equal(twin, F.linear(expected_normed, w, b))
        check(got, expected_normed, w, b)


def test_skinny_linear_rms_norm_errors(rng) -> None:
    x, w, norm = randn(rng, 2, 6), randn(rng, 8, 6), (randn(rng, 6), 1e-6)
    res, res_out = randn(rng, 2, 6), randn(rng, 2, 6)
    with pytest.raises(ValueError):  # not with the silu_mul prologue
        skinny_linear(randn(rng, 2, 12), w, silu_mul_input=True, rms_norm=norm)
    with pytest.raises(ValueError):  # a residual without rms_norm
        skinny_linear(x, w, residual=res, residual_out=res_out)
    with pytest.raises(ValueError):  # a residual with nowhere to write the stream
        skinny_linear(x, w, rms_norm=norm, residual=res)
    with pytest.raises(ValueError):  # the stream written over an input other programs read
        skinny_linear(x, w, rms_norm=norm, residual=res, residual_out=res)
    with pytest.raises(ValueError):  # a norm weight of the wrong width
        skinny_linear(x, w, rms_norm=(randn(rng, 5), 1e-6))
    with pytest.raises(ValueError):  # ... or dtype
        skinny_linear(x, w, rms_norm=(randn(rng, 6, dtype=torch.float16), 1e-6))
