"""Tensor parallelism on the CPU (gloo): 2 and 4 ranks give the tokens of one process, greedy
and seeded-sampled, with and without DFlash; a killed worker makes the engine raise at once;
workers exit when their driver dies; sizes that do not split the models fail before any worker
starts; each rank loads only its slice of every sharded tensor. MoE targets: each rank holds
and reads only its range of the experts, the ranks' partial sums of the routed and shared
experts add up to one process's output in one all-reduce. Hybrid targets: each rank holds and
reads only its Gated DeltaNet key/value heads (three ranges of the fused q|k|v rows) and its
gated-attention heads, and generates what one process does."""

import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from blockdraft import LLM, SamplingParams
from blockdraft.config import EngineConfig, check_device_available, check_tensor_parallel_shape
from blockdraft.distributed.tensor_parallel import (
    TensorParallel,
    building_tensor_parallel,
    param_shard,
)
from blockdraft.engine import model_loader
from blockdraft.layers.linear import fuse_projections
from blockdraft.layers.moe import SparseMoE
from blockdraft.models.dflash_drafter import DFlashConfig, DFlashDrafter
from blockdraft.models.loader import (
    Checkpoint,
    iter_checkpoint_tensors,
    load_weights,
    other_ranks_tensors,
    param_shards,
    read_checkpoint,
    read_json,
    shard_tensors,
)
from blockdraft.models.model_config import MoEConfig
from blockdraft.models.qwen3_5 import Qwen3_5LM
from blockdraft.models.registry import resolve_architecture

from checkpoints import (
    make_dflash_drafter,
    make_hybrid_moe_checkpoint,
    make_llama_checkpoint,
    make_qwen3_5_checkpoint,
    make_qwen3_checkpoint,
    make_qwen3_moe_checkpoint,
)

# 150 words: 4 ranks hold 38, 38, 38 and 36 of them (the last padded). Four query heads, two
# KV heads (split over 2 ranks, replicated over 4) on Qwen3; one (replicated) on Llama.
VOCAB = 150


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp")
    qwen3 = make_qwen3_checkpoint(root / "qwen3", vocab_size=VOCAB, num_layers=2)
    return {
        "qwen3": qwen3,
        "llama": make_llama_checkpoint(root / "llama", vocab_size=VOCAB, num_layers=2),
        "drafter": make_dflash_drafter(root / "drafter", qwen3, target_layer_ids=[0, 1]),
    }


def generate(
    target: Path, drafter: Path | None, size: int, prompts: list[list[int]]
) -> list[list[int]]:
    spec = drafter and {
        "model": str(drafter),
        "num_speculative_tokens": 3,
        "num_speculative_tokens_by_batch": None,
    }
    params = [
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=11, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, top_k=30, seed=12, max_tokens=10),
    ]
    # A 16-token budget splits the longest prompt's prefill over steps that also decode or
    # verify the others.
    with LLM(
        str(target),
        speculative_config=spec,
        tensor_parallel_size=size,
        max_num_batched_tokens=16,
        num_threads=1,
    ) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        workers = llm.engine.workers
    if workers is not None:  # stopped with the LLM
        assert not any(p.is_alive() for p in workers.procs)
        assert not dist.is_initialized()
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.slow
@pytest.mark.parametrize(
    "size, family, speculate",
    [(2, "qwen3", False), (2, "qwen3", True), (4, "llama", False), (4, "qwen3", True)],
)
def test_outputs_equal_one_process(models, rng, size: int, family: str, speculate: bool) -> None:
    prompts = [torch.randint(4, VOCAB, (n,), generator=rng).tolist() for n in (3, 9, 21)]
    drafter = models["drafter"] if speculate else None
    expected = generate(models[family], drafter, 1, prompts)
    assert generate(models[family], drafter, size, prompts) == expected


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory) -> dict[str, Path]:
    """8 experts (2 per rank over 4), top 2; layer 0 sparse, layer 1 dense."""
    root = tmp_path_factory.mktemp("tp_moe")
    kw = dict(vocab_size=VOCAB, num_layers=2, mlp_only_layers=(1,), seed=5)
    moe = make_qwen3_moe_checkpoint(root / "moe", **kw)
    return {
        "moe": moe,
        "stacked": make_qwen3_moe_checkpoint(root / "stacked", stacked_experts=True, **kw),
        "drafter": make_dflash_drafter(root / "drafter", moe, target_layer_ids=[0, 1]),
    }


@pytest.mark.slow
@pytest.mark.parametrize("size, speculate", [(2, False), (2, True), (4, True)])
def test_moe_outputs_equal_one_process(moe_models, rng, size: int, speculate: bool) -> None:
    prompts = [torch.randint(4, VOCAB, (n,), generator=rng).tolist() for n in (3, 9, 21)]
    drafter = moe_models["drafter"] if speculate else None
    expected = generate(moe_models["moe"], drafter, 1, prompts)
    assert generate(moe_models["moe"], drafter, size, prompts) == expected


@pytest.mark.slow
def test_killed_worker_makes_the_engine_raise(models) -> None:
    llm = LLM(str(models["qwen3"]), speculative_config=None, tensor_parallel_size=2, num_threads=1)
    engine = llm.engine
    try:
        # ignore_eos: a random model can end the request by EOS, after which a step sends nothing.
        params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
        engine.add_request("a", [5, 6, 7], params)
        engine.step()
        engine.step()
        (pid,) = engine.workers.pids
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        died = f"worker rank 1 \\(pid {pid}, exit code -9\\) has died"
        with pytest.raises(RuntimeError, match=died):
            while time.monotonic() - t0 < 30:
                engine.step()
        assert time.monotonic() - t0 < 5
        with pytest.raises(RuntimeError, match="the engine stopped"):  # and stays stopped
            engine.step()
    finally:  # a failure here must not leave the group to the tests after it
        llm.shutdown()
    assert not dist.is_initialized()


def test_one_process_builds_no_group(models) -> None:
    """N = 1 is the engine without tensor parallelism: no workers, no group, torch's own
    embedding and head, no layer that holds a group."""
    llm = LLM(str(models["qwen3"]), speculative_config={"model": str(models["drafter"])})
    engine = llm.engine
    assert engine.workers is None and engine.tp is None and not dist.is_initialized()
    assert type(engine.model.model.embed_tokens) is torch.nn.Embedding
    modules = [*engine.model.modules(), *engine.proposer.drafter.modules()]
    assert all(getattr(m, "tp", None) is None for m in modules)
    llm.shutdown()


# -- errors before any worker starts -----------------------------------------------------------


def test_sizes_that_do_not_split_the_target_fail_before_workers_start(models) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide its 4 attention"):
        LLM(str(models["qwen3"]), speculative_config=None, tensor_parallel_size=3)
    assert not multiprocessing.active_children()


def test_experts_that_do_not_split_fail_before_workers_start(tmp_path) -> None:
    target = make_qwen3_moe_checkpoint(tmp_path / "moe", num_layers=1, num_experts=6)
    with pytest.raises(ValueError, match="tensor_parallel_size 4 does not divide its 6 experts"):
        LLM(str(target), speculative_config=None, tensor_parallel_size=4)
    assert not multiprocessing.active_children()


def test_drafter_that_does_not_split_fails_before_workers_start(models, tmp_path) -> None:
    drafter = make_dflash_drafter(
        tmp_path / "odd", models["qwen3"], num_heads=3, num_kv_heads=1, target_layer_ids=[0, 1]
    )
    with pytest.raises(ValueError, match="its 3 attention heads of the drafter"):
        LLM(
            str(models["qwen3"]),
            speculative_config={"model": str(drafter)},
            tensor_parallel_size=2,
        )
    assert not multiprocessing.active_children()


@pytest.mark.parametrize(
    "heads, kv_heads, intermediate, size, message",
    [
        (4, 2, 128, 8, "its 4 attention heads"),
        (6, 3, 128, 2, "its 3 KV heads"),
        (4, 4, 100, 8, "its 4 attention heads and its intermediate_size 100"),
    ],
)
def test_shape_check_names_what_does_not_divide(
    heads: int, kv_heads: int, intermediate: int, size: int, message: str
) -> None:
    cfg = SimpleNamespace(num_heads=heads, num_kv_heads=kv_heads, intermediate_size=intermediate)
    with pytest.raises(ValueError, match=message):
        check_tensor_parallel_shape(size, "the target", cfg)


def moe_shape(intermediate: int, experts: int, moe_intermediate: int, shared: int = 0, **kw):
    moe = MoEConfig(
        experts, 2, moe_intermediate, True, shared_expert_intermediate_size=shared, **kw
    )
    return SimpleNamespace(
        num_heads=4, num_kv_heads=4, intermediate_size=intermediate, num_layers=4, moe=moe
    )


@pytest.mark.parametrize(
    "cfg, message",
    [
        (moe_shape(64, 6, 32), "its 6 experts"),
        (moe_shape(64, 8, 32, shared=30), "its shared_expert_intermediate_size 30"),
        (moe_shape(66, 8, 32, mlp_only_layers=(2,)), "its intermediate_size 66"),
    ],
)
def test_shape_check_names_what_does_not_split_the_experts(cfg, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_tensor_parallel_shape(4, "the target", cfg)


def test_shape_check_splits_experts_not_their_width() -> None:
    """Each rank holds whole experts: their width need not divide; an all-sparse model has no
    dense MLP whose width would."""
    check_tensor_parallel_shape(4, "the target", moe_shape(66, 8, 30))


def test_shape_check_accepts_replicated_kv_heads() -> None:
    cfg = SimpleNamespace(num_heads=8, num_kv_heads=2, intermediate_size=64)
    check_tensor_parallel_shape(4, "the target", cfg)  # 2 ranks per KV head


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(tensor_parallel_size=0), "tensor_parallel_size must be a positive integer"),
        (dict(tensor_parallel_size="2"), "tensor_parallel_size must be a positive integer"),
        (dict(tensor_parallel_size=2, async_decode=True), "async_decode is not supported"),
    ],
)
def test_bad_tensor_parallel_config(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_fewer_gpus_than_ranks_names_both(monkeypatch) -> None:
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match="tensor_parallel_size 4 needs 4 GPUs .* has 2"):
        check_device_available("cuda", 4)
    with pytest.raises(ValueError, match="tensor_parallel_size 2 needs 2 GPUs .* has 1"):
        check_device_available("cuda:1", 2)
    check_device_available("cuda", 2)


# -- shard-by-shard loading --------------------------------------------------------------------


def _full_tensors(path: Path) -> dict[str, torch.Tensor]:
    return dict(iter_checkpoint_tensors(read_checkpoint(str(path))))


@pytest.mark.parametrize("size", [2, 4])
def test_each_rank_loads_its_slices(models, size: int) -> None:
    """Every rank's sharded parameter is its slice of the checkpoint tensor (the padded tail
    zero), and the ranks' slices of the query heads, the intermediate features and the
    vocabulary cover the tensors."""
    hf = read_json(models["qwen3"] / "config.json")
    arch = resolve_architecture(hf)
    draft_cfg = DFlashConfig.from_hf(read_json(models["drafter"] / "config.json"))
    full = _full_tensors(models["qwen3"])
    full_draft = _full_tensors(models["drafter"])
    covered: dict[str, list[torch.Tensor]] = {}
    for rank in range(size):
        tp = TensorParallel(rank, size, group=None)
        with building_tensor_parallel(tp):
            model = arch.model_class(arch.parse_config(hf))
            drafter = DFlashDrafter(draft_cfg, model, 64)
        for source, module, tensors in (
            (models["qwen3"], model, full),
            (models["drafter"], drafter, full_draft),
        ):
            params = {
                n: p for n, p in module.named_parameters() if not n.startswith(("embed", "lm_"))
            } if module is drafter else dict(module.named_parameters())  # fmt: skip
            load_weights(
                params,
                iter_checkpoint_tensors(read_checkpoint(str(source)), param_shards(params)),
                str(source),
            )
            for name, p in params.items():
                shard = param_shard(p)
                if shard is None:  # replicated: the whole tensor
                    assert torch.equal(p, tensors[name]), name
                    continue
                n = shard.stop - shard.start
                held = p.narrow(shard.dim, 0, n)
                assert torch.equal(held, tensors[name][shard.index()]), name
                assert not p.narrow(shard.dim, n, p.shape[shard.dim] - n).any(), name  # padding
                covered.setdefault(name, []).append(held)
    assert covered["model.embed_tokens.weight"][0].shape[0] == -(-VOCAB // size)
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.up_proj.weight",
                 "model.layers.1.self_attn.q_proj.weight"):  # fmt: skip
        assert torch.equal(torch.cat(covered[name]), full[name]), name
    down = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(torch.cat(covered[down], dim=1), full[down])
    # Two KV heads: split over 2 ranks, each replicated on 2 of 4.
    k = "model.layers.0.self_attn.k_proj.weight"
    assert torch.equal(torch.cat(covered[k][:: max(size // 2, 1)]), full[k])


def _read_names(tensors, names: list[str]):
    for name, tensor in tensors:
        names.append(name)
        yield name, tensor


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("source", ["per-expert", "stacked", "in-memory"])
def test_each_rank_loads_its_experts(moe_models, size: int, source: str) -> None:
    """Rank r holds experts [r*E/N, (r+1)*E/N) of every sparse layer (the router whole) and
    reads no other expert's tensor: per-expert safetensors tensors of other ranks are skipped
    unread, stacked ones sliced at read, preloaded (GGUF) ones passed over."""
    path = moe_models["stacked" if source == "stacked" else "moe"]
    hf = read_json(path / "config.json")
    arch = resolve_architecture(hf)
    full = dict(iter_checkpoint_tensors(read_checkpoint(str(path))))
    whole = arch.model_class(arch.parse_config(hf))
    load_weights(
        dict(whole.named_parameters()),
        full.items(),
        "whole",
        ignore=lambda n: "rotary_emb" in n,
        locate=whole.checkpoint_slice,
    )
    experts = "model.layers.0.mlp.experts."
    for rank in range(size):
        with building_tensor_parallel(TensorParallel(rank, size, group=None)):
            model = arch.model_class(arch.parse_config(hf))
        params = dict(model.named_parameters())
        ckpt = read_checkpoint(str(path))
        if source == "in-memory":
            ckpt = Checkpoint(hf, None, state_dict=full)
        names: list[str] = []
        skip = other_ranks_tensors(params, model.checkpoint_slice)
        tensors = iter_checkpoint_tensors(ckpt, param_shards(params), skip)
        load_weights(params, _read_names(tensors, names), str(path), locate=model.checkpoint_slice)
        per = 8 // size
        start = rank * per
        for proj in ("gate_up_proj", "down_proj"):
            held = params[experts + proj]
            assert param_shard(held).index() == (slice(start, start + per),)
            assert torch.equal(held, whole.get_parameter(experts + proj)[start : start + per])
        router = "model.layers.0.mlp.gate.weight"
        assert torch.equal(params[router], full[router])
        per_expert = [n for n in names if n.startswith(experts) and n.split(".")[5].isdigit()]
        mine = set() if source == "stacked" else set(range(start, start + per))
        assert {int(n.split(".")[5]) for n in per_expert} == mine


@dataclass(frozen=True)
class PartialSums(TensorParallel):
    """A rank whose all-reduce returns its own partial sum (and counts itself): the test adds
    the ranks' up."""

    reduces: list = field(default_factory=list)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.reduces.append(tuple(x.shape))
        return x


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("size", [2, 4])
def test_sparse_moe_partial_sums_add_up(rng, size: int, fused: bool) -> None:
    """A gated shared expert (Qwen3-Next's) beside the routed ones: each rank's routed experts
    and shared-expert slice, in one all-reduce, sum to the unsharded layer's output."""
    shape = dict(hidden_size=32, num_experts=8, top_k=3, intermediate_size=16, renormalize=False)
    whole = SparseMoE(**shape, shared_expert_intermediate_size=24)
    with torch.no_grad():
        for p in whole.parameters():
            p.copy_(torch.randn(p.shape, generator=rng) * 0.3)
    state = whole.state_dict()
    x = torch.randn(9, 32, generator=rng)
    total = torch.zeros_like(x)
    for rank in range(size):
        tp = PartialSums(rank, size, group=None)
        with building_tensor_parallel(tp):
            layer = SparseMoE(**shape, shared_expert_intermediate_size=24)
        params = dict(layer.named_parameters())
        load_weights(params, shard_tensors(state.items(), param_shards(params), "moe"), "moe")
        if fused:
            fuse_projections(layer)
        with torch.no_grad():
            total += layer(x)
        assert tp.reduces == [tuple(x.shape)]  # one all-reduce, of the routed and shared sum
    if fused:
        fuse_projections(whole)
    with torch.no_grad():
        expected = whole(x)
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-5)


DRIVER = """
import sys, time
import torch
from blockdraft import LLM
torch.set_num_threads(1)
if __name__ == "__main__":
    llm = LLM(sys.argv[1], speculative_config=None, num_threads=1, tensor_parallel_size=2)
    print(*llm.engine.workers.pids, flush=True)
    time.sleep(120)
"""


@pytest.mark.slow
def test_workers_exit_when_the_driver_dies(models, tmp_path) -> None:
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    driver = subprocess.Popen(
        [sys.executable, str(script), str(models["qwen3"])], stdout=subprocess.PIPE, text=True
    )
    try:
        (pid,) = map(int, driver.stdout.readline().split())
    finally:
        driver.kill()
        driver.wait()
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its dead parent's reaper) counts as gone.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


# -- hybrid (Gated DeltaNet + gated attention) targets ------------------------------------------


@pytest.fixture(scope="module")
def hybrid_models(tmp_path_factory) -> dict[str, Path]:
    """Linear, full, linear layers; 4 key / 8 value heads in the linear layers, 4 query / 2 KV
    heads in the full one (split over 2 ranks, replicated over 4)."""
    root = tmp_path_factory.mktemp("tp_hybrid")
    hybrid = make_qwen3_5_checkpoint(
        root / "hybrid", vocab_size=VOCAB, num_layers=3, linear_heads=(4, 8), seed=7
    )
    return {
        "hybrid": hybrid,
        "multimodal": _as_multimodal(hybrid, root / "multimodal"),
        # A sliding layer: its pages (window_pages.py) follow the driver's updates on every rank.
        "drafter": make_dflash_drafter(
            root / "drafter",
            hybrid,
            target_layer_ids=[0, 2],
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
        ),
    }


def _as_multimodal(target: Path, out: Path) -> Path:
    """`target` as a `Qwen3_5ForConditionalGeneration` checkpoint: its tensors under
    `model.language_model.*`, beside a vision tower's and an MTP head's."""
    shutil.copytree(target, out)
    text = read_json(out / "config.json")
    config = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
              "text_config": {**text, "model_type": "qwen3_5_text"}}  # fmt: skip
    (out / "config.json").write_text(json.dumps(config))
    tensors = {
        name.replace("model.", "model.language_model.", 1): t
        for name, t in load_file(out / "model.safetensors").items()
    }
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)
    tensors["mtp.fc.weight"] = torch.zeros(4, 4)
    save_file(tensors, out / "model.safetensors")
    return out


@pytest.mark.slow
@pytest.mark.parametrize("size, speculate", [(2, False), (2, True), (4, True)])
def test_hybrid_outputs_equal_one_process(hybrid_models, rng, size: int, speculate: bool) -> None:
    prompts = [torch.randint(4, VOCAB, (n,), generator=rng).tolist() for n in (3, 9, 21)]
    drafter = hybrid_models["drafter"] if speculate else None
    expected = generate(hybrid_models["hybrid"], drafter, 1, prompts)
    assert generate(hybrid_models["hybrid"], drafter, size, prompts) == expected


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
def test_hybrid_moe_outputs_equal_one_process(tmp_path, rng, family: str) -> None:
    """Qwen3.5-MoE (routed + gated shared expert) and Qwen3-Next (its fused q/k/v/z and b/a
    projections regrouped at load, then read as slices) split over 2 ranks: heads and experts."""
    target = make_hybrid_moe_checkpoint(
        tmp_path / family, family, vocab_size=VOCAB, num_layers=3, linear_heads=(2, 4), seed=3
    )
    prompts = [torch.randint(4, VOCAB, (n,), generator=rng).tolist() for n in (4, 11, 19)]
    assert generate(target, None, 2, prompts) == generate(target, None, 1, prompts)


@pytest.mark.slow
def test_multimodal_hybrid_checkpoint_splits(hybrid_models, rng) -> None:
    """A multimodal checkpoint's language model (tensors renamed as they are read) splits:
    each rank reads its slices under the checkpoint's names."""
    prompts = [torch.randint(4, VOCAB, (n,), generator=rng).tolist() for n in (5, 8, 17)]
    expected = generate(hybrid_models["hybrid"], None, 1, prompts)
    assert generate(hybrid_models["multimodal"], None, 2, prompts) == expected


@pytest.mark.parametrize("size", [2, 4])
def test_each_rank_loads_its_hybrid_heads(hybrid_models, size: int) -> None:
    """Rank r holds key heads and value heads [r*H/N, (r+1)*H/N) of every Gated DeltaNet
    layer: its q, k and v rows of in_proj_qkv and conv1d (three ranges, read alone), its value
    rows of in_proj_z/b/a, dt_bias, A_log and out_proj's columns; the gated norm whole; the
    full attention layer's q_proj keeps each head's query and gate rows together. The fused
    input GEMM stacks the rank's parts; the ranks' parts cover every tensor."""
    path = hybrid_models["hybrid"]
    hf = read_json(path / "config.json")
    arch = resolve_architecture(hf)
    cfg = arch.parse_config(hf)
    full = _full_tensors(path)
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    key_dim, value_dim = hk * cfg.linear_key_head_dim, hv * cfg.linear_value_head_dim
    gdn_name, attn_name = "model.layers.0.linear_attn", "model.layers.1.self_attn"

    def qkv_rows(tensor: torch.Tensor, rank: int) -> torch.Tensor:
        q, k, v = tensor.split((key_dim, key_dim, value_dim))
        return torch.cat([t.chunk(size)[rank] for t in (q, k, v)])

    covered: dict[str, list[torch.Tensor]] = {}
    for rank in range(size):
        with building_tensor_parallel(TensorParallel(rank, size, group=None)):
            model = arch.model_class(cfg)
        params = dict(model.named_parameters())
        tensors = iter_checkpoint_tensors(read_checkpoint(str(path)), param_shards(params))
        load_weights(params, tensors, str(path))
        gdn, attn = model.model.layers[0].linear_attn, model.model.layers[1].self_attn
        assert (gdn.num_k_heads, gdn.num_v_heads) == (hk // size, hv // size)
        for part in ("in_proj_qkv", "conv1d"):
            expected = qkv_rows(full[f"{gdn_name}.{part}.weight"], rank)
            assert torch.equal(getattr(gdn, part).weight, expected), part
        for part in ("in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight", "dt_bias",
                     "A_log"):  # fmt: skip
            expected = full[f"{gdn_name}.{part}"].chunk(size)[rank]
            assert torch.equal(params[f"{gdn_name}.{part}"], expected), part
        out = full[f"{gdn_name}.out_proj.weight"].chunk(size, dim=1)[rank]
        assert torch.equal(gdn.out_proj.weight, out)
        assert torch.equal(gdn.norm.weight, full[f"{gdn_name}.norm.weight"])
        q_gate = full[f"{attn_name}.q_proj.weight"].view(cfg.num_heads, 2, cfg.head_dim, -1)
        assert torch.equal(attn.q_proj.weight, q_gate.chunk(size)[rank].flatten(0, 2))
        for name, p in params.items():
            shard = param_shard(p)
            held = p if shard is None else p.narrow(shard.dim, 0, shard.length)
            covered.setdefault(name, []).append(held)
        fuse_projections(model)
        in_proj = torch.cat([full[f"{gdn_name}.in_proj_{x}.weight"].chunk(size)[rank]
                             for x in "zba"])  # fmt: skip
        fused = torch.cat((qkv_rows(full[f"{gdn_name}.in_proj_qkv.weight"], rank), in_proj))
        assert torch.equal(gdn._in_proj[0], fused)
    for name in (f"{gdn_name}.in_proj_z.weight", f"{gdn_name}.A_log", f"{attn_name}.q_proj.weight",
                 "model.layers.2.linear_attn.in_proj_b.weight"):  # fmt: skip
        assert torch.equal(torch.cat(covered[name]), full[name]), name
    name = "model.layers.2.linear_attn.out_proj.weight"
    assert torch.equal(torch.cat(covered[name], dim=1), full[name])


@pytest.mark.parametrize(
    "linear_heads, size, message",
    [
        ((2, 4), 4, "its 2 Gated DeltaNet key heads of the target"),
        ((4, 12), 8, "its 4 Gated DeltaNet key heads and its 12 Gated DeltaNet value heads"),
    ],
)
def test_shape_check_names_linear_heads(linear_heads, size: int, message: str) -> None:
    shape = dict(num_heads=8, num_kv_heads=8, intermediate_size=64)
    hybrid = SimpleNamespace(
        **shape,
        layer_types=("linear_attention", "full_attention"),
        linear_num_key_heads=linear_heads[0],
        linear_num_value_heads=linear_heads[1],
    )
    with pytest.raises(ValueError, match=message):
        check_tensor_parallel_shape(size, "the target", hybrid)
    check_tensor_parallel_shape(size, "the target", SimpleNamespace(**shape))


class _CopyingHybridLM(Qwen3_5LM):
    """A family whose renaming makes new tensors (as a regrouping does): no slice can be read
    for them, so each rank cuts its own from the tensors made."""

    @staticmethod
    def checkpoint_tensors(tensors):
        for name, tensor in Qwen3_5LM.checkpoint_tensors(tensors):
            yield name, tensor.clone()


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("source", ["multimodal", "copying"])
def test_each_rank_loads_its_slices_through_a_renaming(hybrid_models, size, source) -> None:
    """A family's checkpoint_tensors between the read and the parameters: renamed tensors
    (a multimodal checkpoint's language model) are read as their slices under the
    checkpoint's names; tensors it makes are cut after it. Either way every rank holds what
    it holds from the plain checkpoint."""
    path = hybrid_models["multimodal" if source == "multimodal" else "hybrid"]
    ckpt = read_checkpoint(str(path))
    hf = read_json(hybrid_models["hybrid"] / "config.json")
    model_cfg = resolve_architecture(hf).parse_config(hf)
    family = Qwen3_5LM if source == "multimodal" else _CopyingHybridLM
    read: list[str] = []  # the tensors read as slices, under the checkpoint's names

    def reading(ckpt, shards=None, skip=lambda name: False):
        read.extend(shards or {})
        return iter_checkpoint_tensors(ckpt, shards, skip)

    for rank in range(size):
        read.clear()
        with building_tensor_parallel(TensorParallel(rank, size, group=None)):
            model, plain = family(model_cfg), Qwen3_5LM(model_cfg)
        params, plain_params = dict(model.named_parameters()), dict(plain.named_parameters())
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(model_loader, "iter_checkpoint_tensors", reading)
            load_weights(
                params, model_loader.rank_checkpoint_tensors(ckpt, model, params), str(path)
            )
        plain_ckpt = read_checkpoint(str(hybrid_models["hybrid"]))
        load_weights(plain_params, iter_checkpoint_tensors(plain_ckpt, param_shards(plain_params)),
                     "plain")  # fmt: skip
        for name, p in params.items():
            assert torch.equal(p, plain_params[name]), name
        assert len(read) == (len(param_shards(params)) if source == "multimodal" else 0)


def test_linear_heads_that_do_not_split_fail_before_workers_start(tmp_path) -> None:
    target = make_qwen3_5_checkpoint(tmp_path / "hybrid", num_layers=2, linear_heads=(2, 4))
    with pytest.raises(ValueError, match="does not divide its 2 Gated DeltaNet key heads"):
        LLM(str(target), tensor_parallel_size=4)
