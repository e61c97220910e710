"""The CUDA-graph path's buffer handling (persistent inputs, padding to a batch bucket, PAD
slots, sliced outputs), checked on the CPU through its eager twin: replaying a padded batch
must give what the eager forward gives, and the engine's output must not change."""

from pathlib import Path

import pytest
import torch

from blockdraft import LLM, SamplingParams
from blockdraft.engine.model_runner import run_forward
from blockdraft.kernels.forward_context import forward_context
from blockdraft.runtime.cuda_graph_runner import CUDAGraphRunner

from checkpoints import make_dflash_drafter, make_qwen3_5_checkpoint, make_qwen3_checkpoint


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("graphs")
    target = make_qwen3_checkpoint(root / "target")
    return target, make_dflash_drafter(root / "drafter", target, block_size=8)


def capture_twins(llm: LLM, sizes: list[int]) -> None:
    """What LLMEngine does on a GPU at start, with eager twins on the CPU."""
    llm.engine.capture_graphs(sizes)


def test_padded_replay_equals_eager_forward(pair, rng) -> None:
    target, _ = pair
    llm = LLM(str(target), block_size=4, max_model_len=64)
    engine = llm.engine
    q, num_seqs = 3, 5  # 5 requests replay the bucket of 8
    runner = CUDAGraphRunner(engine.model, q, [2, 8], 16, 4, engine.device)
    runner.capture()
    starts = torch.randint(0, 40, (num_seqs,), generator=rng).tolist()
    tables = []
    for i, start in enumerate(starts):
        needed = -(-(start + q) // 4)
        tables.append([(i * 16 + j) % engine.block_manager.num_blocks for j in range(needed)])
    token_ids = [torch.randint(4, 128, (q,), generator=rng).tolist() for _ in starts]
    with torch.inference_mode():
        runner.graphs[8][1][0].fill_(float("nan"))  # stale outputs must be overwritten
        hidden_graph, _ = run_forward(
            engine.model, {q: runner}, token_ids, starts, tables, 4, engine.device
        )
        hidden_graph = hidden_graph.clone()
        hidden_eager, _ = run_forward(engine.model, {}, token_ids, starts, tables, 4, engine.device)
    assert hidden_graph.shape == hidden_eager.shape == (num_seqs * q, 64)
    torch.testing.assert_close(hidden_graph, hidden_eager, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("speculative", [False, True], ids=["ar", "dflash"])
def test_engine_output_unchanged_with_graph_twins(pair, rng, speculative: bool) -> None:
    target, drafter = pair
    spec = (
        {"method": "dflash", "model": str(drafter), "num_speculative_tokens": 7}
        if speculative
        else None
    )
    prompts = [torch.randint(4, 128, (n,), generator=rng).tolist() for n in (2, 7, 12, 20, 5)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = LLM(str(target), speculative_config=spec, max_model_len=64)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    graphed = LLM(str(target), speculative_config=spec, max_model_len=64)
    capture_twins(graphed, [1, 2, 4, 8])
    calls = []
    engine = graphed.engine
    drafter_graphs = engine.proposer.graphs.values() if engine.proposer else []
    for runner in [*engine.runner.graphs.values(), *drafter_graphs]:
        original = runner.run
        runner.run = lambda *a, _o=original, **k: calls.append(1) or _o(*a, **k)
    outs = graphed.generate(prompts, params, use_tqdm=False)
    assert calls, "no step went through the graph runners"
    assert [o.outputs[0].token_ids for o in outs] == expected


@pytest.mark.parametrize("speculative", [False, True], ids=["ar", "dflash"])
def test_hybrid_engine_output_unchanged_with_graph_twins(tmp_path, rng, speculative) -> None:
    """A hybrid target's decode and verify graphs take the requests' state slots as inputs
    (a verify's states committed after the replay, by a graph of its own); prefill chunks stay
    eager."""
    target = make_qwen3_5_checkpoint(tmp_path / "target")
    spec = None
    if speculative:
        drafter = make_dflash_drafter(tmp_path / "drafter", target, block_size=8)
        spec = {
            "method": "dflash",
            "model": str(drafter),
            "num_speculative_tokens": 5,
            "num_speculative_tokens_by_batch": None,
            "synthetic_acceptance_rate": 0.6,
        }
    prompts = [torch.randint(4, 128, (n,), generator=rng).tolist() for n in (1, 7, 12, 20, 5)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    kw = dict(speculative_config=spec, max_model_len=64)
    plain = LLM(str(target), **kw)
    torch.manual_seed(0)  # synthetic acceptance draws from the global generator
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    graphed = LLM(str(target), **kw)
    capture_twins(graphed, [1, 2, 4, 8])
    runner = graphed.engine.runner
    replays = {q: count_replays(r) for q, r in runner.graphs.items()}
    commits = []
    if speculative:
        original = runner.commit_graphs.run
        runner.commit_graphs.run = lambda s, n: commits.append(len(s)) or original(s, n)
    torch.manual_seed(0)
    outs = graphed.generate(prompts, params, use_tqdm=False)
    assert replays[6 if speculative else 1], replays  # verify steps / decode steps
    assert bool(commits) == speculative
    assert [o.outputs[0].token_ids for o in outs] == expected


def count_replays(runner: CUDAGraphRunner) -> list[int]:
    """Records the number of requests of every replay of `runner`."""
    calls: list[int] = []
    original = runner.run

    def counted(*args, **kwargs):
        calls.append(len(args[3]))  # seq_lens: one per request
        return original(*args, **kwargs)

    runner.run = counted
    return calls


def scheduled_engines(pair, rng, n: int, by_batch: dict[int, int]):
    """Five greedy requests finishing at different lengths, the eager engine's output for them
    with N by batch size, and an engine with graph twins captured at buckets 1, 2, 4, 8."""
    target, drafter = pair
    spec = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": n,
            "num_speculative_tokens_by_batch": by_batch}  # fmt: skip
    prompts = [torch.randint(4, 128, (m,), generator=rng).tolist() for m in (2, 7, 12, 20, 5)]
    params = [
        SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (4, 9, 15, 22, 30)
    ]
    plain = LLM(str(target), speculative_config=spec, max_model_len=64)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    graphed = LLM(str(target), speculative_config=spec, max_model_len=64, max_num_seqs=8)
    capture_twins(graphed, [1, 2, 4, 8])
    return graphed, prompts, params, expected


def test_draft_schedule_replays_a_graph_per_draft_count(pair, rng) -> None:
    """With N by batch size ({1: 7, 3: 3}), verify and drafter graphs are captured for N = 3 at
    the buckets of 3+ requests and for N = 7 at those of 1-2, and requests finishing at
    different lengths replay both without changing the output."""
    graphed, prompts, params, expected = scheduled_engines(pair, rng, 7, {3: 3})
    engine = graphed.engine
    runners = {("target", q): r for q, r in engine.runner.graphs.items()}
    runners |= {("drafter", q): r for q, r in engine.proposer.graphs.items()}
    assert {key: r.batch_sizes for key, r in runners.items()} == {
        ("target", 1): [1, 2, 4, 8],
        ("target", 4): [4, 8],
        ("target", 8): [1, 2],
        ("drafter", 4): [4, 8],
        ("drafter", 8): [1, 2],
    }
    replays = {key: count_replays(runner) for key, runner in runners.items()}
    outs = graphed.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert all(len(replays[(kind, q)]) > 0 for kind in ("target", "drafter") for q in (4, 8))
    # N = 7 drafts are proposed only while at most 2 requests run, so at most 2 verify them.
    assert max(replays[("target", 8)] + replays[("drafter", 8)]) <= 2, replays


def test_no_draft_steps_replay_the_decode_graph(pair, rng) -> None:
    """With no drafts from 3 requests on ({3: 0}), no graph is captured for N = 0: those
    steps replay the decode graph, the others the N = 4 verify and drafter graphs, and the
    output is the eager engine's."""
    graphed, prompts, params, expected = scheduled_engines(pair, rng, 4, {3: 0})
    engine = graphed.engine
    target_sizes = {q: r.batch_sizes for q, r in engine.runner.graphs.items()}
    assert target_sizes == {1: [1, 2, 4, 8], 5: [1, 2]}
    assert {q: r.batch_sizes for q, r in engine.proposer.graphs.items()} == {5: [1, 2]}
    replays = {q: count_replays(r) for q, r in engine.runner.graphs.items()}
    outs = graphed.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert max(replays[1]) >= 3 and replays[5] and max(replays[5]) <= 2, replays


def record_drafts(llm: LLM) -> list[torch.Tensor]:
    proposer = llm.engine.proposer
    seen: list[torch.Tensor] = []
    original = proposer.propose

    def recorded(*args, **kwargs):
        tokens, probs = original(*args, **kwargs)
        seen.append(tokens.clone())
        return tokens, probs

    proposer.propose = recorded
    return seen


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_uniform_steps_write_the_context_inside_the_drafter_graph(
    pair, rng, temperature: float
) -> None:
    """Steps where every request verifies N and proposes N write the context K/V inside the
    drafter graph (its persistent inputs loaded, no eager write); other steps write it eagerly
    and leave the graph's context slots PAD. Every draft equals the eager engine's (greedy, and
    sampled with per-request seeds), so the drafter's cache holds the same K/V either way."""
    target, drafter = pair
    # N pinned: "auto" picks N from step times, which differ between the two engines.
    spec = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": 7,
            "num_speculative_tokens_by_batch": None}  # fmt: skip
    prompts = [torch.randint(4, 128, (n,), generator=rng).tolist() for n in (3, 9, 14)]
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))
    params = [
        SamplingParams(temperature=temperature, seed=seed + i, max_tokens=m, ignore_eos=True)
        for i, m in enumerate((10, 17, 24))
    ]
    plain = LLM(str(target), speculative_config=spec, max_model_len=64)
    expected_drafts = record_drafts(plain)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]

    graphed = LLM(str(target), speculative_config=spec, max_model_len=64, max_num_seqs=4)
    capture_twins(graphed, [1, 2, 4])
    engine = graphed.engine
    ((q, graphed_context),) = engine.proposer.graphed_contexts.items()
    assert q == engine.proposer.drafter.cfg.block_size
    events: list[str] = []
    load, clear = graphed_context.load, graphed_context.clear
    graphed_context.load = lambda *a: events.append("load") or load(*a)
    graphed_context.clear = lambda: events.append("clear") or clear()
    eager_write = engine.proposer.write_context
    engine.proposer.write_context = lambda *a: events.append("eager") or eager_write(*a)
    runner = engine.proposer.graphs[q]
    replay = runner.run
    runner.run = lambda *a: events.append("replay") or replay(*a)
    drafts = record_drafts(graphed)
    outs = graphed.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert len(drafts) == len(expected_drafts)
    for got, want in zip(drafts, expected_drafts, strict=True):
        assert torch.equal(got, want)
    assert events.count("load") > 0 and events.count("eager") > 0, events
    # Every replay writes either this step's context or nothing (slots all PAD): never the
    # rows a former step left in the buffers.
    before_replay = [a for a, b in zip(events, events[1:], strict=False) if b == "replay"]
    assert set(before_replay) <= {"load", "clear"}, events
    assert events.count("replay") == events.count("load") + events.count("clear")


def test_graphed_context_pads_the_rows_it_is_not_given(pair, rng) -> None:
    """A smaller batch after a larger one: the rows past it go back to PAD, so the replay does
    not rewrite the larger batch's context into slots that may have changed hands."""
    from blockdraft.kernels.forward_context import PAD_SLOT_ID
    from blockdraft.spec_decode.graphed_context import GraphedContext

    target, drafter = pair
    llm = LLM(
        str(target),
        speculative_config={"method": "dflash", "model": str(drafter)},
        max_model_len=64,
        dtype="float32",
    )
    graphed = GraphedContext(llm.engine.proposer.drafter, 16, torch.device("cpu"))
    assert torch.all(graphed.slot_mapping == PAD_SLOT_ID)  # a capture writes nothing
    width = graphed.features.shape[1]
    for rows in (12, 5):
        features = torch.randn(rows, width, generator=rng)
        slots = torch.randint(0, 100, (rows,), generator=rng)
        graphed.load(features, torch.arange(rows), slots)
        assert torch.equal(graphed.features[:rows], features)
        assert torch.equal(graphed.slot_mapping[:rows], slots)
        assert torch.all(graphed.slot_mapping[rows:] == PAD_SLOT_ID)
    graphed.clear()
    assert torch.all(graphed.slot_mapping == PAD_SLOT_ID)


def test_decoder_reports_each_layer_where_a_capture_may_cut(pair, rng) -> None:
    """A GPU capture cuts the target's forward into graphs after chosen layers
    (`SegmentedGraph.cut`, called through `AttentionMetadata.after_layer`): the decoder calls
    it after every layer, in order, and the forward's result does not change."""
    target, _ = pair
    llm = LLM(str(target), block_size=4, max_model_len=64)
    engine = llm.engine
    runner = CUDAGraphRunner(engine.model, 1, [2], 16, 4, engine.device)
    ids = torch.randint(4, 128, (2,), generator=rng)
    positions = torch.zeros(2, dtype=torch.int64)
    calls: list[int] = []
    outs = []
    with torch.inference_mode():
        for after_layer in (None, calls.append):
            meta = runner._meta(2)
            meta.after_layer = after_layer
            with forward_context(meta):
                outs.append(engine.model(ids, positions)[0])
    assert calls == list(range(len(engine.model.model.layers)))
    assert torch.equal(outs[0], outs[1])
