"""The tokenizer a GGUF carries (byte-level BPE vocabulary, merges and pre-tokenizer name),
rebuilt as a Hugging Face `tokenizers` JSON and `tokenizer_config`, with the end-of-generation
ids llama.cpp would stop on."""

from __future__ import annotations

from typing import Any

from gguf.constants import TokenType
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from blockdraft.models.gguf_reader import FormatError, UnsupportedError, get_meta

# Pre-tokenizer regexes per `tokenizer.ggml.pre`, applied in order as llama.cpp does. Each one
# isolates its matches and leaves the text between them as separate pieces.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DIGIT_SPLIT = r"\p{N}"

# name -> (regexes, ignore_merges). llama.cpp looks a whole pre-token up in the vocabulary
# before merging only for the Llama-3 family, and Hugging Face's `ignore_merges` is the same rule.
_PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool]] = {
    "default": ((_GPT2_SPLIT,), False),
    "gpt-2": ((_GPT2_SPLIT,), False),
    "smollm": ((_DIGIT_SPLIT, _GPT2_SPLIT), False),
    "starcoder": ((_DIGIT_SPLIT, _GPT2_SPLIT), False),
    "refact": ((_DIGIT_SPLIT, _GPT2_SPLIT), False),
    "llama-bpe": ((_LLAMA3_SPLIT,), True),
    "qwen2": ((_QWEN2_SPLIT,), False),
}


def build_tokenizer(metadata: dict[str, Any]) -> tuple[str, dict, list[int]]:
    model = get_meta(metadata, "tokenizer.ggml.model", str)
    if model != "gpt2":
        raise UnsupportedError(
            f"tokenizer model {model!r} is not supported (only 'gpt2', byte-level BPE)"
        )
    pre = get_meta(metadata, "tokenizer.ggml.pre", str, "default")
    if pre not in _PRE_TOKENIZERS:
        raise UnsupportedError(
            f"pre-tokenizer {pre!r} is not supported (supported: {', '.join(_PRE_TOKENIZERS)})"
        )
    regexes, ignore_merges = _PRE_TOKENIZERS[pre]
    tokens = get_meta(metadata, "tokenizer.ggml.tokens", list)
    merges_raw = get_meta(metadata, "tokenizer.ggml.merges", list)
    token_types = get_meta(
        metadata, "tokenizer.ggml.token_type", list, [TokenType.NORMAL] * len(tokens)
    )
    if len(token_types) != len(tokens):
        raise FormatError(f"{len(token_types)} token types for {len(tokens)} tokens")

    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        # A duplicated spelling can only map to one id; keep the first, as a lookup would.
        vocab.setdefault(token, i)
    merges: list[tuple[str, str]] = []
    for merge in merges_raw:
        parts = merge.split(" ") if isinstance(merge, str) else ()
        if len(parts) != 2:
            raise FormatError(f"tokenizer merge {merge!r} is not two tokens")
        merges.append((parts[0], parts[1]))

    try:
        bpe = models.BPE(vocab=vocab, merges=merges, unk_token=None, ignore_merges=ignore_merges)
    except Exception as e:  # the tokenizers library raises its own exception types
        raise FormatError(f"tokenizer vocabulary and merges are inconsistent: {e}") from None
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        # The regexes above already split the text; ByteLevel only maps bytes to its alphabet.
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    # No post-processor: whether to prepend BOS is `add_bos_token`, applied by the caller, so
    # that BOS is never added twice.
    special = [
        AddedToken(t, special=True, normalized=False)
        for t, ty in zip(tokens, token_types, strict=True)
        if ty == TokenType.CONTROL
    ]
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, ty in zip(tokens, token_types, strict=True)
        if ty == TokenType.USER_DEFINED
    ]
    # Control tokens such as <|im_start|> must match whole in raw text, never be BPE-split.
    tok.add_special_tokens(special)
    tok.add_tokens(user)

    def token_text(key: str) -> str | None:
        idx = metadata.get(key)
        if idx is None:
            return None
        if not isinstance(idx, int) or not 0 <= idx < len(tokens):
            raise FormatError(f"metadata {key!r} = {idx!r} is not a token id")
        return tokens[idx]

    eos_id = metadata["tokenizer.ggml.eos_token_id"]
    tokenizer_config = {
        "bos_token": token_text("tokenizer.ggml.bos_token_id"),
        "eos_token": token_text("tokenizer.ggml.eos_token_id"),
        "chat_template": get_meta(metadata, "tokenizer.chat_template", str, None),
        # llama.cpp adds no BOS for byte-level BPE vocabularies unless the file asks for it.
        "add_bos_token": bool(get_meta(metadata, "tokenizer.ggml.add_bos_token", bool, False)),
    }
    return tok.to_str(), tokenizer_config, _eos_token_ids(metadata, tokens, token_types, eos_id)


# Control tokens llama.cpp treats as end-of-generation by their text, besides the ids the file
# names: a chat model ends a turn with <|im_end|> but may also emit <|endoftext|>.
_EOG_TEXTS = frozenset(
    {
        "<|endoftext|>",
        "<|im_end|>",
        "<|eot_id|>",
        "<|eom_id|>",
        "<|end|>",
        "<end_of_turn>",
        "<|end_of_text|>",
    }
)


def _eos_token_ids(
    metadata: dict[str, Any], tokens: list[str], token_types: list[int], eos_id: int
) -> list[int]:
    ids = [eos_id]
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        value = metadata.get(key)
        if isinstance(value, int) and 0 <= value < len(tokens):
            ids.append(value)
    ids += [
        i
        for i, (t, ty) in enumerate(zip(tokens, token_types, strict=True))
        if ty == TokenType.CONTROL and t in _EOG_TEXTS
    ]
    return list(dict.fromkeys(ids))  # dedupe, keeping the file's eos first
