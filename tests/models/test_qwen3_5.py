"""Qwen3.5 (hybrid Gated DeltaNet + gated full attention) equals transformers'
`Qwen3_5ForCausalLM` through the paged path with per-request state slots, over prefill chunks
and decode steps; the delta rule's chunked and recurrent forms agree; a verify block followed by
a commit at the accepted length leaves exactly the state plain decoding leaves."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from blockdraft import LLM, SamplingParams
from blockdraft.engine.kv_cache import allocate_kv_cache
from blockdraft.kernels import triton_gated_deltanet_step
from blockdraft.kernels.forward_context import (
    LinearStateMetadata,
    build_linear_metadata,
    forward_context,
)
from blockdraft.kernels.gated_delta_rule import (
    chunk_gated_delta_rule_torch,
    recurrent_gated_delta_rule_torch,
)
from blockdraft.kernels.policy import KernelPolicy
from blockdraft.layers import linear as linear_layer
from blockdraft.layers.gated_deltanet import GatedDeltaNet
from blockdraft.layers.linear import fuse_projections
from blockdraft.models.qwen3_5 import Qwen3_5LM, qwen3_5_config
from blockdraft.runtime.host_batch import build_attention_metadata

from checkpoints import _qwen3_5_model, load_hf_target, make_qwen3_5_checkpoint
from kernel_inputs import DEVICE, needs_triton
from spies import count_calls

CPU = torch.device("cpu")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def linear_meta(
    slots: list[int], starts: list[int], lens: list[int], verify: list[bool] | None = None
) -> LinearStateMetadata:
    return build_linear_metadata(
        torch.tensor(slots),
        torch.tensor([s == 0 for s in starts]),
        list(lens),
        verify or [False] * len(slots),
    )


def delta_inputs(rng: torch.Generator, b: int, t: int, hk: int, hv: int, d: int):
    q = torch.randn(b, t, hk, d, generator=rng)
    k = torch.randn(b, t, hk, d, generator=rng)
    v = torch.randn(b, t, hv, d, generator=rng)
    g = -torch.rand(b, t, hv, generator=rng)
    beta = torch.rand(b, t, hv, generator=rng)
    state = torch.randn(b, hv, d, d, generator=rng)
    return q, k, v, g, beta, state


def test_chunked_rule_equals_recurrence(rng) -> None:
    q, k, v, g, beta, state = delta_inputs(rng, 2, 37, 2, 4, 8)
    ref, ref_state = recurrent_gated_delta_rule_torch(q, k, v, g, beta, state)
    out, out_state = chunk_gated_delta_rule_torch(q, k, v, g, beta, state, chunk_size=16)
    assert rel_err(out, ref) < 1e-5 and rel_err(out_state, ref_state) < 1e-5


def test_recurrence_lengths_stop_each_row(rng) -> None:
    """A row of length n ends in the state of its first n tokens, bit for bit."""
    q, k, v, g, beta, state = delta_inputs(rng, 3, 6, 1, 2, 8)
    lengths = torch.tensor([6, 2, 0])
    _, states = recurrent_gated_delta_rule_torch(q, k, v, g, beta, state, lengths)
    for row, n in enumerate(lengths.tolist()):
        r = slice(row, row + 1)
        args = (q[r, :n], k[r, :n], v[r, :n], g[r, :n], beta[r, :n], state[r])
        want = recurrent_gated_delta_rule_torch(*args)[1] if n else state[r]
        assert torch.equal(states[r], want), row


@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused-projections"])
def test_forward_matches_transformers(rng, fused: bool) -> None:
    """Prefill chunks (chunked rule) and decode steps (recurrence) read and write the state
    slot and the paged cache; logits at every position equal transformers' full forward.
    Linear layers with 2 key heads serving 4 value heads; input projections separate or fused
    into one GEMM per mixer."""
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))
    hf = _qwen3_5_model(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=4, num_heads=4,
        num_kv_heads=2, head_dim=16, tie_word_embeddings=False, seed=seed,
    )  # fmt: skip
    model = Qwen3_5LM(qwen3_5_config(hf.config.to_dict())).eval().requires_grad_(False)
    model.load_state_dict(hf.state_dict())
    if fused:
        fuse_projections(model)
    block_size, slot = 4, 1
    allocate_kv_cache(model.attention_layers, 40, block_size, torch.float32, CPU)
    model.allocate_states(3, 0, torch.float32, CPU)
    for layer in model.linear_layers:  # stale contents a fresh request must not read
        layer.conv_state.normal_(generator=rng)
        layer.recurrent_state.normal_(generator=rng)
    ids = torch.randint(4, 128, (90,), generator=rng).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    table, out, start = list(range(30)), [], 0
    for n in [70, 1, 2, 1, 16]:  # 70 rows: chunks of 64 and 6 inside the chunked rule
        meta = build_attention_metadata([table], [start], [n], block_size, CPU)
        meta.linear = linear_meta([slot], [start], [n])
        with torch.inference_mode(), forward_context(meta):
            hidden, _ = model(torch.tensor(ids[start : start + n]), torch.arange(start, start + n))
        out.append(model.compute_logits(hidden))
        start += n
    assert rel_err(torch.cat(out), ref) < 1e-4


@needs_triton
def test_commit_of_every_layer_is_one_launch(rng, set_policy, monkeypatch) -> None:
    """The model's state pools are views of one tensor per pool stacking its linear layers':
    the Triton commit after a verify is one launch for every layer, bit for bit each layer's
    own commit; a layer whose pool was replaced takes the per-layer commits."""
    from blockdraft.kernels import triton_gated_deltanet_verify as kernels

    set_policy(backend="triton")
    hf = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=5, num_heads=2,
              num_kv_heads=1, head_dim=16, tie_word_embeddings=False, seed=0)  # fmt: skip
    model = Qwen3_5LM(qwen3_5_config(_qwen3_5_model(**hf).config.to_dict()))
    model.allocate_states(4, 6, torch.float32, CPU)
    layers = model.linear_layers
    assert len(layers) >= 3
    for i, layer in enumerate(layers):
        for name, pool in model._stacked_states.items():
            assert getattr(layer, name).data_ptr() == pool[i].data_ptr()
        layer.recurrent_state.normal_(generator=rng)
        layer.conv_state.normal_(generator=rng)
        layer.stash_qkv.normal_(generator=rng)
        layer.stash_mixed.normal_(generator=rng)
        layer.stash_gb.copy_(torch.rand(layer.stash_gb.shape, generator=rng) - 0.5)
    start = {name: pool.clone() for name, pool in model._stacked_states.items()}
    slots, lengths = torch.tensor([2, 0]), torch.tensor([3, 6])
    calls = count_calls(monkeypatch, kernels, "triton_gated_deltanet_commit")
    with torch.inference_mode():
        model.commit_verified(slots, lengths)
    assert len(calls) == 1
    got = {name: pool.clone() for name, pool in model._stacked_states.items()}
    assert not torch.equal(got["recurrent_state"], start["recurrent_state"])
    for name, pool in model._stacked_states.items():
        pool.copy_(start[name])
    with torch.inference_mode():
        for layer in layers:
            layer.commit_verified(slots, lengths)
    for name, pool in model._stacked_states.items():
        assert torch.equal(pool, got[name]), name
    layers[0].recurrent_state = layers[0].recurrent_state.clone()
    calls.clear()
    with torch.inference_mode():
        model.commit_verified(slots, lengths)
    assert len(calls) == len(layers)


def tiny_deltanet(rng: torch.Generator, slots: int, max_verify: int) -> GatedDeltaNet:
    layer = GatedDeltaNet(32, 2, 4, 8, 8, 4, 1e-6).requires_grad_(False)
    for p in layer.parameters():
        p.copy_(0.3 * torch.randn(p.shape, generator=rng))
    layer.allocate_states(slots, max_verify, torch.float32, CPU)
    return layer


def mix(layer: GatedDeltaNet, qkv, ba, meta: LinearStateMetadata) -> torch.Tensor:
    with torch.inference_mode():
        return layer._mix(qkv, ba, meta)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_verify_then_commit_equals_plain_decoding(rng, set_policy, backend: str) -> None:
    """A request prefills, then verifies a block of 1 + N rows in a batch with another
    request's decode row and a third one's prefill chunk: the verify leaves its slot as it
    was; the commit at k accepted drafts gives the conv and recurrent states (bit for bit) and
    the verify gave the outputs that decoding its first k + 1 rows one by one gives. With the
    Triton recurrence too (its programs never see their batch mates)."""
    set_policy(backend=backend)
    layer = tiny_deltanet(rng, slots=4, max_verify=6)
    c, hv2 = layer.conv_dim, 2 * layer.num_v_heads

    def rows(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, c, generator=rng), torch.randn(n, hv2, generator=rng)

    prompt, other = rows(9), rows(5)
    mix(layer, torch.cat([prompt[0], other[0]]), torch.cat([prompt[1], other[1]]),
        linear_meta([2, 0], [0, 0], [9, 5]))  # fmt: skip
    before = [s.clone() for s in (layer.conv_state, layer.recurrent_state)]
    block, dec, pre = rows(6), rows(1), rows(7)
    qkv = torch.cat([dec[0], block[0], pre[0]])
    ba = torch.cat([dec[1], block[1], pre[1]])
    meta = linear_meta([0, 2, 3], [5, 9, 0], [1, 6, 7], [False, True, False])
    verify_out = mix(layer, qkv, ba, meta)[1:7]
    assert torch.equal(layer.conv_state[2], before[0][2])
    assert torch.equal(layer.recurrent_state[2], before[1][2])
    accepted = int(torch.randint(0, 6, (1,), generator=rng))
    with torch.inference_mode():
        layer.commit_verified(torch.tensor([2]), torch.tensor([accepted + 1]))
    committed = [layer.conv_state[2].clone(), layer.recurrent_state[2].clone()]
    layer.conv_state[2], layer.recurrent_state[2] = before[0][2], before[1][2]
    for t in range(accepted + 1):
        out = mix(layer, block[0][t : t + 1], block[1][t : t + 1], linear_meta([2], [9 + t], [1]))
        assert torch.equal(out, verify_out[t : t + 1]), t
    assert torch.equal(committed[0], layer.conv_state[2])
    assert torch.equal(committed[1], layer.recurrent_state[2])


# --- through the engine ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def hybrid_target(tmp_path_factory) -> Path:
    return make_qwen3_5_checkpoint(tmp_path_factory.mktemp("qwen3_5"), num_layers=5)


def hf_greedy(target: Path, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """transformers' greedy generate of max_new tokens, through eos (as ignore_eos)."""
    hf = load_hf_target(target)
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        return [
            hf.generate(torch.tensor([p]), max_new_tokens=max_new, do_sample=False)[
                0, len(p) :
            ].tolist()
            for p in prompts
        ]


def run_with_arrivals(engine, arrivals: dict[int, list], abort: dict[int, str] | None = None):
    """Steps the engine to the end, adding arrivals[step] = [(id, prompt, params)] and
    aborting abort[step] before that step; returns the finished outputs by id."""
    outputs, step, abort = {}, 0, dict(abort or {})
    while engine.has_unfinished_requests() or arrivals:
        for request in arrivals.pop(step, []):
            engine.add_request(*request)
        if step in abort:
            engine.abort_request(abort.pop(step))
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
        step += 1
    return outputs


def test_generate_matches_transformers(hybrid_target: Path, rng, caplog) -> None:
    """Greedy output equals transformers' generate for requests that arrive at different steps
    (batches mixing prefill chunks, decodes and requests at different positions), prompts
    longer than the 16-token prefill chunk; prefix caching is off, saying why; every state
    slot is free at the end."""
    prompts = [torch.randint(4, 128, (n,), generator=rng).tolist() for n in (1, 7, 33, 45, 20)]
    refs = hf_greedy(hybrid_target, prompts, 12)
    with caplog.at_level(logging.INFO, logger="blockdraft"):
        llm = LLM(str(hybrid_target), block_size=4, max_num_batched_tokens=16, max_num_seqs=4)
    assert "prefix caching is off" in caplog.text
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    arrivals = {0: [("0", prompts[0], params), ("1", prompts[1], params)],
                2: [("2", prompts[2], params)], 5: [("3", prompts[3], params)],
                6: [("4", prompts[4], params)]}  # fmt: skip
    outs = run_with_arrivals(llm.engine, arrivals)
    for i, ref in enumerate(refs):
        assert outs[str(i)].outputs[0].token_ids == ref, i
    manager = llm.engine.block_manager
    assert sorted(manager.free_state_slots) == list(range(4))


def test_async_decode_matches_transformers(hybrid_target: Path, rng) -> None:
    """Decode steps launched before the previous one is read back (async_decode) advance the
    state slots in order; a request finishing early frees its slot while its next row is in
    flight, and the request admitted after it starts from a fresh state."""
    prompts = [torch.randint(4, 128, (n,), generator=rng).tolist() for n in (6, 17, 9)]
    refs = hf_greedy(hybrid_target, prompts, 14)
    llm = LLM(str(hybrid_target), async_decode=True, max_num_seqs=2)
    runner, ahead = llm.engine.runner, []
    original = runner.launch_decode_ahead
    runner.launch_decode_ahead = lambda *a: ahead.append(1) or original(*a)
    lengths = (5, 14, 14)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in lengths]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert len(ahead) > 5
    for out, ref, m in zip(outs, refs, lengths, strict=True):
        assert out.outputs[0].token_ids == ref[:m]


def test_preemption_and_abort_free_state_slots(hybrid_target: Path, rng) -> None:
    """A pool too small for every request preempts (the request recomputes from a fresh state)
    and an aborted request gives its slot back; the others' output still equals transformers'."""
    prompts = [torch.randint(4, 128, (n,), generator=rng).tolist() for n in (9, 14, 11, 6)]
    refs = hf_greedy(hybrid_target, prompts, 20)
    llm = LLM(str(hybrid_target), block_size=4, num_kv_blocks=20, max_model_len=40,
              max_num_seqs=4)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    arrivals = {0: [(str(i), p, params) for i, p in enumerate(prompts)]}
    outs = run_with_arrivals(llm.engine, arrivals, abort={4: "2"})
    assert llm.engine.scheduler.num_preemptions > 0
    assert sorted(outs) == ["0", "1", "3"]
    for i in (0, 1, 3):
        assert outs[str(i)].outputs[0].token_ids == refs[i], i
    assert sorted(llm.engine.block_manager.free_state_slots) == list(range(4))


def test_multimodal_checkpoint_loads_its_language_model(hybrid_target, tmp_path, rng, caplog):
    """A `Qwen3_5ForConditionalGeneration` checkpoint (text_config, `model.language_model.*`,
    a vision tower and an MTP head) runs its language model, saying what it skipped."""
    mm = tmp_path / "mm"
    shutil.copytree(hybrid_target, mm)
    text = json.loads((mm / "config.json").read_text())
    config = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
              "text_config": {**text, "model_type": "qwen3_5_text"},
              "vision_config": {"depth": 1}, "tie_word_embeddings": False}  # fmt: skip
    (mm / "config.json").write_text(json.dumps(config))
    tensors = {
        name.replace("model.", "model.language_model.", 1): t
        for name, t in load_file(mm / "model.safetensors").items()
    }
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)
    tensors["mtp.fc.weight"] = torch.zeros(4, 4)
    save_file(tensors, mm / "model.safetensors")
    prompt = torch.randint(4, 128, (10,), generator=rng).tolist()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with caplog.at_level(logging.INFO, logger="blockdraft"):
        out = LLM(str(mm)).generate([prompt], params, use_tqdm=False)[0]
    assert "skipped 2 vision-tower / MTP tensors" in caplog.text
    want = LLM(str(hybrid_target)).generate([prompt], params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == want.outputs[0].token_ids


def test_bad_configs_are_refused(hybrid_target: Path) -> None:
    hf = json.loads((hybrid_target / "config.json").read_text())
    qwen3_5_config(hf)
    for edit, message in [
        ({"layer_types": ["linear_attention"]}, "must list 5 entries"),
        ({"layer_types": ["mamba"] * 5}, "must list 5 entries"),
        ({"attn_output_gate": False}, "attn_output_gate must be true"),
        ({"linear_num_value_heads": 3}, "multiple of linear_num_key_heads"),
    ]:
        with pytest.raises(ValueError, match=message):
            Qwen3_5LM(qwen3_5_config({**hf, **edit}))


@needs_triton
def test_fused_decode_kernel_keeps_greedy_output(hybrid_target: Path, rng, monkeypatch) -> None:
    """With every kernel on the Triton path, decode steps take the Gated DeltaNet layers' fused
    decode kernel and greedy output is that of the layers' step path (fused decode off); in
    the interpreter (float32 throughout) also transformers' generate."""
    calls = count_calls(monkeypatch, triton_gated_deltanet_step, "triton_gated_deltanet_decode")
    prompts = [torch.randint(4, 128, (n,), generator=rng).tolist() for n in (5, 11)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    def generate(fuse: bool) -> list[list[int]]:
        policy = KernelPolicy(backend="triton", fuse_gated_deltanet_decode=fuse)
        llm = LLM(str(hybrid_target), kernel_policy=policy, device=str(DEVICE), dtype="float32",
                  max_num_seqs=2, num_kv_blocks=16, block_size=4, max_model_len=32)  # fmt: skip
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    fused = generate(True)
    assert calls
    calls.clear()
    assert fused == generate(False)
    assert not calls
    if DEVICE.type == "cpu":
        assert fused == hf_greedy(hybrid_target, prompts, 6)


@needs_triton
def test_norms_fuse_into_the_skinny_projections(hybrid_target: Path, rng, monkeypatch) -> None:
    """With the skinny GEMM on this device, decode steps (1-2 rows) form each layer's input
    norm in its mixer's fused input projection (Gated DeltaNet's in_proj, gated attention's
    q/gate/k/v) and its post-attention norm in the dense MLP's gate_up, all in the norm's
    offset form; greedy output is that of the norms as kernels of their own and, in the
    interpreter (float32), transformers'."""
    from blockdraft.kernels import triton_linear

    offsets: list[bool] = []
    backend = linear_layer.get_linear_backend

    def counting(device: torch.device):
        run = backend(device)

        def spy(x, weight, bias, **prologue):
            if "rms_norm" not in prologue:
                return run(x, weight, bias, **prologue)
            offsets.append(prologue["norm_offset"])
            # On the CPU the prologues run in the Triton kernel (interpreted), every other
            # kernel as its torch twin (the kernel tests hold each pair to each other): the
            # whole engine twice in the interpreter took ~100 s of the suite.
            return triton_linear.skinny_linear(x, weight, bias, **prologue)

        return spy

    monkeypatch.setattr(linear_layer, "get_linear_backend", counting)
    prompts = [torch.randint(4, 128, (n,), generator=rng).tolist() for n in (5, 11)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    def generate(fuse: bool) -> list[list[int]]:
        # The skinny GEMM for decode's rows only (prefill's in the interpreter is slow).
        kernels = "triton" if DEVICE.type == "cuda" else "torch"
        policy = KernelPolicy(backend=kernels, skinny_device_type=DEVICE.type,
                              skinny_max_rows=2, fuse_norm_into_skinny=fuse)  # fmt: skip
        llm = LLM(str(hybrid_target), kernel_policy=policy, device=str(DEVICE), dtype="float32",
                  max_num_seqs=2, num_kv_blocks=16, block_size=4, max_model_len=32)  # fmt: skip
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    fused = generate(True)
    layers = json.loads((hybrid_target / "config.json").read_text())["num_hidden_layers"]
    assert offsets and all(offsets) and len(offsets) % (2 * layers) == 0  # two a layer a step
    offsets.clear()
    assert fused == generate(False)
    assert not offsets
    if DEVICE.type == "cpu":
        assert fused == hf_greedy(hybrid_target, prompts, 6)
