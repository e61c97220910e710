"""The DFlash proposer on its own (blockdraft/spec_decode/proposer.py), without an engine: the
drafter inputs it lays out for a step of several requests, the context K/V it writes (committed
rows once each, every other row nothing), and its drafts against a direct drafter forward per
request. Random steps and weights each run (the seed is printed)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from blockdraft.engine.kv_cache import allocate_kv_cache
from blockdraft.kernels.forward_context import PAD_SLOT_ID, forward_context
from blockdraft.layers.linear import fuse_projections
from blockdraft.models.dflash_drafter import load_drafter
from blockdraft.models.llama import DecoderLM
from blockdraft.models.loader import init_dummy_weights, read_json
from blockdraft.models.registry import resolve_architecture
from blockdraft.runtime.host_batch import build_attention_metadata, slots_for_positions
from blockdraft.runtime.sampling_cache import sampling_tensors
from blockdraft.sampling_params import SamplingParams
from blockdraft.spec_decode.proposer import DFlashProposer
from blockdraft.spec_decode.rejection_sampler import sample_drafts

from checkpoints import MASK_ID, make_dflash_drafter, make_qwen3_checkpoint

BLOCK_SIZE = 4  # KV cache block
NUM_BLOCKS = 64
MAX_POSITIONS = 256
POISON = 1.0e4  # in every cache slot before a test writes: a slot still holding it was not


@pytest.fixture(scope="module")
def checkpoint_dirs(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("proposer")
    target = make_qwen3_checkpoint(root / "target")
    return target, make_dflash_drafter(root / "drafter", target, block_size=8)


@pytest.fixture
def proposer(checkpoint_dirs, rng) -> DFlashProposer:
    """A proposer over a drafter with fresh random weights, its KV cache poisoned."""
    target_dir, drafter_dir = checkpoint_dirs
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=rng)))
    hf_config = read_json(target_dir / "config.json")
    target = DecoderLM(resolve_architecture(hf_config).parse_config(hf_config))
    init_dummy_weights(target, std=0.1)
    drafter = load_drafter(
        str(drafter_dir), target, MAX_POSITIONS, torch.float32, torch.device("cpu"), dummy=True
    )
    init_dummy_weights(drafter, std=0.1)
    fuse_projections(drafter)
    allocate_kv_cache(
        drafter.attention_layers, NUM_BLOCKS, BLOCK_SIZE, torch.float32, torch.device("cpu")
    )
    poison(drafter.attention_layers)
    return DFlashProposer(drafter, BLOCK_SIZE)


def poison(layers) -> None:
    for attn in layers:
        attn.key_cache.fill_(POISON)
        attn.value_cache.fill_(POISON)


def caches(proposer: DFlashProposer) -> list[torch.Tensor]:
    """Every cache of the drafter, one row per slot, the PAD block (the last) left out."""
    return [
        cache[:-1].flatten(0, 1).clone()
        for attn in proposer.drafter.attention_layers
        for cache in (attn.key_cache, attn.value_cache)
    ]


@dataclass
class Step:
    """A step of C requests as the proposer sees it, on the host."""

    starts: list[int]  # [C] first position of the chunk
    query_lens: list[int]  # [C] its flat rows
    num_ctx: list[int]  # [C] leading rows of the chunk that are committed
    anchors: list[int]  # [C] the new token after the committed rows
    proposers: list[int]  # requests that draft
    tables: list[list[int]]  # [C] block tables, every one W blocks wide
    num_drafts: int

    @property
    def row_starts(self) -> list[int]:
        return [sum(self.query_lens[:c]) for c in range(len(self.query_lens))]

    @property
    def anchor_positions(self) -> list[int]:
        return [s + n for s, n in zip(self.starts, self.num_ctx, strict=True)]

    @property
    def num_rows(self) -> int:
        return sum(self.query_lens)

    def prepare(self, proposer: DFlashProposer):
        i64 = dict(dtype=torch.int64)
        return proposer.prepare_inputs(
            torch.tensor(self.anchors, **i64),
            torch.tensor(self.anchor_positions, **i64),
            torch.tensor(self.row_starts, **i64),
            torch.tensor(self.num_ctx, **i64),
            torch.tensor(self.proposers, **i64),
            torch.tensor(self.tables, **i64),
            self.num_drafts,
            self.num_rows,
        )

    def committed(self) -> list[tuple[int, int, int]]:
        """(flat row, position, slot) of every committed row."""
        out = []
        for c, (row, start) in enumerate(zip(self.row_starts, self.starts, strict=True)):
            slots = slots_for_positions(
                self.tables[c], range(start, start + self.num_ctx[c]), BLOCK_SIZE
            )
            out += [(row + j, start + j, slot) for j, slot in enumerate(slots)]
        return out


def random_step(
    rng: torch.Generator,
    num_reqs: int,
    num_drafts: int,
    query_lens: list[int] | None = None,
    prefill: bool = False,  # every row committed, from position 0
) -> Step:
    def randint(lo: int, hi: int) -> int:  # lo..hi inclusive
        return int(torch.randint(lo, hi + 1, (1,), generator=rng))

    if query_lens is None:
        query_lens = [randint(1, 6) for _ in range(num_reqs)]
    starts = [0 if prefill else randint(0, 30) for _ in range(num_reqs)]
    # A verify commits its anchor and a prefix of its drafts; rows past them are rejected.
    num_ctx = query_lens if prefill else [randint(1, n) for n in query_lens]
    anchors = [randint(4, 127) for _ in range(num_reqs)]
    width = -(-(max(starts) + max(query_lens) + num_drafts + 1) // BLOCK_SIZE)
    blocks = torch.randperm(NUM_BLOCKS, generator=rng)[: num_reqs * width].tolist()
    tables = [blocks[c * width : (c + 1) * width] for c in range(num_reqs)]
    chosen = torch.rand(num_reqs, generator=rng) < 0.7
    proposers = [c for c in range(num_reqs) if chosen[c]] or [randint(0, num_reqs - 1)]
    return Step(starts, query_lens, num_ctx, anchors, proposers, tables, num_drafts)


@pytest.mark.parametrize("num_drafts", [1, 3, 7])
def test_prepare_inputs_lays_out_blocks_and_context_rows(proposer, rng, num_drafts: int) -> None:
    """Each drafting request's block is [anchor, MASK x N] at positions p .. p+N in its own
    slots, seeing keys 0 .. p+N; each flat target row gets its position and slot when committed,
    PAD otherwise."""
    step = random_step(rng, int(torch.randint(2, 6, (1,), generator=rng)), num_drafts)
    inputs = step.prepare(proposer)
    q = num_drafts + 1
    ids, positions, slots, seq_lens = [], [], [], []
    for c in step.proposers:
        p = step.anchor_positions[c]
        ids += [step.anchors[c]] + [MASK_ID] * num_drafts
        positions += range(p, p + q)
        slots += slots_for_positions(step.tables[c], range(p, p + q), BLOCK_SIZE)
        seq_lens.append(p + q)
    assert inputs.input_ids.tolist() == ids
    assert inputs.positions.tolist() == positions
    assert inputs.slot_mapping.tolist() == slots
    assert inputs.seq_lens.tolist() == seq_lens
    assert inputs.query_start_loc.tolist() == [r * q for r in range(len(step.proposers) + 1)]
    ctx_slots = [PAD_SLOT_ID] * step.num_rows
    ctx_positions = [0] * step.num_rows
    for row, position, slot in step.committed():
        ctx_slots[row], ctx_positions[row] = slot, position
    assert inputs.context_slot_mapping.tolist() == ctx_slots
    assert inputs.context_positions.tolist() == ctx_positions


@torch.inference_mode()
def test_write_context_writes_each_committed_row_once_and_pad_rows_nothing(proposer, rng) -> None:
    """The drafter cache after `write_context` over a step's flat rows is the cache after a
    write of exactly the committed rows: the slots of rejected rows keep what they held."""
    step = random_step(rng, 4, 3)
    width = proposer.drafter.fc.weight.shape[1]
    features = torch.randn(step.num_rows, width, generator=rng)
    proposer.write_context(features, step.prepare(proposer))
    got = caches(proposer)

    poison(proposer.drafter.attention_layers)
    rows, positions, slots = (list(x) for x in zip(*step.committed(), strict=True))
    proposer.drafter.write_context(features[rows], torch.tensor(positions), torch.tensor(slots))
    want = caches(proposer)
    untouched = torch.ones(got[0].shape[0], dtype=torch.bool)
    untouched[slots] = False
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
        assert g[untouched].eq(POISON).all()
        assert g[slots].ne(POISON).any(dim=-1).all()


def direct_draft_logits(proposer: DFlashProposer, step: Step) -> torch.Tensor:  # [R, N, V]
    """Each drafting request's block through the drafter alone, one request per forward."""
    drafter, n = proposer.drafter, step.num_drafts
    logits = []
    for c in step.proposers:
        p = step.anchor_positions[c]
        meta = build_attention_metadata(
            [step.tables[c]], [p], [n + 1], BLOCK_SIZE, torch.device("cpu")
        )
        ids = torch.tensor([step.anchors[c]] + [MASK_ID] * n)
        with forward_context(meta):
            hidden = drafter(ids, torch.arange(p, p + n + 1))
        logits.append(drafter.compute_logits(hidden[1:]))
    return torch.stack(logits)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@torch.inference_mode()
def test_propose_equals_a_direct_drafter_forward(proposer, rng, temperature: float) -> None:
    """After a prefill step writes every request's context, the drafts of the batched propose
    are those sampled from the drafter's logits of each request's block run on its own."""
    num_drafts = 5
    step = random_step(rng, 3, num_drafts, query_lens=[3, 9, 6], prefill=True)
    width = proposer.drafter.fc.weight.shape[1]
    inputs = step.prepare(proposer)
    proposer.write_context(torch.randn(step.num_rows, width, generator=rng), inputs)
    seeds = torch.randint(0, 2**31, (len(step.proposers),), generator=rng).tolist()
    requests = [
        SimpleNamespace(params=SamplingParams(temperature=temperature), seed=s) for s in seeds
    ]
    first = [step.anchor_positions[c] + 1 for c in step.proposers]
    st = sampling_tensors(requests, first, torch.device("cpu"))
    tables = torch.tensor([step.tables[c] for c in step.proposers])
    max_seq_len = max(step.anchor_positions) + num_drafts + 1
    tokens, probs = proposer.propose(inputs, tables, max_seq_len, st, num_drafts)

    logits = direct_draft_logits(proposer, step)
    want_tokens, want_probs = sample_drafts(logits, st)
    assert tokens.shape == (len(step.proposers), num_drafts)
    assert torch.equal(tokens, want_tokens)
    if temperature == 0:
        assert probs is None and torch.equal(tokens, logits.argmax(-1))
    else:
        torch.testing.assert_close(probs, want_probs, rtol=1e-5, atol=1e-6)


@torch.inference_mode()
def test_graphed_block_run_equals_the_eager_one(proposer, rng) -> None:
    """A uniform step (every request verified N and drafts N) through the captured drafter
    graph (its CPU twin), context K/V written inside it, leaves the cache and the block's
    hidden states of the eager run; a batch the graphs do not hold runs eagerly."""
    num_drafts, q = 3, 4
    step = random_step(rng, 3, num_drafts, query_lens=[q] * 3)
    step.proposers = [0, 1, 2]
    tables = torch.tensor(step.tables)
    max_blocks = tables.shape[1]
    width = proposer.drafter.fc.weight.shape[1]
    context = torch.randn(step.num_rows, width, generator=rng)
    inputs = step.prepare(proposer)
    max_seq_len = max(step.anchor_positions) + q
    want = proposer.eager_block(inputs, 3, tables, max_seq_len, context)
    want_caches = caches(proposer)

    poison(proposer.drafter.attention_layers)
    proposer.capture_graphs(num_drafts, [1, 2, 4], max_blocks, None)
    assert list(proposer.graphs) == [q] and list(proposer.graphed_contexts) == [q]
    replays = []
    graph = proposer.graphs[q]
    run = graph.run
    graph.run = lambda *a: replays.append(a[3].shape[0]) or run(*a)
    got = proposer.run_block(inputs, 3, tables, max_seq_len, context)
    assert replays == [3]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(caches(proposer), want_caches, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    wider = torch.cat([tables, tables[:, :1]], dim=1)  # wider than the graphs' block tables
    proposer.run_block(inputs, 3, wider, max_seq_len, context)
    assert replays == [3]
