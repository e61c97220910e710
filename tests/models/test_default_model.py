"""The embedded default target (SmolLM2-135M-Instruct GGUF): our engine's logits equal
transformers' on the same weights, and it answers the capital of France with Paris."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from blockdraft import LLM, SamplingParams
from blockdraft.engine.sequence import Sequence
from blockdraft.kernels.forward_context import forward_context
from blockdraft.models.gguf_loader import default_model_path, load_gguf
from blockdraft.runtime.host_batch import build_attention_metadata

pytestmark = pytest.mark.slow  # every test loads the 135M-parameter model


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_model_len=512)


def test_default_model_is_the_gguf(llm: LLM) -> None:
    assert llm.config.model is None
    assert llm.engine.model.cfg.num_layers == 30 and llm.engine.model.cfg.hidden_size == 576


def test_logits_match_transformers(llm: LLM) -> None:
    ckpt = load_gguf(default_model_path())
    cfg = {k: v for k, v in ckpt.hf_config.items() if k != "architectures"}
    ref = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    ref.load_state_dict(ckpt.state_dict, strict=False)
    ref.tie_weights()
    ids = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog because")
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    engine = llm.engine
    seq = Sequence("probe", None, ids, SamplingParams(), 0, 1)
    assert engine.block_manager.ensure_capacity(seq, len(ids))
    meta = build_attention_metadata(
        [seq.block_table], [0], [len(ids)], engine.config.block_size, engine.device
    )
    with torch.inference_mode(), forward_context(meta):
        hidden, _ = engine.model(torch.tensor(ids), torch.arange(len(ids)))
    ours = engine.model.compute_logits(hidden)
    engine.block_manager.free(seq)
    assert ((ours - expected).abs().max() / expected.abs().max()).item() < 1e-4


def test_answers_paris(llm: LLM) -> None:
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=32),
        use_tqdm=False,
    )[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # ended at <|im_end|>
