"""Shared benchmark tools (benchmarks/common.py) that do not need a GPU to be checked."""

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from benchmarks.common import TritonCompileLog


def test_triton_compile_log_records_kernels_only_inside_timed_phases() -> None:
    knobs = pytest.importorskip("triton.knobs")
    before = knobs.runtime.jit_post_compile_hook
    log = TritonCompileLog()
    try:
        assert log.installed and knobs.runtime.jit_post_compile_hook == log._hook
        kernel = SimpleNamespace(name="_paged_attention_kernel")
        log._hook(key=1, fn=kernel, repr="untimed")  # a warm-up compile: not a stall
        with log.timed("c. SD conc 4"):
            log._hook(key=2, fn=kernel)
            log._hook(key=3, fn=SimpleNamespace(name="_rms_norm_kernel"))
        log._hook(key=4, fn=kernel)
        assert log.by_phase() == {"c. SD conc 4": ["_paged_attention_kernel", "_rms_norm_kernel"]}
        with pytest.raises(RuntimeError), log.timed("b. AR step 1"):
            raise RuntimeError  # the phase ends with the block, even on an error
        assert log.phase is None
    finally:
        knobs.runtime.jit_post_compile_hook = before


def test_host_ops_counts_eager_ops_outside_the_graphed_forwards(capsys) -> None:
    from benchmarks import host_ops

    results = host_ops.main(
        ["--steps", "3", "--num-drafts", "3", "--time", "--time-steps", "5", "--passes", "1"]
    )
    rows = results["rows"]
    ops = {(r["engine"], r["temperature"]): r for r in rows}
    assert 0 < ops["AR", 0.0]["ops_per_step"] < ops["DFlash", 0.0]["ops_per_step"]
    # Sampling at T = 1 hashes its random numbers: more ops than the greedy argmax.
    assert ops["AR", 1.0]["ops_per_step"] > ops["AR", 0.0]["ops_per_step"]
    sites = {s for r in rows for s in r["by_site"]}
    assert "rejection_sampler.rejection_sample" in sites
    # The MLP only runs inside the forwards that CUDA graphs capture: never counted.
    assert not any(s.startswith("mlp.down") for s in sites)
    # --time: the host's own time a step (replays skipped) for AR, the idle engine and a
    # drafting step, T = 0 / 1
    timed = {(r["engine"], r["temperature"]): r["us_per_step"] for r in results["host_us"]}
    engines = ("AR, async decode", "DFlash N = 0, async decode", "DFlash")
    assert set(timed) == {(e, t) for e in engines for t in (0.0, 1.0)}
    assert all(0 < us < 1e6 for us in timed.values())
    from blockdraft.runtime.cuda_graph_runner import EagerGraph

    assert EagerGraph.replay is not None and "lambda" not in EagerGraph.replay.__qualname__
    out = capsys.readouterr().out
    assert "eager ops per step" in out and "host time a step" in out


def test_host_ops_on_a_hybrid_target_counts_the_state_commit(capsys) -> None:
    """`--target qwen3.5`: a drafting step of a Gated DeltaNet target also commits each
    request's states at its accepted length (a graph of its own): a site the dense target's
    step does not have."""
    from benchmarks import host_ops

    def drafting_sites(target: str) -> dict[str, float]:
        results = host_ops.main(["--steps", "3", "--num-drafts", "3", "--target", target])
        rows = results["rows"]
        return next(r["by_site"] for r in rows if r["engine"] == "DFlash" and not r["temperature"])

    assert "commit_graphs.run" in drafting_sites("qwen3.5")
    assert "commit_graphs.run" not in drafting_sites("qwen3")
    assert "tiny qwen3.5" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("temperature", ["0", "1"])
def test_small_steps_times_and_splits_the_steps(tmp_path, capsys, temperature: str) -> None:
    import json

    from benchmarks import small_steps
    from benchmarks.common import write_dummy_drafter
    from benchmarks.host_ops import TINY_QWEN3

    (tmp_path / "target.json").write_text(json.dumps(TINY_QWEN3))
    drafter = write_dummy_drafter(tmp_path / "drafter", TINY_QWEN3, with_weights=False)
    out = small_steps.main([
        "--steps", "3", "--passes", "2", "--num-drafts", "3", "--batches", "1", "2",
        "--accept", "1.0", "--prompt-len", "20", "--profile", "--device", "cpu",
        "--temperature", temperature,
        "--target-config", str(tmp_path / "target.json"), "--drafter", str(drafter),
        "--json", str(tmp_path / "out.json"),
    ])  # fmt: skip
    rows = {(r["engine"], r["batch"]): r for r in out["rows"]}
    assert set(rows) == {("AR", 1), ("AR", 2), ("DFlash", 1), ("DFlash", 2)}
    assert all(len(r["step_ms_by_pass"]) == 2 and r["step_ms"] > 0 for r in rows.values())
    assert rows["AR", 1]["tokens_per_step"] == 1.0 and rows["AR", 1]["step_cost_ratio"] == 1.0
    # Every draft accepted: N + 1 tokens a step (the request's steps all verify).
    assert rows["DFlash", 1]["tokens_per_step"] == 4.0
    prof = out["profiles"]["DFlash N=3"]
    assert any(name.startswith("llm_engine:step") for name, _ in prof["blockdraft_cumulative"])
    assert json.loads((tmp_path / "out.json").read_text())["rows"] == out["rows"]
    assert "step cost" in capsys.readouterr().out


def test_steady_batch_compares_the_engines(tmp_path, capsys) -> None:
    """A tiny target and drafter: every batch gets a median rate for AR, DFlash with the
    default draft length, DFlash at every batch and DFlash without drafts from the stop batch,
    each pass counted, and the JSON says the same."""
    import json

    from benchmarks import steady_batch

    from checkpoints import make_dflash_drafter, make_qwen3_checkpoint

    target = make_qwen3_checkpoint(tmp_path / "target")
    drafter = make_dflash_drafter(tmp_path / "drafter", target, block_size=4)
    out = steady_batch.main([
        "--batches", "1", "3", "--max-tokens", "6", "--stop-batch", "2", "--repeats", "2",
        "--model", str(target), "--draft", str(drafter), "--json", str(tmp_path / "out.json"),
        "--threads", "1",
    ])  # fmt: skip
    assert [r["batch"] for r in out["results"]] == [1, 3]
    for r in out["results"]:
        assert set(r["tok_s"]) == {"AR", "DFlash auto (default)", "DFlash", "DFlash, none from 2"}
        assert all(len(p) == 2 and min(p) > 0 for p in r["tok_s_by_pass"].values())
    assert json.loads((tmp_path / "out.json").read_text())["results"] == out["results"]
    assert "steady batch" in capsys.readouterr().out


def test_gpu_bench_ablation_rows_are_kernel_policies() -> None:
    """Each --ablate row is a valid KernelPolicy (the defaults with its fields replaced), rows
    are named once per engine, and the only other switches are async decode and T = 1."""
    import dataclasses

    from benchmarks import gpu_bench
    from blockdraft.kernels.policy import KernelPolicy

    names = [(engine, name) for engine, name, _, _ in gpu_bench.ABLATION]
    assert len(set(names)) == len(names)
    for engine, _, fields, extra in gpu_bench.ABLATION:
        assert engine in ("AR", "DFlash")
        assert set(extra.split()) <= {"async", "t1"}
        dataclasses.replace(KernelPolicy(), **fields)  # raises on an unknown or bad field


@pytest.mark.slow
def test_gpu_bench_part_d_runs_the_shipped_drafter_against_ar(monkeypatch, capsys) -> None:
    """gpu_bench's d.: the default target with its shipped drafter on the installed prompt
    sets (here one set, two prompts, on the CPU), and a clear skip when none is installed."""
    from benchmarks import gpu_bench
    from blockdraft import bench

    def only_gsm8k(name: str, limit: int | None = None) -> list[str]:
        if name != "gsm8k":
            raise ValueError(f"prompt set {name!r} needs `pip install --no-deps X`")
        return ["What is 12 + 30?", "Tom has 3 apples and buys 4 more. How many now?"][:limit]

    monkeypatch.setattr(bench, "load_prompt_set", only_gsm8k)
    rows = gpu_bench.shipped_drafter_bench(2, 8, device="cpu", repeats=1)
    assert [(r["set"], r["temperature"], r["num_prompts"]) for r in rows] == [("gsm8k", 0.0, 2)]
    assert rows[0]["mean_acceptance_length"] >= 1.0
    assert rows[0]["ar_tok_s"] > 0 and rows[0]["dflash_tok_s"] > 0
    assert "d. SmolLM2-135M-Instruct" in capsys.readouterr().out

    def none_installed(name: str, limit: int | None = None) -> list[str]:
        raise ValueError(f"prompt set {name!r} needs `pip install --no-deps X`")

    monkeypatch.setattr(bench, "load_prompt_set", none_installed)
    assert gpu_bench.shipped_drafter_bench(2, 8, device="cpu", repeats=1) is None
    assert "d. skipped: no prompt set installed" in capsys.readouterr().out


def test_step_timeline_summary_counts_busy_time_and_idle_gaps(rng) -> None:
    from benchmarks.step_timeline import summarize

    # Four steps of 100 µs: a 60 µs GEMM, a random idle gap, a 10 µs kernel overlapping the
    # GEMM's last 5 µs (PDL), then a copy; the middle two steps are summarised.
    gaps = (torch.rand(4, generator=rng) * 20).tolist()
    events = []
    for step, gap in enumerate(gaps):
        t = step * 100.0
        events += [
            {"name": "_skinny_matmul_kernel", "ts": t, "dur": 60.0},
            {"name": "_paged_attention_kernel", "ts": t + 55.0, "dur": 10.0},
            {"name": "Memcpy DtoH", "ts": t + 65.0 + gap, "dur": 2.0},
        ]
    events.append({"name": "end", "ts": 400.0, "dur": 0.0})
    # The host's calls: one spans the idle time before step 2's GEMM, one lies elsewhere.
    host = [
        {"name": "early", "ts": 1.0, "dur": 20.0},
        {"name": "schedule", "ts": 167.0 + gaps[1], "dur": 33.0 - gaps[1]},
    ]
    summary, lines = summarize(events, 4, host)
    assert summary["span_ms"] == pytest.approx(0.1)
    assert summary["events_per_step"] == 3
    assert summary["busy_ms"] * 2e3 == pytest.approx(2 * 67.0)
    # Idle inside the window: the gap before each copy and the one from step 1's copy to step
    # 2's GEMM (the overlap of the GEMM and the attention kernel is no gap).
    idle = gaps[1] + (100 - 67 - gaps[1]) + gaps[2]
    assert summary["gaps_ms"] * 2e3 == pytest.approx(idle)
    assert summary["kernels"]["_skinny_matmul_kernel"] == {"per_step": 1.0, "ms": 0.06}
    assert len(lines) == 6
    before_gemm = [calls for _, name, calls in summary["host_in_gaps"] if name.startswith("_sk")]
    assert before_gemm == [[f"{33.0 - gaps[1]:.0f} us schedule"]]


def test_compile_stalls_needs_a_gpu(monkeypatch) -> None:
    from benchmarks import compile_stalls

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("sys.argv", ["compile_stalls.py"])
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        compile_stalls.main()


def test_decode_breakdown_variants_leave_out_what_they_name(rng, set_policy) -> None:
    """Each variant's attention block is the o projection of what it keeps: the rotated queries
    (keys and values still stored), attention over the cache on the raw queries, or the raw
    queries; "full" is the layer's own forward."""
    from benchmarks import decode_breakdown
    from blockdraft.engine.kv_cache import allocate_kv_cache
    from blockdraft.kernels.forward_context import forward_context
    from blockdraft.layers.rotary import RotaryEmbedding
    from blockdraft.layers.self_attention import SelfAttention
    from blockdraft.runtime.host_batch import build_attention_metadata

    set_policy(backend="torch")
    rotary = RotaryEmbedding(8, 64, 10000.0, None)
    layer = SelfAttention(32, 4, 2, 8, rotary, qk_norm_eps=1e-6).requires_grad_(False)
    for p in layer.parameters():
        p.copy_(torch.randn(p.shape, generator=rng) * 0.3)
    allocate_kv_cache([layer.attn], 8, 4, torch.float32, torch.device("cpu"))
    layer.attn.key_cache.normal_(generator=rng)
    layer.attn.value_cache.normal_(generator=rng)
    q, k, v = (torch.randn(2, n, generator=rng) for n in (32, 16, 16))
    positions = torch.tensor([9, 4])
    meta = build_attention_metadata([[0, 1, 2], [3, 4]], [9, 4], [1, 1], 4, torch.device("cpu"))
    o_proj = layer.o_proj.weight
    heads, kv_heads = (2, 4, 8), (2, 2, 8)

    def run(variant: str) -> torch.Tensor:
        with forward_context(meta):
            return decode_breakdown.attend_qkv_without(variant)(layer, q, k, v, positions)

    assert decode_breakdown.attend_qkv_without("full") is SelfAttention.attend_qkv
    torch.testing.assert_close(run("gemms-only"), q @ o_proj.T)
    with forward_context(meta):
        raw_attention = layer.attn.attend(q.view(heads)).flatten(1)
    torch.testing.assert_close(run("no-rope"), raw_attention @ o_proj.T)
    rotated, _ = layer.norm_rope(positions, q.view(heads), k.view(kv_heads))
    layer.attn.key_cache.zero_()
    torch.testing.assert_close(run("no-attention"), rotated.flatten(1) @ o_proj.T)
    assert layer.attn.key_cache.abs().sum() > 0  # the step's keys were stored
    with forward_context(meta):
        full = layer.attend_qkv(q, k, v, positions)
    torch.testing.assert_close(run("full"), full)
    with pytest.raises(ValueError, match="unknown variant"):
        decode_breakdown.attend_qkv_without("no-mlp")


def test_decode_breakdown_needs_a_gpu(monkeypatch) -> None:
    from benchmarks import decode_breakdown

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("sys.argv", ["decode_breakdown.py"])
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        decode_breakdown.main()


def test_bench_shapes_write_a_config_the_engine_parses_and_count_decode_bytes() -> None:
    """Every gpu_bench shape's target config resolves to a model family and its drafter dir is
    written; the roofline bytes exceed the LM head's alone."""
    from benchmarks.shapes import SHAPES
    from blockdraft.models.registry import resolve_architecture

    for shape in SHAPES.values():
        target, drafter = shape.dirs()
        hf = json.loads((target / "config.json").read_text())
        resolve_architecture(hf).parse_config(hf)
        assert (drafter / "config.json").exists()
        lm_head = 2 * hf["vocab_size"] * hf["hidden_size"]
        assert shape.bytes_per_token(shape.config) > lm_head


@pytest.mark.parametrize("name", ["qwen3.5-35b-a3b", "qwen3-8b"])
def test_bench_shape_with_layers_keeps_the_first_layers(name: str) -> None:
    """A shape cut to its first n layers keeps every other field, its first n layer types,
    parses as its family and reads fewer bytes a token; a count it lacks is a named error."""
    from benchmarks.shapes import SHAPES
    from blockdraft.models.registry import resolve_architecture

    shape = SHAPES[name]
    total = shape.config["num_hidden_layers"]
    n = random.randint(1, total - 1)
    cut = shape.with_layers(n)
    assert cut.name == f"{name}-{n}l" and cut.config["num_hidden_layers"] == n
    assert shape.config["num_hidden_layers"] == total  # the shape itself is left alone
    if "layer_types" in shape.config:
        assert cut.config["layer_types"] == shape.config["layer_types"][:n]
    assert set(cut.config) == set(shape.config)
    cut_fields = ("num_hidden_layers", "layer_types")
    assert all(v == shape.config[k] for k, v in cut.config.items() if k not in cut_fields)
    target, _ = cut.dirs()
    hf = json.loads((target / "config.json").read_text())
    resolve_architecture(hf).parse_config(hf)
    assert cut.bytes_per_token(cut.config) < shape.bytes_per_token(shape.config)
    for bad in (0, total + 1):
        with pytest.raises(ValueError, match=f"cannot keep {bad}"):
            shape.with_layers(bad)


@pytest.mark.parametrize("name", ["qwen3-8b", "qwen3-30b-a3b", "qwen3.5-35b-a3b"])
def test_bench_shapes_run_shrunk_with_dummy_weights(tmp_path, name: str) -> None:
    """A bench shape's config, shrunk, builds and generates with load_format="dummy" (random
    weights made where the model lives), with its DFlash drafter, as gpu_bench runs it."""
    from benchmarks.common import write_dummy_drafter
    from benchmarks.shapes import SHAPES
    from blockdraft import LLM, SamplingParams

    shape = SHAPES[name]
    hf = shape.shrunk().config
    whole = shape.config
    assert hf["num_hidden_layers"] == 5 and hf["hidden_size"] == 64
    assert hf.get("layer_types") == (whole["layer_types"][:5] if "layer_types" in whole else None)
    ratio = whole["num_attention_heads"] // whole["num_key_value_heads"]
    assert hf["num_attention_heads"] // hf["num_key_value_heads"] == ratio
    assert hf["architectures"] == whole["architectures"]
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(hf))
    drafter = write_dummy_drafter(
        tmp_path / "drafter", hf, num_layers=min(shape.drafter_layers, 2), with_weights=False
    )
    spec = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": 7}
    llm = LLM(str(target), load_format="dummy", speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    out = llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 12


def test_moe_step_reads_count_each_chosen_expert_once(rng) -> None:
    """The expected distinct experts of a k-row step under uniform routing agree with a
    simulation of it, and gpu_bench's table of the 30B-A3B shape reads 8 experts per layer at
    decode, ~82 at a 16-row verify (6.5x the decode's bytes); the 35B-A3B hybrid's reads ~6 GB
    at decode (3B active parameters), ~5x that at a 16-row verify."""
    from benchmarks.gpu_bench import moe_step_reads
    from benchmarks.shapes import QWEN3_CODER_30B_A3B, SHAPES, expected_distinct_experts

    trials, experts, top_k, rows = 2000, 128, 8, 16
    picks = torch.rand(trials, rows, experts, generator=rng).topk(top_k, dim=-1).indices
    hit = torch.zeros(trials, experts).scatter_(1, picks.view(trials, -1), 1.0)
    simulated = hit.sum(1).mean().item()
    assert abs(simulated - expected_distinct_experts(experts, top_k, rows)) < 0.5
    reads = moe_step_reads(QWEN3_CODER_30B_A3B, 4.26e12)
    assert [r[0] for r in reads] == [1, 8, 16]
    assert reads[0][1] == pytest.approx(8) and reads[0][3] == 1.0
    assert reads[2][1] == pytest.approx(82.4, abs=0.1)
    assert 6.0 < reads[2][3] < 7.0
    assert reads[0][2] == pytest.approx(6.08, abs=0.01)  # GB a decoded token reads
    hybrid = moe_step_reads(SHAPES["qwen3.5-35b-a3b"].config, 4.26e12)
    assert hybrid[0][1] == pytest.approx(8) and 4.5 < hybrid[2][3] < 5.5  # 35B-A3B
    assert hybrid[0][2] == pytest.approx(6.02, abs=0.01)


def test_hybrid_shape_bytes_count_the_model_weights_and_states() -> None:
    """qwen3.5-27b's decode bytes: its model's weights (less the gathered embedding) in bf16,
    to within the norms, plus each linear layer's float32 state read and written."""
    from benchmarks.shapes import SHAPES
    from blockdraft.models.qwen3_5 import Qwen3_5LM, qwen3_5_config

    shape = SHAPES["qwen3.5-27b"]
    cfg = qwen3_5_config(shape.config)
    with torch.device("meta"):
        model = Qwen3_5LM(cfg)
    params = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    state = sum(a.num_v_heads * a.k_head_dim * a.v_head_dim for a in model.linear_layers)
    expected = 2 * params + 2 * 4 * state
    assert abs(shape.bytes_per_token(shape.config) - expected) < 1e-4 * expected


def test_hybrid_moe_shape_bytes_count_the_active_weights_and_states() -> None:
    """qwen3.5-35b-a3b's decode bytes: its model's weights (less the gathered embedding and the
    routed experts a token does not choose) in bf16, to within the norms, plus each linear
    layer's float32 state read and written: about 3B active parameters."""
    from benchmarks.shapes import SHAPES
    from blockdraft.models.qwen3_5_moe import Qwen3_5MoeLM, qwen3_5_moe_config

    shape = SHAPES["qwen3.5-35b-a3b"]
    cfg = qwen3_5_moe_config(shape.config)
    with torch.device("meta"):
        model = Qwen3_5MoeLM(cfg)
    params = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    moe = cfg.moe
    unchosen = (moe.num_experts - moe.top_k) * 3 * cfg.hidden_size * moe.intermediate_size
    active = params - cfg.num_layers * unchosen
    state = sum(a.num_v_heads * a.k_head_dim * a.v_head_dim for a in model.linear_layers)
    expected = 2 * active + 2 * 4 * state
    assert abs(shape.bytes_per_token(shape.config) - expected) < 1e-4 * expected
    assert 2.5e9 < active + cfg.vocab_size * cfg.hidden_size < 3.5e9


def test_cpu_gemm_bench_times_both_products_over_a_forward(tmp_path, capsys) -> None:
    import torch

    from benchmarks import cpu_gemm_bench
    from benchmarks.common import SMOLLM2_135M

    weights = cpu_gemm_bench.forward_weights(SMOLLM2_135M)
    assert len(weights) == 4 * SMOLLM2_135M["num_hidden_layers"] + 1
    assert weights[-1].shape == (SMOLLM2_135M["vocab_size"], SMOLLM2_135M["hidden_size"])
    results = cpu_gemm_bench.main(
        ["--rows", "1", "3", "--reps", "1", "--json", str(tmp_path / "g.json")]
    )
    assert [r["rows"] for r in results] == [1, 3]
    assert all(r["f_linear_ms"] > 0 and r["weight_left_ms"] > 0 and r["linear_ms"] > 0
               for r in results)  # fmt: skip
    x, w = torch.randn(3, 8), torch.randn(5, 8)
    torch.testing.assert_close(cpu_gemm_bench.weight_left(x, w), x @ w.T)
    assert "best / ours" in capsys.readouterr().out and (tmp_path / "g.json").exists()


def test_token_map_bench_sets_the_map_against_the_whole_vocabulary(
    tmp_path, capsys, monkeypatch
) -> None:
    """The shipped drafter with its map, without it, and AR: a rate and tau per engine (tau
    from the drafting engines only), the JSON the same; a drafter without a map is refused."""
    import json
    import shutil

    import pytest

    from benchmarks import token_map_bench
    from blockdraft.assets import default_drafter_path

    # The prompt sets install from PyPI only with the bench extras: two questions stand in.
    questions = {"gsm8k": ["What is 12 times 7?"] * 2, "humaneval": ["def add(a, b):"]}
    monkeypatch.setattr(
        token_map_bench, "load_prompt_set", lambda name, n: questions.get(name, ["Hi!"])[:n]
    )
    out = token_map_bench.main([
        "--num-drafts", "2", "--max-tokens", "4", "--repeats", "1", "--threads", "1",
        "--json", str(tmp_path / "out.json"),
    ])  # fmt: skip
    rows = {r["engine"]: r for r in out["rows"]}
    assert set(rows) == {"AR", "token map", "whole vocabulary"}
    assert all(r["tok_s"] > 0 for r in rows.values()) and rows["AR"]["vs_ar"] == 1.0
    assert rows["AR"]["tau"] == 0 and 1 <= rows["token map"]["tau"] <= 3
    assert json.loads((tmp_path / "out.json").read_text())["rows"] == out["rows"]
    assert "16,384 of 49,152 tokens" in capsys.readouterr().out
    bare = tmp_path / "bare"
    shutil.copytree(default_drafter_path(), bare, ignore=shutil.ignore_patterns("token_map.pt"))
    with pytest.raises(SystemExit, match="ships no token map"):
        token_map_bench.main(["--draft", str(bare), "--repeats", "1", "--threads", "1"])


def test_never_slower_times_ar_a_never_drafting_engine_and_the_default(
    tmp_path, monkeypatch
) -> None:
    """Three engines, a prefill time and a rate each, AR the ratios' base; the JSON the same;
    a bad argument is refused by name."""
    import json

    import pytest

    from benchmarks import never_slower
    from blockdraft.spec_decode.draft_length import PROBE_BUDGET

    # The prompt sets install from PyPI only with the bench extras: a question stands in.
    monkeypatch.setattr(never_slower, "load_prompt_set", lambda name, n: ["What is 3 + 4?"][:n])
    out = never_slower.main([
        "--sets", "mtbench", "--num-prompts", "1", "--max-tokens", "4", "--repeats", "1",
        "--threads", "1", "--json", str(tmp_path / "out.json"), "--probe-budget", "0.01",
        "--fixed", "3", "--trace", str(tmp_path / "trace.json"),
    ])  # fmt: skip
    rows = {r["engine"]: r for r in out["rows"]}
    assert set(rows) == {
        "AR", "never drafting", "default", "default, probe budget 0.01", "N = 3 every step"
    }  # fmt: skip
    assert rows["N = 3 every step"]["drafting_steps"] == 1.0  # every decode step verifies
    assert rows["default, probe budget 0.01"]["probe_budget"] == 0.01
    assert rows["default"]["probe_budget"] == PROBE_BUDGET and rows["AR"]["probe_budget"] is None
    assert all(r["tok_s"] > 0 and r["prefill_ms"] > 0 for r in rows.values())
    assert rows["AR"]["vs_ar"] == 1.0 and rows["AR"]["drafting_steps"] == 0
    assert rows["never drafting"]["drafting_steps"] == 0 == rows["never drafting"]["tau"]
    assert json.loads((tmp_path / "out.json").read_text())["rows"] == out["rows"]
    # The trace: the engines that choose their N, each of their timed steps' N (the first
    # with the chooser's inputs), and the step times handed to the chooser.
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert set(trace) == {"default", "default, probe budget 0.01"}
    for steps in trace.values():
        assert steps and all(0 <= step["n"] <= 15 for step in steps)
        assert steps[0]["weighed"]["cost_ms"] and "alpha" in steps[0]["weighed"]
        assert steps[0]["weighed"]["sampled"]  # the script's default temperature is 1
        changes = [i for i in range(1, len(steps)) if steps[i]["n"] != steps[i - 1]["n"]]
        assert all(steps[i]["weighed"] is not None for i in changes)
        timed = [t for step in steps for t in step["timed"]]
        assert timed and all(t[0] == 1 and t[2] > 0 for t in timed)
    with pytest.raises(SystemExit, match="--temperature"):
        never_slower.main(["--temperature", "-1"])
    with pytest.raises(SystemExit, match="--probe-budget"):
        never_slower.main(["--probe-budget", "0"])
    with pytest.raises(SystemExit, match="--fixed"):
        never_slower.main(["--fixed", "0"])


def test_prefill_bench_times_the_triton_rule_against_its_twin(rng) -> None:
    """The rule-alone half of prefill_bench on tiny heads (the interpreter): both timed, the
    Triton outputs close to the twin's; the engine half needs a GPU."""
    from benchmarks import prefill_bench

    cfg = {"linear_num_key_heads": 1, "linear_num_value_heads": 2,
           "linear_key_head_dim": 16, "linear_value_head_dim": 16}  # fmt: skip
    lengths = torch.randint(1, 80, (3,), generator=rng).tolist()
    q, k, v, g, beta, state, cu = prefill_bench.rule_inputs(lengths, cfg, "cpu", torch.float32)
    assert q.shape == (sum(lengths), 1, 16) and v.shape == (sum(lengths), 2, 16)
    assert state.shape == (3, 2, 16, 16) and cu.tolist()[-1] == sum(lengths) and (g <= 0).all()
    rule = prefill_bench.rule_times(lengths, cfg, "cpu", torch.float32, repeats=1)
    assert rule["triton_ms"] > 0 and rule["twin_ms"] > 0
    assert rule["out_rel_err"] < 1e-4 and rule["state_rel_err"] < 1e-4, rule


def test_prefill_bench_needs_a_gpu(monkeypatch) -> None:
    from benchmarks import prefill_bench

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs an NVIDIA GPU"):
        prefill_bench.main([])


def test_decode_tok_s_waves_keep_the_concurrency(tmp_path) -> None:
    """With waves, `waves * batch` requests run at most `batch` at a time (the scheduler's cap
    is lowered for the call and restored after), and every request's tokens count."""
    from benchmarks import gpu_bench
    from benchmarks.drafter_step_bench import TINY
    from blockdraft import LLM

    (tmp_path / "config.json").write_text(json.dumps(TINY))
    llm = LLM(str(tmp_path), load_format="dummy", max_num_seqs=8)
    running: list[int] = []
    step = llm.engine.step

    def counted_step():
        running.append(llm.engine.num_running)
        return step()

    llm.engine.step = counted_step
    calls: list[int] = []
    generate = llm.generate

    def counted_generate(prompts, params, use_tqdm):
        outs = generate(prompts, params, use_tqdm=use_tqdm)
        calls.append(sum(len(o.outputs[0].token_ids) for o in outs))
        return outs

    llm.generate = counted_generate
    rate = gpu_bench.decode_tok_s(llm, [5, 6, 7], 2, 6, reps=1, waves=3)
    assert rate > 0 and calls[-1] == 3 * 2 * 6
    assert max(running) == 2 and llm.engine.scheduler.max_num_seqs == 8


def test_gdn_kernel_bench_times_each_kernel_against_its_twin(capsys) -> None:
    """The smoke run (tiny heads, the interpreter on the CPU): one row per kernel and batch
    (the chunked verify once per value block), the kernels' outputs within float32 rounding
    of the twins'."""
    from benchmarks import gdn_kernel_bench

    gdn_kernel_bench.main(["--tiny", "--batches", "1", "2", "--rows", "4", "--accepted", "2",
                           "--chunked-block-v", "16", "--chunked-warps", "4",
                           "--decode-v-splits", "1", "2", "--reps", "1"])  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines if line.split()[:1] in (["1"], ["2"])]
    # Tiny heads hold one block of value dims: a split over 2 programs is left out.
    kernels = ["decode", "decode, heads split over 1", "verify 4 rows",
               "verify 4 rows, chunked, 16", "commit 2 rows"]  # fmt: skip
    assert [r[0] for r in rows] == [b for b in "12" for _ in kernels]
    assert all(" ".join(r[1:]).startswith(k) for r, k in zip(rows, kernels * 2, strict=True))
    assert all(float(r[-1]) < 1e-4 for r in rows), rows
    with pytest.raises(SystemExit):
        gdn_kernel_bench.main(["--tiny", "--rows", "4", "--accepted", "5"])


def test_kernel_resources_compiles_kernels_for_a_gpu_without_one() -> None:
    """The Gated DeltaNet, DFlash2 and chunked-prefill kernels compile for sm_90 on this
    CPU-only machine (a compile error that the interpreter never sees fails here), each case
    with its registers, spills, shared memory and machine-code digest. Its own process: Triton
    compiles only where the interpreter is off."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.kernel_resources", "--tiny", "--rows", "4"],
        capture_output=True, text=True, env=env, cwd=Path(__file__).parents[2], timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    rows = [line.split() for line in lines[:-1] if "_kernel" in line]
    kernels = [next(w for w in r if w.endswith("_kernel")) for r in rows]
    assert kernels[:7] == [
        "_gated_deltanet_decode_kernel",
        "_gated_deltanet_verify_kernel",
        *["_gated_deltanet_verify_chunk_kernel"] * 4,
        "_gated_deltanet_commit_kernel",
    ], out.stdout
    dflash2 = ["_skinny_matmul_kernel", "_dynamic_conv_kernel", "_projected_conv_kernel",
               "_conv_rms_norm_kernel", "_group_max_kernel", "_top_k_groups_kernel",
               "_candidate_table_kernel", "_candidate_path_kernel"]  # fmt: skip
    assert kernels[7:15] == dflash2, out.stdout
    prefill = ["_chunk_prepare_kernel", "_chunk_state_kernel", "_chunk_output_kernel"]
    assert kernels[15:27] == prefill * 4, out.stdout
    assert kernels[27:] == ["_gated_delta_rule_recurrent_kernel"] * 3, out.stdout
    # One compile of each prefill kernel for batches of 1, 15, 16 and 33 sequences, and of the
    # mixed step's recurrence for 1, 5 and 16 rows: a new number of sequences or width
    # compiles nothing in the middle of serving.
    compiles = dict(
        entry.rsplit(" ", 1)
        for entry in out.stdout.splitlines()[-1].removeprefix("compiles: ").split(", ")
    )
    assert all(compiles[k] == "1" for k in [*prefill, "_gated_delta_rule_recurrent_kernel"])
    assert compiles["_gated_deltanet_verify_chunk_kernel"] == "4", compiles
    for r in rows:
        registers, stack, shared = map(int, r[-4:-1])
        assert 0 < registers <= 255 and stack >= 0 and shared >= 0, r
    digests = [r[-1] for r in rows]
    assert all(len(d) == 10 for d in digests), digests
    assert len(set(digests[2:6])) == 4, digests  # each chunked variant its own machine code


def test_conc_probe_sorts_a_pass_into_admission_steady_tail_and_host(tmp_path, monkeypatch) -> None:
    """A pass's steps each fall in one kind (admission while requests wait, steps of N drafts
    with the whole batch or after some finished) and the kinds with the host's share add up to
    the pass's time."""
    from benchmarks import conc_probe
    from benchmarks.common import write_dummy_drafter
    from benchmarks.gpu_bench import dflash_llm
    from benchmarks.host_ops import TINY_QWEN3
    from blockdraft import SamplingParams

    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(TINY_QWEN3))
    drafter = write_dummy_drafter(tmp_path / "drafter", TINY_QWEN3, with_weights=False)
    kw = dict(load_format="dummy", device="cpu", max_num_seqs=4, max_num_batched_tokens=16)
    llm = dflash_llm(target, drafter, 3, None, 0.5, kw)  # every request drafts 3
    prompts = [torch.randint(5, 100, (12,)).tolist() for _ in range(4)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (24, 24, 24, 8)]
    elapsed, records = conc_probe.timed_pass(llm, prompts, params)
    assert records[0].admitting and records[0].running == 0
    assert records[-1].running < 4  # a tail: the short request, admitted last, finished first
    steady = [r for r in records if not r.admitting]
    assert steady and {r.num_drafts for r in steady} == {3}
    rows = {row[0]: row[1:] for row in conc_probe.breakdown(elapsed, records, 4)}
    assert {"admit", "N = 3, full", "host"} <= set(rows) <= {*rows, "N = 3, tail"}
    assert sum(count for count, *_ in rows.values()) == len(records) + 1
    assert sum(share for _, _, share, _ in rows.values()) == pytest.approx(100.0)
    assert rows["host"][1] >= 0
    assert all(r.chooser is None for r in records)  # a fixed N weighs nothing
    llm.shutdown()
    auto = dflash_llm(target, drafter, 3, "auto", 0.5, kw)
    clock_reads = []

    def now() -> float:  # benchmarks.common.now syncs the device: only at the pass's ends
        clock_reads.append(1)
        return time.perf_counter()

    monkeypatch.setattr(conc_probe, "now", now)
    elapsed, records = conc_probe.timed_pass(auto, prompts[:3], params[1:])
    assert len(clock_reads) == 2 and len(records) > 2
    # The step times handed to the chooser (each from the end of the step before) lie within
    # the pass, one after another.
    handed = [ms for r in records for _, _, ms, _ in r.timed]
    assert handed and min(handed) > 0 and sum(handed) <= elapsed * 1e3
    assert "record_if_uniform" not in vars(auto.engine.draft_length)  # unwrapped after
    weighed = [r.chooser for r in records if r.running]
    assert weighed and all(w is not None and 0 <= w["alpha"] <= 1 for w in weighed)
    assert all(set(w["cost_ms"]) == {0, 1, 2, 3} and w["cost_ms"][0] > 0 for w in weighed)
    assert all(set(w["tokens_per_s"]) == set(w["cost_ms"]) for w in weighed)
    auto.shutdown()


def test_sync_points_names_the_innermost_blockdraft_frame(monkeypatch) -> None:
    """A synchronising call is charged to the innermost blockdraft frame (not torch's), with
    the outermost blockdraft method it ran under; the tool refuses to run without a GPU."""
    from traceback import FrameSummary

    from benchmarks import sync_points

    pkg = sync_points.PACKAGE
    stack = [
        FrameSummary("/usr/lib/python3/runpy.py", 88, "_run_code"),
        FrameSummary(f"{pkg}engine/llm_engine.py", 176, "step"),
        FrameSummary(f"{pkg}kernels/forward_context.py", 150, "tensor"),
        FrameSummary("/site-packages/torch/_tensor.py", 10, "__torch_function__"),
    ]
    assert sync_points.call_site(stack) == ("kernels/forward_context.py:150 tensor (under step)")
    assert sync_points.call_site(stack[1:2]) == "engine/llm_engine.py:176 step"
    assert sync_points.call_site(stack[:1]) == "outside blockdraft"
    labels = [label for label, _ in sync_points.engines(0.8)]
    assert labels == ["AR decode", "DFlash, N = 7", "DFlash, N = 0"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        sync_points.main([])


def test_chooser_sim_serves_each_scenario_at_each_probe_budget(capsys) -> None:
    """Every scenario at every budget asked for, a rate against plain decoding and a share of
    drafting steps; a good drafter beats plain decoding and drafts that never land cost little
    and draft little; bad arguments are refused by name."""
    from benchmarks import chooser_sim

    rows = chooser_sim.main(["--seeds", "2", "--requests", "2", "--tokens", "64",
                             "--probe-budgets", "0.02", "0.01", "--fixed", "15"])  # fmt: skip
    assert {(r["scenario"], r["engine"], r["probe_budget"]) for r in rows} == {
        (s, e, b)
        for s in chooser_sim.SCENARIOS
        for e, b in (("default", 0.02), ("default", 0.01), ("N = 15", None))
    }
    by = {(r["scenario"], r["engine"], r["probe_budget"]): r for r in rows}
    good = by["T = 0, a good drafter: alpha 0.7", "default", 0.01]
    never = by["drafts never land: alpha 0", "default", 0.01]
    assert good["vs_plain"] > 1.1 and good["drafting_steps"] > 0.4
    assert 0.8 < never["vs_plain"] < 1.0 and never["drafting_steps"] < 0.1
    # N = 15 every step: drafts on every step, and where nothing lands pays ~2x for each token.
    fixed_never = by["drafts never land: alpha 0", "N = 15", None]
    assert fixed_never["drafting_steps"] == 1.0 and fixed_never["vs_plain"] < 0.6
    assert "vs plain decoding" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--seeds"):
        chooser_sim.main(["--seeds", "0"])
    with pytest.raises(SystemExit, match="--fixed"):
        chooser_sim.main(["--fixed", "5"])
    with pytest.raises(SystemExit, match="--slow-phases"):
        chooser_sim.main(["--slow-phases", "1.5"])


def test_chooser_sim_slow_phases_slow_plain_decoding_alike() -> None:
    """With every step in a slow phase, a fixed-N engine's rate against plain decoding is the
    calm one (plain decoding runs through the same phases); with some slow phases the default
    still beats plain decoding with a good drafter."""
    from benchmarks import chooser_sim

    args = ["--seeds", "2", "--requests", "2", "--tokens", "64", "--fixed", "3"]
    calm = chooser_sim.main(args)
    slow = chooser_sim.main([*args, "--slow-phases", "1"])
    some = chooser_sim.main([*args, "--slow-phases", "0.5"])
    key = ("T = 0, a good drafter: alpha 0.7", "N = 3")
    rate = {
        name: next(r["vs_plain"] for r in rows if (r["scenario"], r["engine"]) == key)
        for name, rows in (("calm", calm), ("slow", slow))
    }
    assert rate["slow"] == pytest.approx(rate["calm"], rel=0.05)
    assert rate["calm"] > 1.1
    good = next(r for r in some if (r["scenario"], r["engine"]) == (key[0], "default"))
    assert good["vs_plain"] > 1.1


def test_chooser_sim_device_bound_shape_prices_drafting_near_a_decode_step() -> None:
    """On the device-bound shape a drafting step costs ~1.17 plain ones, so N = 15 at alpha 0.8
    runs near E(0.8, 15) / 1.17 = 4.2x plain decoding (host-bound: / ~2.1) and drafts that never
    land cost N = 15 ~15%; an unknown shape is refused by name."""
    from benchmarks import chooser_sim

    args = ["--seeds", "2", "--requests", "1", "--tokens", "256", "--fixed", "15"]
    rate = {
        shape: {
            r["scenario"]: r["vs_plain"]
            for r in chooser_sim.main([*args, "--shape", shape])
            if r["engine"] == "N = 15"
        }
        for shape in ("device-bound", "host-bound")
    }
    expected = (1 - 0.8**16) / 0.2
    good = "the published DFlash2 acceptance: alpha 0.8"
    assert rate["device-bound"][good] == pytest.approx(expected / 1.1745, rel=0.15)
    assert rate["host-bound"][good] == pytest.approx(expected / 2.15, rel=0.15)
    never = rate["device-bound"]["drafts never land: alpha 0"]
    assert never == pytest.approx(1 / 1.1745, rel=0.05)
    with pytest.raises(SystemExit):
        chooser_sim.main(["--shape", "tpu"])


def test_chooser_replay_hands_the_cuda_chooser_model_step_times(monkeypatch, capsys) -> None:
    """The CPU engine runs with the CUDA chooser (N from 0, 3, 7, 15), fed the simulation's step
    times: every step is counted at a CUDA N, the model time is in simulated decode steps (a
    pass of only plain steps runs at 1x plain decoding); bad arguments are refused by name."""
    from benchmarks import chooser_replay

    # The prompt sets install from PyPI only with the bench extras: a question stands in.
    monkeypatch.setattr(chooser_replay, "load_prompt_set", lambda name, n: ["What is 3 + 4?"][:n])
    rows = chooser_replay.main(["--sets", "gsm8k", "--num-prompts", "1", "--max-tokens", "24",
                                "--temperature", "0", "--passes", "2"])  # fmt: skip
    assert [r["pass"] for r in rows] == [0, 1]
    for r in rows:
        assert set(r["steps_by_n"]) <= {0, 3, 7, 15}
        steps = sum(r["steps_by_n"].values())
        assert 1 <= steps <= 24
        assert r["drafting_steps"] == pytest.approx(1 - r["steps_by_n"].get(0, 0) / steps)
        # Plain steps cost 1-1.3 model units, drafting ~2: the rate is a plausible multiple.
        assert 0.3 < r["vs_plain"] < 8
        assert r["tau"] == 0 or r["drafting_steps"] > 0  # verifies only follow drafting steps
    # The first steps of a fresh engine calibrate plain decoding (N = 0).
    assert rows[0]["steps_by_n"].get(0, 0) >= 3
    assert "steps by N" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--passes"):
        chooser_replay.main(["--passes", "0"])
    with pytest.raises(SystemExit, match="--temperature"):
        chooser_replay.main(["--temperature", "-1"])


def test_moe_shared_bench_times_the_shared_expert_three_ways(tmp_path, capsys, monkeypatch):
    """The CPU smoke run (a shrunk 35B-A3B cut): a row per batch and way, the last engine's
    layers stacked or not as the way says, and the stacking switch put back afterwards."""
    from benchmarks import moe_shared_bench
    from blockdraft.layers.moe import SparseMoE

    fuse = SparseMoE.fuse_projections
    stacked = []
    build = moe_shared_bench.build

    def spy(target, mode, max_seqs):
        llm = build(target, mode, max_seqs)
        layers = llm.engine.model.model.layers
        stacked.append((mode, all(layer.mlp._stacked is not None for layer in layers)))
        return llm

    monkeypatch.setattr(moe_shared_bench, "build", spy)
    out = tmp_path / "moe.json"
    argv = ["--tiny", "--layers", "4", "--batches", "1", "2", "--rounds", "1", "--steps", "2"]
    results = moe_shared_bench.main([*argv, "--json", str(out)])
    assert SparseMoE.fuse_projections is fuse
    assert stacked == [("slot", True), ("apart", True), ("before stacking", False)]
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    rows = [r for r in rows if r[:1] in (["1"], ["2"])]
    assert [(r[0], " ".join(r[1:-2])) for r in rows] == [
        (b, m) for b in "12" for m in moe_shared_bench.MODES
    ]
    assert json.loads(out.read_text())["step_ms"].keys() == results["step_ms"].keys()
    assert all(ms > 0 for v in results["step_ms"].values() for ms in v)


def test_profile_shape_runs_ar_and_dflash_steps_shrunk() -> None:
    """`profile_shape --tiny --dflash N` (the CPU smoke run of the GPU profile) times AR steps
    and then DFlash steps of N drafts on a hybrid shape at CPU widths, each batch its rows."""
    from benchmarks import profile_shape

    argv = ["--shape", "qwen3.5-27b", "--tiny", "--batches", "1", "2", "--steps", "2",
            "--prompt-len", "12", "--dflash", "3"]  # fmt: skip
    rows = profile_shape.main(argv)
    walls = {label: ms for label, what, ms in rows if what == "step wall"}
    assert list(walls) == ["AR batch 1", "AR batch 2", "N=3 batch 1", "N=3 batch 2"]
    assert all(ms > 0 for ms in walls.values())
