"""DFlash2 speculative decoding: the same drafts and acceptance as z-lab's reference
`dflash_generate` with its `DFlash2DraftModel`, greedy; lossless against plain decoding and the
reference's acceptance statistics when sampling."""

import dataclasses
from pathlib import Path

import pytest
import torch

from blockdraft import LLM, SamplingParams
from blockdraft.config import default_kernel_policy
from blockdraft.kernels import select

from checkpoints import make_predictable_target, make_qwen3_checkpoint, zlab_full_block_steps
from dflash2_checkpoints import (
    make_dflash2_drafter,
    prompt_where_selector_picks,
    zlab2_first_step,
    zlab2_generate,
)
from sampling_checks import ALPHA, assert_same_token_law, seeded_samples, two_sample_pvalue
from spies import spy_draft_logits, spy_proposals


def spec(drafter: Path, n: int) -> dict:
    return {
        "method": "dflash",
        "model": str(drafter),
        "num_speculative_tokens": n,
        "num_speculative_tokens_by_batch": None,
    }


@pytest.fixture(scope="module")
def agreeing_pair(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("dflash2-agreeing")
    target = make_predictable_target(root / "target", num_layers=6)
    drafter = make_dflash2_drafter(
        root / "drafter",
        target,
        block_size=8,
        seed=3,
        agree_with_target=True,
        draft_error_rate=0.15,
        codebook_std=0.1,
    )
    return target, drafter


@pytest.fixture(scope="module")
def random_pair(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("dflash2-random")
    target = make_qwen3_checkpoint(root / "target")
    return target, make_dflash2_drafter(root / "drafter", target, block_size=8, seed=5)


@pytest.mark.parametrize("kind", ["random", "agreeing", "sliding", "random-fused-opening"])
def test_matches_zlab_reference_greedy(tmp_path: Path, kind: str, rng, monkeypatch) -> None:
    """First-step logits and proposals, then whole greedy runs: the same tokens and per-step
    acceptance lengths as z-lab's dflash_generate (also with each sub-block's projection and
    convolution as one kernel, `KernelPolicy.fuse_conv_projection`)."""
    fused = kind.endswith("-fused-opening")
    kind = kind.removesuffix("-fused-opening")
    openings = []
    real_opening = select.projected_dynamic_conv_torch
    monkeypatch.setattr(
        select, "projected_dynamic_conv_torch", lambda *a: openings.append(1) or real_opening(*a)
    )
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))
    kw = dict(block_size=8, seed=seed)
    if kind == "agreeing":
        target = make_predictable_target(tmp_path / "target", num_layers=6)
        kw.update(agree_with_target=True, draft_error_rate=0.15, codebook_std=0.1)
    else:
        target = make_qwen3_checkpoint(tmp_path / "target", num_layers=6)
    if kind == "sliding":
        kw.update(num_layers=3, sliding_window=5)
    drafter = make_dflash2_drafter(tmp_path / "drafter", target, **kw)
    max_new = 30
    if kind == "random":  # the selector, not the argmax, picks some drafts
        picked = prompt_where_selector_picks(target, drafter, rng, 21, 64)
        prompt, ref_logits, ref_proposals = picked
    else:
        prompt = torch.randint(4, 64, (21,), generator=rng).tolist()
        ref_logits, ref_proposals = zlab2_first_step(target, drafter, prompt)
    # Without prefix caching the sliding layers keep only their windows' pages (window_pages.py).
    policy = dataclasses.replace(default_kernel_policy(), fuse_conv_projection=fused)
    llm = LLM(str(target), speculative_config=spec(drafter, 7), block_size=4,
              enable_prefix_caching=kind != "sliding", kernel_policy=policy)  # fmt: skip
    assert (llm.engine.block_manager.window_pages is not None) == (kind == "sliding")
    seen_logits = spy_draft_logits(llm)
    proposals = spy_proposals(llm)
    out = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True), use_tqdm=False
    )
    assert bool(openings) == fused
    rel = (seen_logits[0] - ref_logits).abs().max() / ref_logits.abs().max()
    assert rel < 1e-4
    assert proposals[0][0].tolist() == ref_proposals

    ((ref_tokens, ref_lengths),) = zlab2_generate(target, drafter, prompt, max_new)
    assert out[0].outputs[0].token_ids == ref_tokens
    full_steps = zlab_full_block_steps(ref_lengths, max_new, block_size=8)
    assert full_steps >= 3
    assert out[0].spec_accept_lengths[:full_steps] == ref_lengths[:full_steps]
    if kind == "agreeing":
        assert max(ref_lengths) > 4


@pytest.mark.parametrize("kind", ["random", "agreeing"])
def test_greedy_batch_lossless(agreeing_pair, random_pair, kind: str, rng) -> None:
    """A batch of requests with different prompt lengths, their blocks side by side in one
    drafter forward (a convolution reaching across blocks would change drafts): plain
    decoding's tokens, and each request's first drafts and acceptance the same as alone."""
    target, drafter = agreeing_pair if kind == "agreeing" else random_pair
    prompts = [torch.randint(4, 64, (n,), generator=rng).tolist() for n in (3, 11, 17, 30)]
    params = SamplingParams(temperature=0, max_tokens=25, ignore_eos=True)
    ar = LLM(str(target)).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(target), speculative_config=spec(drafter, 7))
    seen = spy_proposals(llm)
    together = llm.generate(prompts, params, use_tqdm=False)
    first = seen[0]
    assert first.shape[0] == len(prompts)
    for i, (prompt, a, t) in enumerate(zip(prompts, ar, together, strict=True)):
        seen.clear()
        alone = llm.generate([prompt], params, use_tqdm=False)[0]
        assert torch.equal(seen[0][0], first[i])
        assert t.outputs[0].token_ids == a.outputs[0].token_ids
        assert t.spec_accept_lengths == alone.spec_accept_lengths
    if kind == "agreeing":
        assert llm.engine.spec_stats.mean_acceptance_length > 3


@pytest.mark.slow
def test_sampling_is_lossless(random_pair) -> None:
    """Thousands of seeded samples of the first tokens agree between speculative and plain
    decoding (the second and third tokens come from the verify of the selector's drafts)."""
    target, drafter = random_pair
    prompt, num = [5, 17, 33, 8], 3000
    kw = dict(max_num_seqs=512, max_model_len=32)
    ar = seeded_samples(LLM(str(target), **kw), prompt, num, top_k=6)
    llm = LLM(str(target), speculative_config=spec(drafter, 3), **kw)
    sd = seeded_samples(llm, prompt, num, top_k=6)
    stats = llm.engine.spec_stats
    assert stats.num_drafts > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert_same_token_law(ar, sd, (1, 2))


@pytest.mark.slow
def test_sampled_acceptance_matches_zlab(agreeing_pair) -> None:
    """At T > 0 the first verify's acceptance lengths follow the same law as z-lab's
    dflash_generate with its DFlash2DraftModel (rejection sampling with the selector's q)."""
    target, drafter = agreeing_pair
    prompt, num, temperature = [5, 17, 33, 8, 9, 40], 160, 1.5
    # 9 new tokens: the reference's first step verifies a whole block and nothing caps it.
    ref = zlab2_generate(target, drafter, prompt, 9, temperature=temperature, runs=num)
    ref_lengths = [lengths[0] for _, lengths in ref]
    llm = LLM(str(target), speculative_config=spec(drafter, 7), max_num_seqs=num)
    params = [
        SamplingParams(temperature=temperature, max_tokens=9, ignore_eos=True, seed=s)
        for s in range(num)
    ]
    outs = llm.generate([prompt] * num, params, use_tqdm=False)
    lengths = [o.spec_accept_lengths[0] for o in outs]
    assert len(set(ref_lengths)) >= 3 and len(set(lengths)) >= 3, (ref_lengths, lengths)
    assert two_sample_pvalue(ref_lengths, lengths) > ALPHA, (sorted(ref_lengths), sorted(lengths))
    assert abs(sum(ref_lengths) - sum(lengths)) / num < 0.6  # ~5 standard errors


def test_bench_and_server_metrics_report_dflash2_acceptance(agreeing_pair) -> None:
    """`blockdraft bench` and the server's /metrics read a DFlash2 engine's acceptance as a
    DFlash one's: per-request acceptance lengths and the engine's spec stats."""
    from prometheus_client.parser import text_string_to_metric_families

    from blockdraft.bench import run_bench
    from blockdraft.server.async_engine import AsyncEngine
    from blockdraft.server.metrics import ServerMetrics

    target, drafter = agreeing_pair
    dflash2 = LLM(str(target), speculative_config=spec(drafter, 7))
    ar = LLM(str(target))
    (result,) = run_bench(ar, dflash2, {"toy": ["w10 w11", "w20 w21 w22"]}, [0.0], max_tokens=30)
    assert result.mean_acceptance_length > 3 and sum(result.histogram.values()) >= 2
    assert set(result.histogram) <= set(range(1, 9))

    stats = dflash2.engine.spec_stats
    metrics = ServerMetrics(AsyncEngine(dflash2.engine, max_waiting=1)).render().decode()
    values = {
        s.name: s.value
        for family in text_string_to_metric_families(metrics)
        for s in family.samples
    }
    assert values["blockdraft:spec_decode_num_drafts_total"] == stats.num_drafts > 0
    assert values["blockdraft:spec_decode_num_accepted_tokens_total"] == stats.num_accepted_tokens
    assert values["blockdraft:spec_decode_mean_acceptance_length"] == pytest.approx(
        stats.mean_acceptance_length
    )
    assert stats.mean_acceptance_length > 3
