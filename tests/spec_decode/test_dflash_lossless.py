"""DFlash speculative decoding: lossless against plain decoding, and the same drafter semantics
as z-lab's reference `dflash` package."""

from pathlib import Path

import pytest
import torch

from blockdraft import LLM, SamplingParams

from checkpoints import (
    make_dflash_drafter,
    make_predictable_target,
    make_qwen3_checkpoint,
    zlab_first_draft_logits,
    zlab_full_block_steps,
    zlab_generate,
)
from sampling_checks import assert_same_token_law, seeded_samples

PROMPT_LENGTHS = [1, 4, 9, 16, 23, 40]


@pytest.fixture(scope="module")
def random_pair(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("random")
    target = make_qwen3_checkpoint(root / "target")
    return target, make_dflash_drafter(root / "drafter", target)


@pytest.fixture(scope="module")
def agreeing_pair(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("agreeing")
    target = make_predictable_target(root / "target")
    return target, make_dflash_drafter(root / "drafter", target, agree_with_target=True)


def prompts_for(target: Path, rng: torch.Generator) -> list[list[int]]:
    import json

    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    return [torch.randint(4, vocab, (n,), generator=rng).tolist() for n in PROMPT_LENGTHS]


def spec(drafter: Path, n: int | None) -> dict:
    # Drafts at every batch size: the CPU's "auto" schedule would stop them from 4 requests on.
    cfg = {"method": "dflash", "model": str(drafter), "num_speculative_tokens_by_batch": None}
    if n is not None:
        cfg["num_speculative_tokens"] = n
    return cfg


def assert_same_tokens(ar, sd) -> None:
    for a, s in zip(ar, sd, strict=True):
        assert s.outputs[0].token_ids == a.outputs[0].token_ids
        assert s.outputs[0].finish_reason == a.outputs[0].finish_reason
        assert s.outputs[0].text == a.outputs[0].text


SETUPS = {
    "plain": {},
    "chunked-prefill": dict(max_num_batched_tokens=20),
    "preemption": dict(block_size=4, num_kv_blocks=30, max_model_len=80),
    "prefix-cache": dict(block_size=4, enable_prefix_caching=True),
}


@pytest.mark.parametrize("n", [1, 3, 7, 15])
def test_greedy_lossless_random_drafter(random_pair, n: int, rng) -> None:
    target, drafter = random_pair
    prompts = prompts_for(target, rng)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ar = LLM(str(target)).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(target), speculative_config=spec(drafter, n))
    sd = llm.generate(prompts, params, use_tqdm=False)
    assert_same_tokens(ar, sd)
    for out in sd:
        lengths = out.spec_accept_lengths
        assert all(1 <= k <= n + 1 for k in lengths)
        assert 1 + sum(lengths) == len(out.outputs[0].token_ids)
    assert llm.engine.spec_stats.num_draft_tokens == n * llm.engine.spec_stats.num_drafts


@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("n", [3, 15])
def test_greedy_lossless_agreeing_drafter(agreeing_pair, setup: str, n: int, rng) -> None:
    target, drafter = agreeing_pair
    prompts = prompts_for(target, rng)
    if setup == "prefix-cache":  # a shared prefix, so later requests hit cached blocks
        prompts = [prompts[-1] + p for p in prompts]
    # max_tokens not a multiple of n + 1: the last accepted run is truncated.
    params = SamplingParams(temperature=0, max_tokens=37, ignore_eos=True)
    ar = LLM(str(target), **SETUPS[setup]).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(target), speculative_config=spec(drafter, n), **SETUPS[setup])
    # The first request alone fills the prefix cache (its target and drafter K/V) for the rest.
    sd = llm.generate(prompts[:1], params, use_tqdm=False)
    sd += llm.generate(prompts[1:], params, use_tqdm=False)
    assert_same_tokens(ar, sd)
    stats = llm.engine.spec_stats
    assert stats.mean_acceptance_length > 0.8 * (n + 1), stats.summary()
    if setup == "preemption":
        # A recomputed request samples its next token from the prefill, not from a verify.
        assert llm.engine.scheduler.num_preemptions > 0
        assert all(1 + sum(o.spec_accept_lengths) <= 37 for o in sd)
    else:
        assert all(1 + sum(o.spec_accept_lengths) == 37 for o in sd)
    if setup == "prefix-cache":
        assert all(o.num_cached_tokens >= 36 for o in sd[1:])
    engine = llm.engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_stops_inside_an_accepted_run(agreeing_pair, rng) -> None:
    target, drafter = agreeing_pair
    prompt = prompts_for(target, rng)[3]
    base = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ar_tokens = LLM(str(target)).generate([prompt], base, use_tqdm=False)[0].outputs[0].token_ids
    llm_ar = LLM(str(target))
    llm_sd = LLM(str(target), speculative_config=spec(drafter, 15))
    stop_token = ar_tokens[6]  # lands inside the first verify's accepted run
    tok = llm_sd.tokenizer
    stop_text = tok.decode(ar_tokens[9:11])
    cases = [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop_token]),
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop_text]),
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
    ]
    for params in cases:
        ar = llm_ar.generate([prompt], params, use_tqdm=False)
        sd = llm_sd.generate([prompt], params, use_tqdm=False)
        assert_same_tokens(ar, sd)
        assert sd[0].outputs[0].finish_reason == ("length" if params.max_tokens == 5 else "stop")
        assert 1 + sum(sd[0].spec_accept_lengths) == len(sd[0].outputs[0].token_ids)


ZLAB_CASES = {
    "full": {},
    "sliding": dict(
        num_layers=3,
        sliding_window=5,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    ),
    # features of the last target layer are its final-normed output, as in transformers
    "last-layer-feature": dict(target_layer_ids=[1, 5]),
    # long, varying accepted runs: the agreeing drafter with some deliberately wrong drafts
    "varying-acceptance": dict(agree_with_target=True, draft_error_rate=0.15),
    # optional scalings, and causality forced on full-attention layers
    "scaled-and-causal": dict(),
}
CONFIG_PATCHES = {
    "scaled-and-causal": {
        "is_causal": True,
        "dflash_config": {
            "input_embedding_scale": 1.7,
            "output_multiplier": 0.6,
            "final_logit_softcapping": 3.0,
        },
    },
}


@pytest.mark.parametrize("kind", list(ZLAB_CASES))
def test_matches_zlab_reference(tmp_path: Path, kind: str, rng) -> None:
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))
    if kind == "varying-acceptance":
        target = make_predictable_target(tmp_path / "target", num_layers=6)
    else:
        target = make_qwen3_checkpoint(tmp_path / "target", num_layers=6)
    prompt = torch.randint(4, 64, (21,), generator=rng).tolist()
    max_new = 30
    for attempt in range(5):
        drafter = make_dflash_drafter(
            tmp_path / f"drafter{attempt}",
            target,
            block_size=8,
            seed=seed + attempt,
            **ZLAB_CASES[kind],
        )
        ref_tokens, ref_lengths = zlab_generate(target, drafter, prompt, max_new_tokens=max_new)
        # A drafter whose wrong drafts all miss this short run accepts every block whole:
        # take the next seed (each misses with a probability of a few percent).
        if kind != "varying-acceptance" or len(set(ref_lengths[:-1])) > 1:
            break
    if kind in CONFIG_PATCHES:
        import json

        cfg = json.loads((drafter / "config.json").read_text())
        patch = CONFIG_PATCHES[kind]
        cfg["dflash_config"].update(patch["dflash_config"])
        cfg.update({k: v for k, v in patch.items() if k != "dflash_config"})
        (drafter / "config.json").write_text(json.dumps(cfg))
    # Drafter logits of the first step, computed by z-lab's DFlashDraftModel.
    ref_logits = zlab_first_draft_logits(target, drafter, prompt)
    llm = LLM(str(target), speculative_config=spec(drafter, 7), block_size=4)
    seen: list[torch.Tensor] = []
    proposer = llm.engine.proposer
    original = proposer.drafter.compute_logits
    proposer.drafter.compute_logits = lambda h, **kw: seen.append(original(h, **kw)) or seen[-1]
    params = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    rel = (seen[0] - ref_logits).abs().max() / ref_logits.abs().max()
    assert rel < 1e-4
    if kind in CONFIG_PATCHES:  # the reference ran before the patch
        ref_tokens, ref_lengths = zlab_generate(target, drafter, prompt, max_new_tokens=max_new)
    assert out.outputs[0].token_ids == ref_tokens
    full_steps = zlab_full_block_steps(ref_lengths, max_new, block_size=8)
    assert full_steps >= 3
    assert out.spec_accept_lengths[:full_steps] == ref_lengths[:full_steps]
    if kind == "varying-acceptance":
        assert len(set(ref_lengths[:-1])) > 1 and max(ref_lengths) > 4


@pytest.mark.slow
def test_sampling_is_lossless(random_pair) -> None:
    """Thousands of seeded samples of the first tokens agree between speculative and plain
    decoding (two-sample chi-square on the second and third tokens, which come from verify)."""
    target, drafter = random_pair
    prompt, num = [5, 17, 33, 8], 3000
    kw = dict(max_num_seqs=512, max_model_len=32)
    ar = seeded_samples(LLM(str(target), **kw), prompt, num, top_k=6)
    llm = LLM(str(target), speculative_config=spec(drafter, 3), **kw)
    sd = seeded_samples(llm, prompt, num, top_k=6)
    assert llm.engine.spec_stats.num_drafts > 0
    assert_same_token_law(ar, sd, (1, 2))


def test_dummy_weights_and_synthetic_acceptance(tmp_path: Path, monkeypatch) -> None:
    """Benchmark mode: a target and drafter built from config.json alone, with a fixed per-draft
    acceptance probability, give the expected mean acceptance length; a step still reads the
    device back once."""
    import json

    from benchmarks.common import write_dummy_drafter

    hf = {
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 256,
    }
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(json.dumps(hf))
    drafter = write_dummy_drafter(tmp_path / "drafter", hf, num_layers=2, with_weights=False)
    rate, n = 0.7, 7
    llm = LLM(
        str(tmp_path / "target"),
        load_format="dummy",
        speculative_config={**spec(drafter, n), "synthetic_acceptance_rate": rate},
    )
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    # 48 requests give ~900 verify rows: the standard error of the mean acceptance length is
    # ~0.07, so the 0.35 bound is ~5 standard errors (16 requests made it flaky, ~3).
    requests = [(str(i), [5, 6, 7], params) for i in range(48)]
    outs = run_counting_readbacks(llm.engine, {0: requests}, monkeypatch).values()
    assert len(outs) == 48 and all(len(o.outputs[0].token_ids) == 64 for o in outs)
    expected = sum(rate**k for k in range(n + 1))  # E[accepted + 1] for a geometric run
    assert abs(llm.engine.spec_stats.mean_acceptance_length - expected) < 0.35


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c.update(hidden_size=32), "hidden_size 32 does not match"),
        (lambda c: c.update(vocab_size=99), "vocab_size 99 does not match"),
        (lambda c: c["dflash_config"].update(target_layer_ids=[1, 9]), r"\[9\] are out of range"),
        (lambda c: c["dflash_config"].update(sample_from_anchor=True), "DSpark"),
        (lambda c: c.update(architectures=["Qwen3ForCausalLM"]), "DFlashDraftModel"),
        (lambda c: c["dflash_config"].pop("mask_token_id"), "mask_token_id"),
        (
            lambda c: c.update(
                layer_types=["sliding_attention", "full_attention"], sliding_window=None
            ),
            "sliding_window",
        ),
    ],
)
def test_bad_drafters_are_rejected_at_load(random_pair, tmp_path: Path, edit, message) -> None:
    import json
    import shutil

    target, drafter = random_pair
    bad = tmp_path / "bad"
    shutil.copytree(drafter, bad)
    cfg = json.loads((bad / "config.json").read_text())
    edit(cfg)
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=message):
        LLM(str(target), speculative_config=spec(bad, None))


def test_too_many_speculative_tokens(random_pair) -> None:
    target, drafter = random_pair
    with pytest.raises(ValueError, match="exceeds the drafter's block_size - 1"):
        LLM(str(target), speculative_config=spec(drafter, 16))
    with pytest.raises(ValueError, match="speculative method"):
        LLM(str(target), speculative_config={"method": "eagle", "model": str(drafter)})


def test_drafter_with_its_own_embedding_and_head(random_pair, tmp_path: Path, rng) -> None:
    """A drafter that ships embed_tokens / lm_head uses them instead of the target's; with copies
    of the target's own tensors the drafts, hence everything, stay the same."""
    import shutil

    from safetensors.torch import load_file, save_file

    target, drafter = random_pair
    own = tmp_path / "own"
    shutil.copytree(drafter, own)
    tensors = load_file(own / "model.safetensors")
    target_tensors = load_file(target / "model.safetensors")
    tensors["embed_tokens.weight"] = target_tensors["model.embed_tokens.weight"].clone()
    tensors["lm_head.weight"] = target_tensors["lm_head.weight"].clone()
    save_file(tensors, own / "model.safetensors")
    prompt = torch.randint(4, 128, (12,), generator=rng).tolist()
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    shared = LLM(str(target), speculative_config=spec(drafter, 7))
    separate = LLM(str(target), speculative_config=spec(own, 7))
    own_drafter = separate.engine.proposer.drafter
    assert own_drafter.embed_tokens is not separate.engine.model.model.embed_tokens
    assert own_drafter.lm_head is not separate.engine.model.lm_head
    a = shared.generate([prompt], params, use_tqdm=False)[0]
    b = separate.generate([prompt], params, use_tqdm=False)[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert a.spec_accept_lengths == b.spec_accept_lengths


def test_requests_run_to_max_model_len_in_a_minimal_pool(agreeing_pair, rng) -> None:
    """Verify rows and the drafter's block run past the last token: a pool sized for exactly one
    request at max_model_len (max_num_seqs=1) must still hold it to the end, never preempting
    itself in a loop."""
    target, drafter = agreeing_pair
    engine_args = dict(block_size=4, max_model_len=40, max_num_seqs=1)
    llm = LLM(str(target), speculative_config=spec(drafter, 15), **engine_args)
    engine = llm.engine
    prompt = prompts_for(target, rng)[2]
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    engine.add_request("r", prompt, params)
    finished = []
    for _ in range(200):  # a bounded loop: a self-preemption cycle fails instead of hanging
        finished += [o for o in engine.step() if o.finished]
        if not engine.has_unfinished_requests():
            break
    assert engine.scheduler.num_preemptions == 0 and len(finished) == 1
    ar = LLM(str(target), **engine_args).generate([prompt], params, use_tqdm=False)[0]
    assert finished[0].outputs[0].token_ids == ar.outputs[0].token_ids
    assert len(prompt) + len(ar.outputs[0].token_ids) == 40


# Every way a tensor's values reach the host (each one a sync on a GPU).
READBACKS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


def count_readbacks(monkeypatch) -> list[str]:
    """Patches torch.Tensor's host readbacks to record their names in the returned list."""
    calls: list[str] = []
    for name in READBACKS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            calls.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return calls


def run_counting_readbacks(engine, arrivals: dict[int, list], monkeypatch) -> dict:
    """Steps the engine to the end, adding arrivals[step] = [(id, prompt, params)] before
    that step; asserts each step read the device back once if it produced tokens (the
    verify or sample result the scheduler needs), never otherwise."""
    calls = count_readbacks(monkeypatch)
    outputs, step = {}, 0
    while engine.has_unfinished_requests() or arrivals:
        for request in arrivals.pop(step, []):
            engine.add_request(*request)
        calls.clear()
        produced = engine.step()
        assert len(calls) == (1 if produced else 0), (step, calls)
        outputs.update({o.request_id: o for o in produced if o.finished})
        step += 1
    monkeypatch.undo()
    return outputs


def spy_draft_gathers(monkeypatch) -> list[str]:
    """Records how each verify found its drafts (see verify.gather_drafts)."""
    from blockdraft.spec_decode import verify

    kinds: list[str] = []
    original = verify.shared_draft_batch

    def spy(pending):
        batch, rows = original(pending)
        kinds.append("stacked" if batch is None else "indexed" if rows else "whole")
        return batch, rows

    monkeypatch.setattr(verify, "shared_draft_batch", spy)
    return kinds


def test_one_host_readback_per_speculative_step(agreeing_pair, monkeypatch, rng) -> None:
    """The drafts stay on the device: a speculative step reads back only the verified tokens,
    for one request and for a batch that requests join and leave mid-run, with chunked
    prefill (a verify that does not fit waits, keeping older drafts) and a sampled request
    (draft probabilities) among greedy ones. Greedy outputs match plain decoding and the
    agreeing drafter stays accepted, so every request verified its own drafts."""
    target, drafter = agreeing_pair
    prompts = prompts_for(target, rng)
    greedy = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (9, 30, 40)]
    sampled = SamplingParams(temperature=0.8, max_tokens=21, ignore_eos=True, seed=3)

    llm = LLM(str(target), speculative_config=spec(drafter, 3))
    (out,) = run_counting_readbacks(
        llm.engine, {0: [("a", prompts[2], greedy[1])]}, monkeypatch
    ).values()
    ar = LLM(str(target)).generate([prompts[2]], greedy[1], use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ar.outputs[0].token_ids
    assert len(out.spec_accept_lengths) > 3

    kw = dict(max_num_batched_tokens=20)
    llm = LLM(str(target), speculative_config=spec(drafter, 7), **kw)
    gathers = spy_draft_gathers(monkeypatch)
    # Two 8-row verifies fit the budget of 20, a third waits for one of them to finish.
    arrivals = {
        0: [
            ("g0", prompts[0], greedy[2]),
            ("g1", prompts[1], greedy[0]),
            ("s", prompts[2], sampled),
        ],
        3: [("g2", prompts[3], greedy[1])],
        6: [("g3", prompts[4], greedy[1])],
    }
    expected = {r[0]: (r[1], r[2]) for rs in arrivals.values() for r in rs if r[0] != "s"}
    outs = run_counting_readbacks(llm.engine, arrivals, monkeypatch)
    assert sorted(outs) == ["g0", "g1", "g2", "g3", "s"]
    # The previous step's drafts taken whole, a subset of them, and drafts of several steps.
    assert set(gathers) == {"whole", "indexed", "stacked"}, gathers
    assert len(outs["s"].outputs[0].token_ids) == 21
    ar = LLM(str(target), **kw)
    for rid, (prompt, params) in expected.items():
        want = ar.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        assert outs[rid].outputs[0].token_ids == want, rid
        lengths = outs[rid].spec_accept_lengths
        assert sum(lengths[:-1]) >= 0.8 * 8 * len(lengths[:-1]), (rid, lengths)
