"""async_decode=True (the next decode step launched before the current one is read back) gives
exactly the outputs of the synchronous engine: tokens, finish reasons, text, prefix-cache hits,
under stops, arrivals, aborts, chunked prefill, preemption and prefix caching."""

from pathlib import Path

import pytest
import torch

from blockdraft import LLM, SamplingParams
from blockdraft.outputs import RequestOutput

from checkpoints import make_qwen3_checkpoint


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return make_qwen3_checkpoint(tmp_path_factory.mktemp("target"))


def random_prompts(rng: torch.Generator, lengths: list[int]) -> list[list[int]]:
    return [torch.randint(4, 128, (n,), generator=rng).tolist() for n in lengths]


def summary(out: RequestOutput) -> tuple:
    c = out.outputs[0]
    return (
        out.request_id,
        c.token_ids,
        c.finish_reason,
        c.stop_reason,
        c.text,
        out.num_cached_tokens,
    )


def engine_pair(target: Path, **kwargs) -> tuple[LLM, LLM]:
    return LLM(str(target), **kwargs), LLM(str(target), async_decode=True, **kwargs)


def assert_same_pool(sync: LLM, pipelined: LLM) -> None:
    """The pool is in the same state: the same prefix cache, and along the free list (the
    order in which blocks are taken, evicting the cached ones) the same cached contents. Ids
    of blocks with no cached contents may differ: the step launched ahead takes fresh blocks
    in another order."""
    a, b = sync.engine.block_manager, pipelined.engine.block_manager
    assert set(a.cached) == set(b.cached)
    assert [a.block_key.get(i) for i in a.free_blocks] == [
        b.block_key.get(i) for i in b.free_blocks
    ]
    assert a.num_free_blocks == b.num_free_blocks == a.num_blocks
    assert pipelined.engine.decode_pipeline.inflight is None


SETUPS = {
    "plain": dict(max_model_len=64),
    "small-blocks": dict(max_model_len=64, block_size=4),
    "chunked-prefill": dict(max_model_len=64, max_num_batched_tokens=16),
    # 16 blocks of 4 tokens for 8 requests of up to 64 tokens: preemption and cache eviction.
    "preemption": dict(max_model_len=64, block_size=4, num_kv_blocks=16),
    "no-prefix-cache": dict(max_model_len=64, enable_prefix_caching=False),
}


@pytest.mark.slow
@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("sampling", ["greedy", "seeded", "eos"])
def test_generate_equals_sync_engine(target: Path, rng, setup: str, sampling: str) -> None:
    sync, pipelined = engine_pair(target, **SETUPS[setup])
    prompts = random_prompts(rng, [1, 3, 8, 15, 17, 30, 40, 5])
    base = dict(
        greedy=dict(temperature=0, ignore_eos=True),
        seeded=dict(temperature=1.0, seed=int(torch.randint(0, 2**31, (1,), generator=rng))),
        eos=dict(temperature=1.5),  # engine-drawn seeds; eos (id 2) ends some requests
    )[sampling]
    # A stop token and a stop string the free-running outputs hit mid-run.
    free = sync.generate(prompts, SamplingParams(max_tokens=30, **base), use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in free]
    stop_id = tokens[1][4] if len(tokens[1]) > 4 else 5
    # (two tokens can decode to no text: special tokens)
    stop_text = (sync.tokenizer.decode(tokens[3][6:8]) if len(tokens[3]) > 8 else "") or "w5"
    params = [
        SamplingParams(max_tokens=1, **base),
        SamplingParams(max_tokens=30, stop_token_ids=[stop_id], **base),
        SamplingParams(max_tokens=2, **base),
        SamplingParams(max_tokens=30, stop=[stop_text], **base),
        SamplingParams(max_tokens=17, **base),
        SamplingParams(max_tokens=40, **base),  # some reach max_model_len
        SamplingParams(max_tokens=7, **base),
        SamplingParams(**base),
    ]
    # The same call on the pipelined engine: both then draw the same engine seeds next, and
    # hold the same prefix cache.
    pipelined.generate(prompts, SamplingParams(max_tokens=30, **base), use_tqdm=False)
    for round in range(2):  # the second round meets the first one's prefix cache
        expected = [summary(o) for o in sync.generate(prompts, params, use_tqdm=False)]
        got = [summary(o) for o in pipelined.generate(prompts, params, use_tqdm=False)]
        assert got == expected
        # Same draws as `free`, so request 1 stops at stop_id, unless that token is the eos
        # (seeded runs do not ignore it), which reports no stop_reason.
        eos = sync.tokenizer.eos_token_id
        if round == 0 and sampling != "eos" and len(tokens[1]) > 4 and stop_id != eos:
            assert expected[1][2:4] == ("stop", stop_id)
    assert_same_pool(sync, pipelined)


def test_arrivals_and_abort_mid_run(target: Path, rng) -> None:
    sync, pipelined = engine_pair(target, max_model_len=64, block_size=4)
    prompts = random_prompts(rng, [5, 9, 3, 20, 12])
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    results = []
    for llm in (sync, pipelined):
        engine, outputs = llm.engine, {}
        engine.add_request("a", prompts[0], params)
        engine.add_request("b", prompts[1], params)
        num_steps = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                assert not (out.request_id == "b" and num_steps >= 8), "aborted b got output"
                outputs[out.request_id] = summary(out)
            num_steps += 1
            if num_steps == 3:
                engine.add_request("c", prompts[2], params)
            if num_steps == 6:
                engine.add_request("d", prompts[3], params)
                engine.add_request("e", prompts[4], params)
            if num_steps == 8:
                if llm is pipelined:  # b has a row in the step launched ahead
                    assert any(
                        c.seq.request_id == "b"
                        for c in engine.decode_pipeline.inflight.launched.chunks
                    )
                engine.abort_request("b")
        results.append(outputs)
    assert results[0] == results[1]
    assert len(results[0]["b"][1]) == 8 and results[0]["b"][2] is None  # stopped at the abort
    assert all(len(results[0][r][1]) == 20 for r in "acde")
    assert_same_pool(sync, pipelined)


def test_abort_of_every_request_in_flight(target: Path, rng) -> None:
    llm = LLM(str(target), max_model_len=64, async_decode=True)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for rid, prompt in zip("ab", random_prompts(rng, [5, 9]), strict=True):
        engine.add_request(rid, prompt, params)
    for _ in range(3):
        engine.step()
    assert engine.decode_pipeline.inflight is not None  # a decode step is launched ahead
    engine.abort_request("a")
    engine.abort_request("b")
    assert not engine.has_unfinished_requests()
    assert engine.step() == []
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_next_step_is_launched_before_the_readback(target: Path, rng, monkeypatch) -> None:
    llm = LLM(str(target), max_model_len=64, async_decode=True)
    runner = llm.engine.runner
    events: list[tuple[str, object]] = []  # (call, the LaunchedStep it made or read)

    def spy(name: str, fn):
        def wrapped(*args):
            step = fn(*args)
            events.append((name, args[0] if name == "finish" else step))
            return step

        monkeypatch.setattr(runner, name, wrapped)

    spy("launch", runner.launch)
    spy("launch_decode_ahead", runner.launch_decode_ahead)
    spy("finish", runner.finish)
    max_tokens = 40
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    out = llm.generate(random_prompts(rng, [6]), params, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == max_tokens
    launches = [(i, s) for i, (name, s) in enumerate(events) if name != "finish"]
    finishes = [(i, s) for i, (name, s) in enumerate(events) if name == "finish"]
    assert len(finishes) == len(launches) == max_tokens  # one readback per step, none wasted

    def launched_at(step) -> int:
        return next(i for i, s in launches if s is step)

    # Step t's readback comes after step t+1's launch: for all but the last step here.
    ahead = sum(any(launched_at(s) < j < i for j, _ in launches) for i, s in finishes)
    assert ahead == max_tokens - 1, [name for name, _ in events]
    assert sum(name == "launch" for name, _ in events) <= 2  # the prefill (and a drain)


def test_shared_prefix_with_prefix_caching(target: Path, rng) -> None:
    sync, pipelined = engine_pair(target, max_model_len=96, block_size=8)
    prefix = random_prompts(rng, [37])[0]
    prompts = [prefix + tail for tail in random_prompts(rng, [3, 11])]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    results = []
    for llm in (sync, pipelined):
        first = llm.generate(prompts[:1], params, use_tqdm=False)
        both = llm.generate(prompts, params, use_tqdm=False)
        results.append([summary(o)[1:] for o in first + both])
    assert results[0] == results[1]
    assert results[0][2][-1] >= 32 and results[0][1][-1] >= 32  # the cached prefix was reused
    assert_same_pool(sync, pipelined)


def test_async_decode_must_be_a_bool_or_auto() -> None:
    from blockdraft.config import EngineConfig

    with pytest.raises(ValueError, match="async_decode"):
        EngineConfig(async_decode="yes")
    # None (the default) resolves by device: on for CUDA, off on the CPU; explicit values stay.
    assert EngineConfig(device="cpu").async_decode is False
    assert EngineConfig(device="cuda", async_decode=None).async_decode is True
    assert EngineConfig(device="cuda", async_decode=False).async_decode is False
    assert EngineConfig(device="cpu", async_decode=True).async_decode is True


def test_a_cached_block_is_not_evicted_for_a_request_that_stops(target: Path, rng) -> None:
    """A full pool: the step launched ahead would need a block holding a cached prefix, for a
    request that stops at the token being read. The synchronous engine never takes that block,
    so neither may the step launched ahead: the prefix stays cached."""
    setup = dict(max_model_len=32, block_size=4, num_kv_blocks=8)
    free = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    reference = LLM(str(target), **setup)
    while True:  # a prompt whose second output token differs from its first
        stopper = random_prompts(rng, [19])[0]
        tokens = reference.generate([stopper], free, use_tqdm=False)[0].outputs[0].token_ids
        if tokens[0] != tokens[1]:
            break
    cached = random_prompts(rng, [8])[0]
    results = []
    for llm in engine_pair(target, **setup):
        # 3 blocks, all full and cached when freed: the free list is 5 fresh blocks, then them.
        first = llm.generate(
            [cached], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False
        )[0]
        # Takes the 5 fresh blocks and stops at position 20, which would need a sixth.
        stop = SamplingParams(
            temperature=0, max_tokens=8, ignore_eos=True, stop_token_ids=[tokens[1]]
        )
        stopped = llm.generate([stopper], stop, use_tqdm=False)[0]
        again = llm.generate([cached + first.outputs[0].token_ids], free, use_tqdm=False)[0]
        results.append([summary(o)[1:] for o in (first, stopped, again)])
        assert stopped.outputs[0].token_ids == tokens[:2]
        assert again.num_cached_tokens == 12  # the 3 blocks of the first request
    assert results[0] == results[1]
