"""The fused linear + weighted cross-entropy (drafter training loss) against its torch twin.

Runs on the CPU through Triton's interpreter (TRITON_INTERPRET=1, set before triton is
imported); with TRITON_INTERPRET=0 on a CUDA machine the same tests run the compiled kernel.
The twin is differentiated by autograd through F.cross_entropy; the fused path computes its
gradient in the kernel. Fresh random inputs per run (the `rng` fixture prints its seed).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402
import dataclasses  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

pytest.importorskip("triton")

from blockdraft.kernels import triton_cross_entropy as tce  # noqa: E402
from blockdraft.kernels.cross_entropy import linear_cross_entropy_torch  # noqa: E402
from blockdraft.kernels.triton_env import triton_interpreting  # noqa: E402
from blockdraft.models.dflash_drafter import DFlashDrafter  # noqa: E402
from blockdraft.train import drafter as drafter_mod  # noqa: E402
from blockdraft.train.cli import add_train_draft_parser  # noqa: E402
from blockdraft.train.trainer import TrainConfig  # noqa: E402

INTERPRETED = triton_interpreting()
if not INTERPRETED and not torch.cuda.is_available():
    pytest.skip("compiled Triton needs a CUDA device", allow_module_level=True)
DEVICE = torch.device("cpu" if INTERPRETED else "cuda")

# Tolerances on the hidden gradient, relative to its largest entry: the kernel rounds
# w * (softmax - onehot) to the logits dtype before the grad matmul, the twin rounds the same
# values times the upstream scale, so the 16-bit tolerances allow a couple of ulps.
GRAD_RTOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def make_case(
    rng: torch.Generator, rows: int, vocab: int, hidden: int, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """hidden [R, H], weight [V, H], labels [R] (both vocabulary ends present), weights [R]
    (some zero, not the first)."""
    h = (torch.randn(rows, hidden, generator=rng) * 2).to(DEVICE, dtype)
    w = (torch.randn(vocab, hidden, generator=rng) / hidden**0.5).to(DEVICE, dtype)
    labels = torch.randint(0, vocab, (rows,), generator=rng)
    labels[0] = vocab - 1
    if rows > 1:
        labels[1] = 0
    if rows > 3:  # a row whose label is its argmax, so `correct` has true entries
        labels[3] = int((h[3].float().cpu() @ w.float().cpu().T).argmax())
    weights = torch.rand(rows, generator=rng)
    weights[torch.rand(rows, generator=rng) < 0.25] = 0.0
    weights[0] = 1.0  # some gradient to compare against
    return h, w, labels.to(DEVICE), weights.to(DEVICE)


def run(fn, h, w, labels, weights, scale: float = 0.37, **kwargs):
    """(loss_sum, correct, grad of hidden under loss_sum * scale) of one path."""
    x = h.detach().clone().requires_grad_(True)
    loss, correct = fn(x, w, labels, weights, **kwargs)
    (loss * scale).backward()
    return loss.detach(), correct, x.grad


def assert_correct_equal(correct, ref, h, w) -> None:
    """`correct` as the twin's, except on rows whose top two logits are within rounding."""
    top2 = (h.float() @ w.float().T).topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 1e-3 * top2[:, 0].abs().clamp(min=1)
    assert correct.dtype == torch.bool and correct.shape == ref.shape
    assert torch.equal(correct[clear], ref[clear])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("rows", "vocab", "hidden", "chunk", "block_v", "dtype"),
    [
        (1, 37, 8, 8192, None, torch.float32),
        (5, 37, 16, 2, 16, torch.float32),
        (70, 1000, 24, 16, 256, torch.float32),
        (33, 4099, 32, 8192, 1024, torch.float32),
        (41, 1000, 24, 16, 128, torch.float16),
        (29, 4099, 16, 8, 2048, torch.bfloat16),
    ],
)
def test_matches_twin(rng, rows, vocab, hidden, chunk, block_v, dtype) -> None:
    h, w, labels, weights = make_case(rng, rows, vocab, hidden, dtype)
    loss, correct, grad = run(
        tce.triton_linear_cross_entropy, h, w, labels, weights, chunk_rows=chunk, block_v=block_v
    )
    ref_loss, ref_correct, ref_grad = run(
        linear_cross_entropy_torch, h, w, labels, weights, chunk_rows=chunk
    )
    assert loss.dtype == torch.float32 and loss.shape == ()
    assert torch.allclose(loss, ref_loss, rtol=1e-5, atol=1e-5)
    assert_correct_equal(correct, ref_correct, h, w)
    assert grad.dtype == dtype and grad.shape == h.shape
    err = (grad.float() - ref_grad.float()).abs().max() / ref_grad.float().abs().max()
    assert err < GRAD_RTOL[dtype], err
    assert not grad[weights == 0].any()  # zero-weight rows get no gradient


def test_poisoned_buffers(rng, monkeypatch) -> None:
    """Every output and work buffer starts as garbage: the kernel and matmuls write them all."""

    def poisoned(shape, dtype, device):
        t = torch.empty(shape, dtype=dtype, device=device)
        if dtype.is_floating_point:
            return t.fill_(float("nan"))
        return t.view(torch.uint8).fill_(0x55).view(dtype) if dtype == torch.bool else t.fill_(85)

    h, w, labels, weights = make_case(rng, 23, 1000, 16, torch.float32)
    ref = run(linear_cross_entropy_torch, h, w, labels, weights, chunk_rows=7)
    monkeypatch.setattr(tce, "_empty", poisoned)
    out = run(tce.triton_linear_cross_entropy, h, w, labels, weights, chunk_rows=7, block_v=256)
    assert torch.allclose(out[0], ref[0], rtol=1e-5)
    assert_correct_equal(out[1], ref[1], h, w)
    assert torch.allclose(out[2], ref[2], atol=1e-5 * ref[2].abs().max())


def test_chunked_equals_unchunked(rng) -> None:
    h, w, labels, weights = make_case(rng, 70, 1000, 24, torch.float32)
    one = run(tce.triton_linear_cross_entropy, h, w, labels, weights, chunk_rows=1000)
    many = run(tce.triton_linear_cross_entropy, h, w, labels, weights, chunk_rows=9)
    assert torch.allclose(one[0], many[0], rtol=1e-6)
    assert torch.equal(one[1], many[1])
    assert torch.allclose(one[2], many[2], atol=1e-6 * one[2].abs().max())


def test_ignored_labels_and_no_grad(rng) -> None:
    """Labels outside the vocabulary (-100) count nothing, as F.cross_entropy's ignore_index;
    without grad the kernel skips the gradient pass and gives the same loss."""
    h, w, labels, weights = make_case(rng, 12, 37, 8, torch.float32)
    labels[5] = -100
    loss, correct, grad = run(tce.triton_linear_cross_entropy, h, w, labels, weights)
    keep = labels != -100
    ref = run(linear_cross_entropy_torch, h[keep], w, labels[keep], weights[keep])
    assert torch.allclose(loss, ref[0], rtol=1e-5)
    assert not correct[5] and not grad[5].any()
    with torch.no_grad():
        loss_ng, correct_ng = tce.triton_linear_cross_entropy(h, w, labels, weights)
    assert torch.allclose(loss_ng, loss, rtol=1e-6) and torch.equal(correct_ng, correct)


def test_trainable_head_refused(rng) -> None:
    h, w, labels, weights = make_case(rng, 4, 37, 8, torch.float32)
    with pytest.raises(ValueError, match="freeze"):
        tce.triton_linear_cross_entropy(h, w.requires_grad_(True), labels, weights)


# --- selection in the trainer ----------------------------------------------------------------


@dataclasses.dataclass
class _Cfg:
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None


class FakeDrafter:
    """What block_loss reads of a drafter: its config, LM head and `compute_logits`."""

    compute_logits = DFlashDrafter.compute_logits
    tp = None  # one process
    draft_token_ids = None  # the full vocabulary

    def __init__(self, weight: torch.Tensor, **cfg: float | None) -> None:
        self.cfg = _Cfg(**cfg)
        self.lm_head = nn.Linear(weight.shape[1], weight.shape[0], bias=False).to(weight.dtype)
        self.lm_head.weight = nn.Parameter(weight, requires_grad=False)


@pytest.fixture
def fused_calls(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = tce.triton_linear_cross_entropy

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(tce, "triton_linear_cross_entropy", spy)
    return calls


def test_block_loss_picks_path(rng, fused_calls) -> None:
    h, w, labels, weights = make_case(rng, 19, 1000, 16, torch.float32)
    plain = FakeDrafter(w)
    ref = run(linear_cross_entropy_torch, h, w, labels, weights, chunk_rows=8)

    def loss_of(drafter, fused):
        return run(
            lambda x, _w, y, wt, **kw: drafter_mod.block_loss(drafter, x, y, wt, 8, fused=fused),
            h,
            w,
            labels,
            weights,
        )

    # auto (the default policy): the twin on the CPU (whatever TRITON_INTERPRET says), the
    # kernel on CUDA
    auto = loss_of(plain, None)
    assert len(fused_calls) == (0 if DEVICE.type == "cpu" else 1)
    assert torch.allclose(auto[0], ref[0], rtol=1e-5)
    # forced on: the kernel (here under the interpreter), same numbers
    fused_calls.clear()
    forced = loss_of(plain, True)
    assert fused_calls == [1]
    assert torch.allclose(forced[0], ref[0], rtol=1e-5)
    assert torch.allclose(forced[2], ref[2], atol=1e-5 * ref[2].abs().max())
    # a non-1 output multiplier or a softcap: the float32 path even when forced
    fused_calls.clear()
    for cfg in ({"output_multiplier": 0.5}, {"final_logit_softcapping": 30.0}):
        scaled = FakeDrafter(w, **cfg)
        out = loss_of(scaled, True)
        assert not fused_calls
        logits = scaled.compute_logits(h)
        expect = torch.nn.functional.cross_entropy(logits, labels, reduction="none") * weights
        assert torch.allclose(out[0], expect.sum(), rtol=1e-5)
    # off: the twin
    assert torch.allclose(loss_of(plain, False)[0], ref[0], rtol=1e-5) and not fused_calls


def test_config_and_cli_flag(tmp_path) -> None:
    sub = argparse.ArgumentParser().add_subparsers()
    add_train_draft_parser(sub)
    parser = sub.choices["train-draft"]
    base = ["--data", "d.jsonl", "--out", "o"]
    assert parser.parse_args(base).fused_loss is None
    assert parser.parse_args([*base, "--fused-loss"]).fused_loss is True
    assert parser.parse_args([*base, "--no-fused-loss"]).fused_loss is False
    assert TrainConfig(out_dir=str(tmp_path), data="d", device="cpu").fused_loss is None
    assert TrainConfig(out_dir=str(tmp_path), data="d", device="cpu", fused_loss=False)
    if not INTERPRETED:
        with pytest.raises(ValueError, match="fused_loss"):
            TrainConfig(out_dir=str(tmp_path), data="d", device="cpu", fused_loss=True)
