"""The Llama family (Llama, Qwen3 dense) through the paged path equals transformers: prefill and
per-step decode logits."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from blockdraft import LLM
from blockdraft.engine.sequence import Sequence
from blockdraft.kernels.forward_context import forward_context
from blockdraft.runtime.host_batch import build_attention_metadata
from blockdraft.sampling_params import SamplingParams

from checkpoints import make_llama_checkpoint, make_qwen3_checkpoint

CASES = {
    # name: (builder, kwargs) covering tied/untied, llama3 rope scaling, GQA 1/2/4, odd head_dim
    "qwen3-untied-gqa2-hd24": (
        make_qwen3_checkpoint,
        dict(num_heads=4, num_kv_heads=2, head_dim=24, tie_word_embeddings=False),
    ),
    "qwen3-tied-gqa1": (
        make_qwen3_checkpoint,
        dict(num_heads=4, num_kv_heads=4, tie_word_embeddings=True),
    ),
    "llama-llama3rope-gqa4": (
        make_llama_checkpoint,
        dict(num_heads=4, num_kv_heads=1, llama3_rope_scaling=True),
    ),
    "llama-untied-hd8": (
        make_llama_checkpoint,
        dict(
            num_heads=4,
            num_kv_heads=2,
            head_dim=8,
            tie_word_embeddings=False,
            llama3_rope_scaling=False,
        ),
    ),
}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory) -> Path:
    builder, kwargs = CASES[request.param]
    return builder(tmp_path_factory.mktemp(request.param), **kwargs)


def paged_logits(llm: LLM, token_ids: list[int], chunks: list[int]) -> torch.Tensor:
    """Logits at every position, computing the sequence in the given chunk sizes (a chunk of 1
    is a decode step reading the cache)."""
    engine = llm.engine
    seq = Sequence("probe", None, token_ids, SamplingParams(), 0, 1)
    assert engine.block_manager.ensure_capacity(seq, len(token_ids))
    out, start = [], 0
    for n in chunks:
        meta = build_attention_metadata(
            [seq.block_table], [start], [n], engine.config.block_size, engine.device
        )
        with torch.inference_mode(), forward_context(meta):
            hidden, _ = engine.model(
                torch.tensor(token_ids[start : start + n]), torch.arange(start, start + n)
            )
        out.append(engine.model.compute_logits(hidden))
        start += n
    engine.block_manager.free(seq)
    return torch.cat(out)


def test_prefill_and_decode_logits_match_transformers(checkpoint: Path, rng) -> None:
    ref_model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    llm = LLM(str(checkpoint), block_size=4)
    vocab = ref_model.config.vocab_size
    ids = torch.randint(4, vocab, (37,), generator=rng).tolist()
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0]
    # Prefill 21 tokens in chunks of 16 and 5, then decode the rest one token at a time.
    ours = paged_logits(llm, ids, [16, 5] + [1] * 16)
    assert rel_err(ours[:21], ref[:21]) < 1e-4
    assert rel_err(ours[21:], ref[21:]) < 1e-4
