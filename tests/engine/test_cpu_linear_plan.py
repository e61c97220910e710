"""`blockdraft.engine.cpu_linear_plan`: a CPU engine times F.linear against `weight @ x.T` on
its own weights at each row count and keeps the counts where the second wins; small models keep
the policy's default; the engine stays lossless on the plan."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from blockdraft import LLM, SamplingParams
from blockdraft.engine import cpu_linear_plan, llm_engine
from blockdraft.engine.cpu_linear_plan import cpu_linear_policy, linear_weights, weight_left_rows
from blockdraft.kernels.policy import CPU_ROW_COUNTS, KernelPolicy

from checkpoints import make_dflash_drafter, make_qwen3_checkpoint


def test_linear_weights_are_each_matrix_once_largest_first() -> None:
    a, b = nn.Linear(8, 4), nn.Linear(8, 16)
    tied = nn.Linear(8, 4)
    tied.weight = a.weight  # one matrix behind two modules
    model = nn.Sequential(a, nn.LayerNorm(8), b, tied, nn.Embedding(10, 8))
    weights = linear_weights(model, None)
    assert [tuple(w.shape) for w in weights] == [(16, 8), (4, 8)]


@pytest.mark.parametrize(
    "left_wins",
    [
        set(CPU_ROW_COUNTS),  # every count: single rows too
        {2, 3, 4, 8, 16},
        {1, 4, 8, 16},  # wins at 1 but not at 2 or 3
        {1, 2, 3, 4, 8},  # loses at 16 only (one thread on an AMD EPYC): the rest still count
        set(),
    ],
)
def test_each_count_takes_the_path_that_won_there(monkeypatch, left_wins: set[int]) -> None:
    timed = []

    def fake_pass(weights, inputs, left: bool) -> float:
        (rows,) = {x.shape[0] for x in inputs.values()}
        timed.append((rows, left))
        return (1.0 if rows in left_wins else 3.0) if left else 2.0

    monkeypatch.setattr(cpu_linear_plan, "_pass_seconds", fake_pass)
    assert weight_left_rows([torch.zeros(4, 8)]) == tuple(sorted(left_wins))
    # Every count is timed, the two paths taking turns.
    assert [m for m, _ in timed[::4]] == list(CPU_ROW_COUNTS)
    assert [left for _, left in timed] == [False, True] * (len(timed) // 2)


def test_small_models_keep_the_default_large_ones_are_measured_set_ones_kept(
    monkeypatch,
) -> None:
    policy = KernelPolicy()
    model = nn.Linear(64, 32)
    assert cpu_linear_policy(policy, model) is policy  # under PLAN_MIN_BYTES
    monkeypatch.setattr(cpu_linear_plan, "PLAN_MIN_BYTES", 0)
    measured = cpu_linear_policy(policy, model)
    assert set(measured.cpu_weight_left_rows) <= set(CPU_ROW_COUNTS)
    assert dataclasses.replace(measured, cpu_weight_left_rows=None) == policy
    pinned = KernelPolicy(cpu_weight_left_rows=(16,))
    assert cpu_linear_policy(pinned, model) is pinned


def test_engines_on_a_plan_of_single_rows_stay_lossless(tmp_path, monkeypatch, rng) -> None:
    """Every CPU linear as `weight @ x.T` (one row as two): plain decoding's greedy tokens are
    speculation's, and the engine reports the plan it runs."""
    target = make_qwen3_checkpoint(tmp_path / "target")
    drafter = make_dflash_drafter(tmp_path / "drafter", target)
    monkeypatch.setattr(
        llm_engine,
        "cpu_linear_policy",
        lambda policy, *models: dataclasses.replace(policy, cpu_weight_left_rows=CPU_ROW_COUNTS),
    )
    prompts = [torch.randint(4, 100, (n,), generator=rng).tolist() for n in (3, 12, 25)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ar = LLM(str(target))
    assert ar.engine.kernel_policy.cpu_weight_left_rows == CPU_ROW_COUNTS
    spec = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": 3}
    sd = LLM(str(target), speculative_config=spec)
    want = [o.outputs[0].token_ids for o in ar.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in sd.generate(prompts, params, use_tqdm=False)]
    assert got == want and sd.engine.spec_stats.num_drafts > 0
