"""Tensor parallelism on the CPU (gloo): 2 and 4 ranks give the tokens of one process, greedy
and seeded-sampled, with and without DFlash; a killed worker makes the engine raise at once;
workers exit when their driver dies; sizes that do not split the models fail before any worker
starts; each rank loads only its slice of every sharded tensor."""

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from blockdraft import LLM, SamplingParams
from blockdraft.config import EngineConfig, check_device_available, check_tensor_parallel_shape
from blockdraft.distributed.tensor_parallel import (
    TensorParallel,
    building_tensor_parallel,
    param_shard,
)
from blockdraft.models.dflash_drafter import DFlashConfig, DFlashDrafter
from blockdraft.models.loader import (
    iter_checkpoint_tensors,
    load_weights,
    param_shards,
    read_checkpoint,
    read_json,
)
from blockdraft.models.registry import resolve_architecture

from checkpoints import make_dflash_drafter, make_llama_checkpoint, make_qwen3_checkpoint

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


@pytest.mark.slow
def test_killed_worker_makes_the_engine_raise(models) -> None:
    llm = LLM(str(models["qwen3"]), speculative_config=None, tensor_parallel_size=2, num_threads=1)
    engine = llm.engine
    engine.add_request("a", [5, 6, 7], SamplingParams(temperature=0, max_tokens=50))
    engine.step()
    engine.step()
    (pid,) = engine.workers.pids
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=f"worker rank 1 \\(pid {pid}, exit code -9\\) has died"):
        while time.monotonic() - t0 < 30:
            engine.step()
    assert time.monotonic() - t0 < 5
    with pytest.raises(RuntimeError, match="the engine stopped"):  # and stays stopped
        engine.step()
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
