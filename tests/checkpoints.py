"""Tiny random checkpoints in Hugging Face layout, for the engine's tests.

Every builder writes float32 weights on CPU and runs well under a second:

* ``make_qwen3_checkpoint`` / ``make_llama_checkpoint``: random ``Qwen3ForCausalLM`` /
  ``LlamaForCausalLM`` targets (``config.json``, safetensors weights, optionally in two shards,
  tokenizer files and ``generation_config.json``).
* ``make_qwen3_moe_checkpoint``: a random ``Qwen3MoeForCausalLM`` (experts one tensor each, as
  ``save_pretrained`` writes them, or stacked).
* ``make_qwen3_5_checkpoint``: a random hybrid ``Qwen3_5ForCausalLM`` (Gated DeltaNet and
  gated full-attention layers).
* ``make_hybrid_moe_checkpoint``: a random hybrid MoE target, ``Qwen3_5MoeForCausalLM`` or
  ``Qwen3NextForCausalLM`` (routed experts and a gated shared expert).
* ``make_predictable_target``: a target whose greedy continuation is a fixed token cycle
  (``predictable_next_token``), the partner of an agreeing drafter.
* ``make_dflash_drafter``: a z-lab format DFlash drafter (``DFlashDraftModel``) for a target;
  random, or (``agree_with_target=True``) hand-built so that a predictable target accepts its
  whole block.

and the z-lab reference (``dflash.model``) is wrapped for comparisons:
``load_zlab_drafter``, ``zlab_generate``, ``zlab_first_draft_logits``.

Token ids of every tokenizer here: 0 ``<pad>``, 1 ``<bos>``, 2 ``<eos>``, 3 ``<mask>``, then the
words ``w4``, ``w5``, ... up to ``vocab_size - 1``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from unittest import mock

import torch
from safetensors.torch import load_file, save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen3_5ForCausalLM,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

if TYPE_CHECKING:
    from dflash.model import DFlashDraftModel

PAD_ID, BOS_ID, EOS_ID, MASK_ID = 0, 1, 2, 3
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<mask>")
FIRST_WORD_ID = len(SPECIAL_TOKENS)
MAX_POSITION_EMBEDDINGS = 512
ROPE_THETA = 10000.0
LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small enough that at head_dim 16 and theta 1e4 some frequencies are slowed down and
    # some are blended: the scaling changes the rotary table at these sizes.
    "original_max_position_embeddings": 64,
}
CHAT_TEMPLATE = (
    "{% for m in messages %}w4 {{ m['content'] }} w5 {% endfor %}"
    "{% if add_generation_prompt %}w6{% endif %}"
)
RANDOM_INIT_STD = 0.1  # transformers' 0.02 gives near-uniform logits at these widths

RopeConfigStyle = Literal["legacy", "rope_parameters"]


# ---------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------


def make_tokenizer_files(out_dir: Path, vocab_size: int) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` for a word-level vocabulary.

    Ids 0..3 are the special tokens ``<pad> <bos> <eos> <mask>``; id ``i >= 4`` is the word
    ``w{i}``. Text is split on whitespace (and punctuation); unknown words encode to ``<pad>``;
    decoding joins tokens with single spaces. The chat template wraps each message as
    ``w4 {content} w5`` and ends with ``w6`` when a generation prompt is requested.
    """
    if vocab_size < 8:
        raise ValueError("vocab_size must be at least 8 (4 special tokens + chat words w4..w6)")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"w{i}": i for i in range(FIRST_WORD_ID, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "unk_token": "<pad>",
        "add_bos_token": False,
        "model_max_length": MAX_POSITION_EMBEDDINGS,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


# ---------------------------------------------------------------------------
# Targets
# ---------------------------------------------------------------------------


@contextlib.contextmanager
def _seeded(seed: int | None) -> Iterator[None]:
    """Seed torch's global RNG inside the block and restore it afterwards (no-op for None)."""
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _rewrite_config(out_dir: Path, style: RopeConfigStyle) -> None:
    """Rewrite ``config.json`` with its rope keys in the chosen style.

    transformers 5 saves ``rope_parameters`` (theta inside). Hub checkpoints made with
    transformers 4 carry top-level ``rope_theta`` and ``rope_scaling`` (null when unscaled):
    ``style="legacy"`` writes that form, which transformers 5 still reads.
    """
    path = out_dir / "config.json"
    cfg = json.loads(path.read_text())
    if style == "legacy" and "rope_parameters" in cfg:
        params = dict(cfg.pop("rope_parameters") or {})
        cfg["rope_theta"] = params.pop("rope_theta", ROPE_THETA)
        cfg["rope_scaling"] = params if params.get("rope_type", "default") != "default" else None
    elif style not in ("legacy", "rope_parameters"):
        raise ValueError(f"unknown rope config style {style!r}")
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _shard_in_two(out_dir: Path) -> None:
    """Split ``model.safetensors`` into two shards plus ``model.safetensors.index.json``."""
    single = out_dir / "model.safetensors"
    tensors = load_file(single)
    names = list(tensors)
    sizes = [tensors[n].numel() * tensors[n].element_size() for n in names]
    total, running, cut = sum(sizes), 0, 1
    for i, size in enumerate(sizes[:-1]):
        running += size
        cut = i + 1
        if running >= total / 2:
            break
    parts = [names[:cut], names[cut:]]
    weight_map: dict[str, str] = {}
    for i, part in enumerate(parts, start=1):
        file = f"model-{i:05d}-of-00002.safetensors"
        save_file({n: tensors[n].contiguous() for n in part}, out_dir / file, {"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    single.unlink()


def _save_target(
    model: PreTrainedModel,
    out_dir: Path,
    *,
    vocab_size: int,
    shard: bool,
    rope_config_style: RopeConfigStyle,
) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    if shard:
        _shard_in_two(out_dir)
    _rewrite_config(out_dir, rope_config_style)
    make_tokenizer_files(out_dir, vocab_size)
    generation = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return out_dir


def _save_stacked_experts(model: PreTrainedModel, out_dir: Path, tied: bool) -> None:
    """Rewrites the checkpoint from the model's own state dict: its experts as the stacked
    `experts.gate_up_proj` / `down_proj` tensors the module holds, not save_pretrained's
    per-expert conversion (a tied LM head left out, as save_pretrained does)."""
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if tied:
        state.pop("lm_head.weight")
    save_file(state, out_dir / "model.safetensors", {"format": "pt"})


def _common_config(
    *,
    vocab_size: int,
    hidden_size: int,
    intermediate_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    tie_word_embeddings: bool,
) -> dict[str, Any]:
    return {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "rms_norm_eps": 1e-6,
        "initializer_range": RANDOM_INIT_STD,
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "dtype": "float32",
    }


def _qwen3_model(
    *,
    vocab_size: int,
    hidden_size: int,
    intermediate_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    tie_word_embeddings: bool,
    seed: int | None,
) -> Qwen3ForCausalLM:
    config = Qwen3Config(
        **_common_config(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            tie_word_embeddings=tie_word_embeddings,
        ),
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        max_window_layers=num_layers,
    )
    with _seeded(seed):
        return Qwen3ForCausalLM(config).float().eval()


def _qwen3_moe_model(
    *,
    vocab_size: int,
    hidden_size: int,
    intermediate_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    tie_word_embeddings: bool,
    seed: int | None,
    num_experts: int = 8,
    top_k: int = 2,
    moe_intermediate_size: int = 32,
    norm_topk_prob: bool = True,
    decoder_sparse_step: int = 1,
    mlp_only_layers: tuple[int, ...] = (),
) -> Qwen3MoeForCausalLM:
    config = Qwen3MoeConfig(
        **_common_config(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            tie_word_embeddings=tie_word_embeddings,
        ),
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=moe_intermediate_size,
        norm_topk_prob=norm_topk_prob,
        decoder_sparse_step=decoder_sparse_step,
        mlp_only_layers=list(mlp_only_layers),
    )
    with _seeded(seed):
        return Qwen3MoeForCausalLM(config).float().eval()


def _llama_model(
    *,
    vocab_size: int,
    hidden_size: int,
    intermediate_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    tie_word_embeddings: bool,
    llama3_rope_scaling: bool,
    seed: int | None,
) -> LlamaForCausalLM:
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": ROPE_THETA}
    if llama3_rope_scaling:
        rope = {**LLAMA3_ROPE_SCALING, "rope_theta": ROPE_THETA}
    config = LlamaConfig(
        **_common_config(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            tie_word_embeddings=tie_word_embeddings,
        ),
        rope_parameters=rope,
    )
    with _seeded(seed):
        return LlamaForCausalLM(config).float().eval()


def make_qwen3_checkpoint(
    out_dir: Path,
    *,
    vocab_size: int = 128,
    hidden_size: int = 64,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 24,
    intermediate_size: int = 128,
    tie_word_embeddings: bool = False,
    shard: bool = False,
    rope_config_style: RopeConfigStyle = "legacy",
    seed: int | None = None,
) -> Path:
    """A random ``Qwen3ForCausalLM`` (q/k norms, head_dim independent of hidden_size).

    Weights are drawn with std 0.1 so logits are far from uniform. ``shard=True`` writes two
    safetensors shards and ``model.safetensors.index.json``. ``rope_config_style="legacy"``
    writes ``rope_theta``/``rope_scaling`` like Hub checkpoints, ``"rope_parameters"`` keeps
    the transformers 5 form.
    """
    model = _qwen3_model(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        tie_word_embeddings=tie_word_embeddings,
        seed=seed,
    )
    return _save_target(
        model, out_dir, vocab_size=vocab_size, shard=shard, rope_config_style=rope_config_style
    )


def make_llama_checkpoint(
    out_dir: Path,
    *,
    vocab_size: int = 128,
    hidden_size: int = 64,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 1,
    head_dim: int | None = None,
    intermediate_size: int = 128,
    tie_word_embeddings: bool = True,
    llama3_rope_scaling: bool = True,
    shard: bool = False,
    rope_config_style: RopeConfigStyle = "legacy",
    seed: int | None = None,
) -> Path:
    """A random ``LlamaForCausalLM``; by default tied embeddings and Llama-3 rope scaling.

    ``head_dim=None`` means ``hidden_size // num_heads``. The Llama-3 scaling (factor 8, original
    context 64) really changes the rotary frequencies at head_dim 16. Other options as in
    ``make_qwen3_checkpoint``.
    """
    model = _llama_model(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim if head_dim is not None else hidden_size // num_heads,
        tie_word_embeddings=tie_word_embeddings,
        llama3_rope_scaling=llama3_rope_scaling,
        seed=seed,
    )
    return _save_target(
        model, out_dir, vocab_size=vocab_size, shard=shard, rope_config_style=rope_config_style
    )


def make_qwen3_moe_checkpoint(
    out_dir: Path,
    *,
    vocab_size: int = 128,
    hidden_size: int = 48,
    num_layers: int = 3,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 96,
    num_experts: int = 8,
    top_k: int = 2,
    moe_intermediate_size: int = 32,
    norm_topk_prob: bool = True,
    decoder_sparse_step: int = 1,
    mlp_only_layers: tuple[int, ...] = (),
    tie_word_embeddings: bool = False,
    stacked_experts: bool = False,
    shard: bool = False,
    seed: int | None = None,
) -> Path:
    """A random ``Qwen3MoeForCausalLM``: layer i routes over ``num_experts`` experts (top
    ``top_k``) unless ``(i + 1) % decoder_sparse_step`` or i is in ``mlp_only_layers`` (then a
    dense MLP of ``intermediate_size``). ``save_pretrained`` writes one tensor per expert
    (``mlp.experts.E.{gate,up,down}_proj.weight``); ``stacked_experts=True`` rewrites the
    weights with transformers' in-memory names (``mlp.experts.gate_up_proj`` [E, 2I, H],
    ``mlp.experts.down_proj``), which transformers loads too."""
    model = _qwen3_moe_model(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        tie_word_embeddings=tie_word_embeddings,
        seed=seed,
        num_experts=num_experts,
        top_k=top_k,
        moe_intermediate_size=moe_intermediate_size,
        norm_topk_prob=norm_topk_prob,
        decoder_sparse_step=decoder_sparse_step,
        mlp_only_layers=mlp_only_layers,
    )
    out_dir = _save_target(
        model, out_dir, vocab_size=vocab_size, shard=False, rope_config_style="legacy"
    )
    if stacked_experts:
        _save_stacked_experts(model, out_dir, tie_word_embeddings)
    if shard:
        _shard_in_two(out_dir)
    return out_dir


HYBRID_LAYER_TYPES = ("linear_attention", "full_attention", "linear_attention", "linear_attention")


def _qwen3_5_model(
    *,
    vocab_size: int,
    hidden_size: int,
    intermediate_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    tie_word_embeddings: bool,
    seed: int | None,
    layer_types: tuple[str, ...] | None = None,
    linear_heads: tuple[int, int] = (2, 4),
    linear_head_dim: int = 8,
    randomize_norms: bool = True,
    config_class: type = Qwen3_5TextConfig,
    model_class: type = Qwen3_5ForCausalLM,
    **family_config: Any,  # the family's own config fields (its MoE fields)
) -> PreTrainedModel:
    """A random hybrid transformers model: Qwen3.5 by default, or the family of
    ``config_class`` / ``model_class`` (Qwen3.5-MoE, Qwen3-Next; ``intermediate_size=0``: the
    family has no such field)."""
    layer_types = layer_types or (HYBRID_LAYER_TYPES * num_layers)[:num_layers]
    common = _common_config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        tie_word_embeddings=tie_word_embeddings,
    )
    if not intermediate_size:
        del common["intermediate_size"]
    config = config_class(
        **common,
        **family_config,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": ROPE_THETA,
            "partial_rotary_factor": 0.25,
        },
        layer_types=list(layer_types),
        linear_num_key_heads=linear_heads[0],
        linear_num_value_heads=linear_heads[1],
        linear_key_head_dim=linear_head_dim,
        linear_value_head_dim=linear_head_dim,
        linear_conv_kernel_dim=4,
    )
    with _seeded(seed):
        model = model_class(config).float().eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("A_log"):  # decays that keep a few tokens in the state
                    p.copy_(torch.empty_like(p).uniform_(0.05, 0.8).log())
                elif name.endswith("dt_bias"):
                    p.normal_(0.0, 0.5)
                elif randomize_norms and name.endswith("linear_attn.norm.weight"):
                    p.copy_(1.0 + 0.2 * torch.randn_like(p))
                elif randomize_norms and name.endswith("norm.weight"):  # offsets from one
                    p.normal_(0.0, 0.2)
    return model


def make_qwen3_5_checkpoint(
    out_dir: Path,
    *,
    vocab_size: int = 128,
    hidden_size: int = 64,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 96,
    layer_types: tuple[str, ...] | None = None,
    linear_heads: tuple[int, int] = (2, 4),
    linear_head_dim: int = 8,
    tie_word_embeddings: bool = False,
    seed: int | None = None,
) -> Path:
    """A random ``Qwen3_5ForCausalLM``: ``layer_types`` (default linear, full, linear,
    linear, ...) mixes Gated DeltaNet and gated full attention (partial rotary 0.25);
    ``linear_heads`` = (key heads, value heads) of the linear layers. Decays (``A_log``,
    ``dt_bias``) keep a few tokens in the recurrent state, and the norm weights are drawn
    around their identity so that a norm applied the wrong way shows."""
    model = _qwen3_5_model(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        tie_word_embeddings=tie_word_embeddings,
        seed=seed,
        layer_types=layer_types,
        linear_heads=linear_heads,
        linear_head_dim=linear_head_dim,
    )
    return _save_target(
        model, out_dir, vocab_size=vocab_size, shard=False, rope_config_style="rope_parameters"
    )


HYBRID_MOE_FAMILIES = {
    # family -> (config class, model class)
    "qwen3_5_moe": (Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM),
    "qwen3_next": (Qwen3NextConfig, Qwen3NextForCausalLM),
}


def make_hybrid_moe_checkpoint(
    out_dir: Path,
    family: str = "qwen3_5_moe",
    *,
    vocab_size: int = 128,
    hidden_size: int = 48,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    layer_types: tuple[str, ...] | None = None,
    linear_heads: tuple[int, int] = (2, 4),
    num_experts: int = 8,
    top_k: int = 2,
    moe_intermediate_size: int = 16,
    shared_expert_intermediate_size: int = 24,
    intermediate_size: int = 40,  # qwen3_next's dense layers
    norm_topk_prob: bool = True,  # qwen3_next only
    decoder_sparse_step: int = 1,  # qwen3_next only
    mlp_only_layers: tuple[int, ...] = (),  # qwen3_next only
    tie_word_embeddings: bool = False,
    stacked_experts: bool = False,
    seed: int | None = None,
) -> Path:
    """A random hybrid MoE target: ``family`` "qwen3_5_moe" (``Qwen3_5MoeForCausalLM``, every
    layer routed, top-k renormalised) or "qwen3_next" (``Qwen3NextForCausalLM``: per-key-head
    ``in_proj_qkvz`` / ``in_proj_ba``, dense layers by ``decoder_sparse_step`` /
    ``mlp_only_layers``), each MoE layer with a gated shared expert. ``save_pretrained`` writes
    one tensor per expert; ``stacked_experts=True`` rewrites the weights with the in-memory
    names (``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj``)."""
    config_class, model_class = HYBRID_MOE_FAMILIES[family]
    moe = dict(
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=moe_intermediate_size,
        shared_expert_intermediate_size=shared_expert_intermediate_size,
    )
    if family == "qwen3_next":
        moe.update(
            norm_topk_prob=norm_topk_prob,
            decoder_sparse_step=decoder_sparse_step,
            mlp_only_layers=list(mlp_only_layers),
        )
    model = _qwen3_5_model(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size if family == "qwen3_next" else 0,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        tie_word_embeddings=tie_word_embeddings,
        seed=seed,
        layer_types=layer_types,
        linear_heads=linear_heads,
        config_class=config_class,
        model_class=model_class,
        **moe,
    )
    out_dir = _save_target(
        model, out_dir, vocab_size=vocab_size, shard=False, rope_config_style="rope_parameters"
    )
    if stacked_experts:
        _save_stacked_experts(model, out_dir, tie_word_embeddings)
    return out_dir


def predictable_next_token(token: int, vocab_size: int) -> int:
    """The greedy successor of ``token`` under ``make_predictable_target``.

    Words cycle ``w4 -> w5 -> ... -> w{vocab_size-1} -> w4``; the special tokens lead to ``w4``.
    ``<eos>`` is never produced, so generation runs to ``max_tokens`` unless a word is made a
    stop token.
    """
    if token < FIRST_WORD_ID:
        return FIRST_WORD_ID
    return FIRST_WORD_ID + (token - FIRST_WORD_ID + 1) % (vocab_size - FIRST_WORD_ID)


def predictable_continuation(prompt_ids: list[int], n: int, vocab_size: int) -> list[int]:
    """The ``n`` greedy tokens a ``make_predictable_target`` target generates after a prompt."""
    out, token = [], prompt_ids[-1]
    for _ in range(n):
        token = predictable_next_token(token, vocab_size)
        out.append(token)
    return out


def make_predictable_target(
    out_dir: Path,
    *,
    arch: Literal["qwen3", "llama", "qwen3_moe", "qwen3_5"] = "qwen3",
    vocab_size: int = 64,
    hidden_size: int = 64,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 128,
    layer_output_scale: float = 0.05,
    shard: bool = False,
    rope_config_style: RopeConfigStyle = "legacy",
    seed: int | None = None,
) -> Path:
    """A target whose greedy next token is ``predictable_next_token(current token)``.

    Built from a random model of the chosen architecture (``llama`` gets Llama-3 rope scaling,
    ``qwen3_moe`` routes every layer's MLP over 8 experts, top 2;
    ``qwen3_5`` is the hybrid one, its linear layers' ``out_proj`` scaled like ``o_proj``):

    * ``embed_tokens`` is the identity: token ``t`` enters the residual stream as one-hot
      ``e_t`` (needs ``hidden_size >= vocab_size``).
    * every attention ``o_proj`` and MLP (or experts') ``down_proj`` keeps its random weights times
      ``layer_output_scale``: the layers still read the context and the KV cache (so cache bugs
      show up as changed hidden states and logits), but they only nudge the residual stream.
    * ``lm_head`` maps dimension ``t`` to the logit of ``predictable_next_token(t)`` (a
      permutation-like matrix, plus a little noise so the other logits are not all equal).

    After the final RMSNorm the hidden state is ~``sqrt(hidden) * e_t``, so the successor's
    logit is ~8 while every other logit stays well below: greedy decoding follows the cycle
    regardless of context. Embeddings are never tied (the head is not the embedding's
    transpose). Use ``make_dflash_drafter(..., agree_with_target=True)`` for its drafter.
    """
    if hidden_size < vocab_size:
        raise ValueError("a predictable target needs hidden_size >= vocab_size")
    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "tie_word_embeddings": False,
        "seed": seed,
    }
    model: PreTrainedModel
    if arch == "qwen3":
        model = _qwen3_model(**common)
    elif arch == "llama":
        model = _llama_model(**common, llama3_rope_scaling=True)
    elif arch == "qwen3_moe":
        model = _qwen3_moe_model(**common)
    elif arch == "qwen3_5":
        model = _qwen3_5_model(**common, randomize_norms=False)
    else:
        raise ValueError(f"arch must be 'qwen3', 'llama', 'qwen3_moe' or 'qwen3_5', got {arch!r}")
    with torch.no_grad(), _seeded(None if seed is None else seed + 1):
        embed = torch.zeros(vocab_size, hidden_size)
        embed[:, :vocab_size] = torch.eye(vocab_size)
        model.get_input_embeddings().weight.copy_(embed)
        head = 0.01 * torch.randn(vocab_size, hidden_size)
        for t in range(vocab_size):
            head[predictable_next_token(t, vocab_size), t] = 1.0
        model.get_output_embeddings().weight.copy_(head)
        for layer in model.model.layers:
            mixer = getattr(layer, "self_attn", None)
            out_proj = mixer.o_proj if mixer is not None else layer.linear_attn.out_proj
            out_proj.weight.mul_(layer_output_scale)
            experts = getattr(layer.mlp, "experts", None)
            down = layer.mlp.down_proj.weight if experts is None else experts.down_proj
            down.mul_(layer_output_scale)
    if arch == "qwen3_5":  # its partial rotary factor lives in rope_parameters
        rope_config_style = "rope_parameters"
    return _save_target(
        model, out_dir, vocab_size=vocab_size, shard=shard, rope_config_style=rope_config_style
    )


# ---------------------------------------------------------------------------
# DFlash drafters
# ---------------------------------------------------------------------------


def _read_config(model_dir: Path) -> dict[str, Any]:
    return json.loads((Path(model_dir) / "config.json").read_text())


def _read_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    model_dir = Path(model_dir)
    single = model_dir / "model.safetensors"
    if single.is_file():
        return load_file(single)
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(model_dir / file))
    return tensors


def make_dflash_drafter(
    out_dir: Path,
    target_dir: Path,
    *,
    num_layers: int = 2,
    block_size: int = 16,
    target_layer_ids: list[int] | None = None,
    sliding_window: int | None = None,
    layer_types: list[str] | None = None,
    mask_token_id: int = MASK_ID,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 128,
    rope_config_style: RopeConfigStyle = "legacy",
    seed: int | None = None,
    agree_with_target: bool = False,
    draft_error_rate: float = 0.0,
) -> Path:
    """A z-lab format DFlash drafter for the target checkpoint at ``target_dir``.

    ``config.json`` is a Qwen3 config with ``architectures: ["DFlashDraftModel"]``, the
    target's ``hidden_size``/``vocab_size``, ``num_target_layers``, ``block_size`` and
    ``dflash_config: {mask_token_id, target_layer_ids}`` (``target_layer_ids=None``: z-lab's
    ``build_target_layer_ids`` default, written out explicitly). ``model.safetensors`` holds
    ``layers.{i}.*``, ``fc.weight``, ``hidden_norm.weight`` and ``norm.weight``; the drafter
    borrows the target's embedding and lm_head. Weights are z-lab's ``DFlashDraftModel``
    random init (std 0.1).

    Sliding layers: pass ``sliding_window`` and ``layer_types`` (``"sliding_attention"`` /
    ``"full_attention"``); with only ``sliding_window`` the layers alternate sliding, full, ...
    In z-lab's drafter a full-attention layer is *non-causal* (the whole context and block),
    a sliding layer is causal and sees the last ``sliding_window`` positions (itself included).

    ``agree_with_target=True`` hand-builds the weights for a ``make_predictable_target``
    target (raises ``ValueError`` for any other target). It then ignores ``num_heads``,
    ``num_kv_heads`` and ``head_dim``; see ``_agreeing_weights`` for how it works.
    Under z-lab's greedy ``dflash_generate`` every draft is accepted: each step commits
    ``block_size`` tokens. ``draft_error_rate > 0`` makes each (offset, anchor token) pair
    draft a wrong word with that probability (drawn from ``seed``): acceptance lengths then
    vary from step to step, deterministically, with rejections inside the block.
    """
    from dflash.model import DFlashDraftModel, build_target_layer_ids

    out_dir = Path(out_dir)
    target_cfg = _read_config(target_dir)
    num_target_layers = int(target_cfg["num_hidden_layers"])
    hidden_size = int(target_cfg["hidden_size"])
    vocab_size = int(target_cfg["vocab_size"])
    if target_layer_ids is None:
        target_layer_ids = build_target_layer_ids(num_target_layers, num_layers)
    target_layer_ids = [int(i) for i in target_layer_ids]
    if any(not 0 <= i < num_target_layers for i in target_layer_ids):
        raise ValueError(f"target_layer_ids {target_layer_ids} out of range")
    if layer_types is None:
        layer_types = [
            "sliding_attention" if sliding_window is not None and i % 2 == 0 else "full_attention"
            for i in range(num_layers)
        ]
    if len(layer_types) != num_layers:
        raise ValueError("layer_types needs one entry per drafter layer")
    use_sliding = "sliding_attention" in layer_types
    if use_sliding and sliding_window is None:
        raise ValueError("sliding_attention layers need a sliding_window")
    if agree_with_target:
        num_heads, num_kv_heads = block_size - 1, 1
        head_dim = max(8, vocab_size + vocab_size % 2)
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=int(target_cfg.get("max_position_embeddings", 512)),
        rms_norm_eps=1e-6,
        initializer_range=RANDOM_INIT_STD,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        use_sliding_window=use_sliding,
        sliding_window=sliding_window if use_sliding else None,
        max_window_layers=num_layers,
        layer_types=list(layer_types),
        tie_word_embeddings=False,
        bos_token_id=target_cfg.get("bos_token_id"),
        eos_token_id=target_cfg.get("eos_token_id"),
        dtype="float32",
        num_target_layers=num_target_layers,
        block_size=block_size,
        dflash_config={"mask_token_id": mask_token_id, "target_layer_ids": target_layer_ids},
    )
    with _seeded(seed):
        model = DFlashDraftModel(config).float().eval()
    if agree_with_target:
        rng = torch.Generator().manual_seed(0 if seed is None else seed)
        _agreeing_weights(
            model, _read_tensors(target_dir), target_cfg, mask_token_id, draft_error_rate, rng
        )
    elif draft_error_rate:
        raise ValueError("draft_error_rate needs agree_with_target=True")
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(state, out_dir / "model.safetensors", {"format": "pt"})
    config.architectures = ["DFlashDraftModel"]
    config.save_pretrained(out_dir)
    _rewrite_config(out_dir, rope_config_style)
    return out_dir


def _separating_planes(inv_freq: torch.Tensor, block_size: int) -> tuple[list[int] | None, float]:
    """Rotary planes whose averaged ``cos(n * theta)`` peaks sharpest at ``n = 0``.

    Returns the planes (up to three of the six fastest, never the slowest) minimising
    ``c_max = max over 1 <= n <= block_size - 2 of mean_i cos(n * theta_i)``, and ``c_max``;
    ``None`` when no choice gets ``c_max`` below 0.95.
    """
    n = torch.arange(1, max(block_size - 1, 2), dtype=torch.float64)[:, None]
    cos = torch.cos(n * inv_freq.double()[None, :])  # [offsets, planes]
    candidates = range(min(6, inv_freq.numel() - 1))
    best: tuple[list[int] | None, float] = (None, 0.95)
    for size in (1, 2, 3):
        for planes in itertools.combinations(candidates, size):
            c_max = float(cos[:, list(planes)].mean(dim=1).max())
            if c_max < best[1] - 1e-9:
                best = (list(planes), c_max)
    return best


def _agreeing_weights(
    model: DFlashDraftModel,
    target: dict[str, torch.Tensor],
    target_cfg: dict[str, Any],
    mask_token_id: int,
    error_rate: float = 0.0,
    rng: torch.Generator | None = None,
) -> None:
    """Hand-set ``model``'s weights so its drafts match a predictable target's greedy output.

    The predictable target embeds token ``t`` as one-hot ``e_t`` and its lm_head maps ``e_t``
    to ``f(t) = predictable_next_token(t)``. The block the drafter sees is
    ``[anchor a, <mask>, ..., <mask>]`` (target embeddings), and offset ``k`` must predict
    ``f^k(a)``, i.e. hold ``e_{f^{k-1}(a)}`` before the target's lm_head. One attention layer
    does it with one query head per offset (``block_size - 1`` heads, one shared KV head):

    * keys: any non-mask token gets a unit key spread over one to three fast rotary planes
      (``_separating_planes``: for block 16 and head_dim 64 the planes turning 1 and 0.75 rad
      per position); ``<mask>`` gets a unit key in the slowest plane (nearly position
      independent); the context is switched off (``fc = 0``: context keys and values are 0).
    * queries: only ``<mask>`` has one; head ``h`` puts phase ``-h*theta_i`` in each chosen
      plane and a constant in the slow plane. RoPE turns the anchor score of the mask at
      offset ``k`` into ``M mean_i cos((k - h) theta_i)``: ``M`` when ``k == h``, at most
      ``M c_max`` otherwise (``c_max = 0.64`` for block 16), while every mask key scores
      ``c0 M`` with ``c0 = (1 + c_max) / 2`` (q/k-norm weights set the scales; both margins
      are 18 nats). So head ``h`` attends to the anchor exactly at offset ``h`` and to the
      masks, whose values are zero, everywhere else.
    * values: the anchor's normalised embedding ``sqrt(hidden) e_a``; head ``h``'s block of
      ``o_proj`` maps ``e_a -> e_{f^{h-1}(a)}`` (a power of the successor permutation),
      scaled so it dwarfs the ``<mask>`` embedding left in the residual.
    * the MLPs and all other layers output zero (``down_proj = 0``, ``o_proj = 0``), and the
      final norm weight is one.

    Offset ``k`` therefore leaves the drafter as ~``e_{f^{k-1}(a)}`` and the target's
    lm_head drafts ``f^k(a)``: the whole block is accepted whatever the context. With
    ``error_rate`` some ``o_proj`` entries point to a different word instead.
    """
    vocab = int(target_cfg["vocab_size"])
    hidden = int(target_cfg["hidden_size"])
    embed = target["model.embed_tokens.weight"].float()
    head = target.get("lm_head.weight", embed).float()
    if hidden < vocab or not torch.allclose(embed[:, :vocab], torch.eye(vocab), atol=1e-6):
        raise ValueError("agree_with_target needs a target from make_predictable_target")
    successor = head[:, :vocab].argmax(dim=0)  # successor[t] = f(t) along the residual path
    config = model.config
    num_heads, head_dim = config.num_attention_heads, config.head_dim
    half = head_dim // 2
    slow = half - 1
    planes, c_max = _separating_planes(model.rotary_emb.inv_freq.float(), model.block_size)
    if planes is None:
        raise ValueError("block_size too large for the hand-built drafter's rotary planes")
    weight = 1.0 / len(planes)  # share of each plane in the anchor score
    c0 = (1.0 + c_max) / 2
    gap = 18.0
    score = 2 * gap / (1.0 - c_max)  # M: anchor score at the matching offset
    thetas = [float(model.rotary_emb.inv_freq[i]) for i in planes]
    scaling = head_dim**-0.5
    normed = math.sqrt(head_dim)  # RMSNorm of a single-entry vector puts sqrt(head_dim) there
    q_part = normed / math.sqrt(2.0)  # queries: equal halves in `plane` and in `slow`
    words = [t for t in range(vocab) if t != mask_token_id]

    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
        for layer in model.layers:
            for norm in (
                layer.input_layernorm,
                layer.post_attention_layernorm,
                layer.self_attn.q_norm,
                layer.self_attn.k_norm,
            ):
                norm.weight.fill_(1.0)
        model.norm.weight.fill_(1.0)
        model.hidden_norm.weight.fill_(1.0)

        types = list(config.layer_types or [])
        idx = types.index("full_attention") if "full_attention" in types else 0
        attn = model.layers[idx].self_attn
        q = attn.q_proj.weight.view(num_heads, head_dim, hidden)
        for h in range(1, num_heads + 1):
            for i, theta in zip(planes, thetas, strict=True):
                q[h - 1, i, mask_token_id] = math.sqrt(weight) * math.cos(h * theta)
                q[h - 1, i + half, mask_token_id] = -math.sqrt(weight) * math.sin(h * theta)
            q[h - 1, slow, mask_token_id] = 1.0
        k = attn.k_proj.weight  # one KV head: [head_dim, hidden]
        for i in planes:
            k[i, words] = math.sqrt(weight)
        k[slow, mask_token_id] = 1.0
        k_scale = score / (scaling * q_part * normed)
        for i in planes:
            attn.k_norm.weight[i] = k_scale
            attn.k_norm.weight[i + half] = k_scale
        attn.k_norm.weight[slow] = c0 * k_scale
        v = attn.v_proj.weight
        v[words, words] = 1.0
        o = attn.o_proj.weight.view(hidden, num_heads, head_dim)
        gain = 4.0
        for h in range(1, num_heads + 1):
            dest = torch.arange(vocab)
            for _ in range(h - 1):
                dest = successor[dest]
            if error_rate > 0:
                wrong = torch.rand(vocab, generator=rng) < error_rate
                shift = torch.randint(1, vocab - FIRST_WORD_ID, (vocab,), generator=rng)
                moved = FIRST_WORD_ID + (dest - FIRST_WORD_ID + shift) % (vocab - FIRST_WORD_ID)
                dest = torch.where(wrong & (dest >= FIRST_WORD_ID), moved, dest)
            o[dest[words], h - 1, words] = gain


# ---------------------------------------------------------------------------
# z-lab reference
# ---------------------------------------------------------------------------


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Hide transformers' deprecation notice for the ``past_key_values`` z-lab passes."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*past_key_values.*", category=FutureWarning)
        yield


def load_zlab_drafter(drafter_dir: Path) -> DFlashDraftModel:
    """z-lab's ``DFlashDraftModel.from_pretrained`` in float32 on CPU, in eval mode."""
    from dflash.model import DFlashDraftModel

    model = DFlashDraftModel.from_pretrained(str(drafter_dir), dtype=torch.float32)
    return model.float().eval()


def load_hf_target(target_dir: Path) -> PreTrainedModel:
    """The target through ``AutoModelForCausalLM`` in float32 on CPU, in eval mode."""
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32)
    return model.float().eval()


def zlab_generate(
    target_dir: Path,
    drafter_dir: Path,
    prompt_ids: list[int],
    max_new_tokens: int,
    stop_token_ids: list[int] | None = None,
) -> tuple[list[int], list[int]]:
    """Greedy batch-1 z-lab ``dflash_generate`` on CPU.

    Returns ``(generated ids after the prompt, acceptance_lengths)``. z-lab's stats need CUDA
    timers, so ``dflash.model._cuda_time`` is patched to ``time.perf_counter`` for the call.
    ``len(generated) == 1 + sum(acceptance_lengths)``: the prefill's token is not in the list,
    each step's entry counts the accepted drafts plus the target's token, cut at
    ``max_new_tokens`` and just after the first stop token (which is kept in the output).
    """
    import dflash.model as zlab

    target = load_hf_target(target_dir)
    drafter = load_zlab_drafter(drafter_dir)
    input_ids = torch.tensor([prompt_ids], dtype=torch.long)
    with mock.patch.object(zlab, "_cuda_time", time.perf_counter), _quiet():
        stats = zlab.dflash_generate(
            drafter,
            target,
            input_ids,
            max_new_tokens=max_new_tokens,
            stop_token_ids=stop_token_ids,
            temperature=0.0,
            return_stats=True,
        )
    generated = stats.output_ids[0, len(prompt_ids) :].tolist()
    return generated, [int(n) for n in stats.acceptance_lengths]


def zlab_full_block_steps(ref_lengths: list[int], max_new_tokens: int, block_size: int) -> int:
    """How many leading steps of a ``zlab_generate`` run drafted a full block. z-lab shrinks
    its block to the tokens still allowed near ``max_new_tokens`` (a non-causal drafter then
    sees fewer masks and drafts differently), so only these steps compare with our engine."""
    generated, full = 1, 0
    for length in ref_lengths:
        if max_new_tokens - generated + 1 < block_size:
            break
        generated += length
        full += 1
    return full


@torch.inference_mode()
def zlab_first_draft_logits(
    target_dir: Path, drafter_dir: Path, prompt_ids: list[int]
) -> torch.Tensor:
    """The drafter's logits ``[block_size - 1, vocab]`` at the first draft step.

    Mirrors ``dflash_generate``: prefill the target, anchor = its greedy token at position
    ``len(prompt)``, context = the prompt's target features at ``target_layer_ids``, noise =
    target embeddings of ``[anchor, mask * (block_size - 1)]``, then z-lab's drafter forward
    (with a fresh draft cache) and ``compute_logits`` through the target's lm_head.
    """
    import dflash.model as zlab

    target = load_hf_target(target_dir)
    drafter = load_zlab_drafter(drafter_dir)
    n, block = len(prompt_ids), drafter.block_size
    input_ids = torch.tensor([prompt_ids], dtype=torch.long)
    positions = torch.arange(n + block, dtype=torch.long)[None]
    with _quiet():
        out = target(
            input_ids,
            position_ids=positions[:, :n],
            past_key_values=zlab._make_cache(target.config),
            use_cache=True,
            logits_to_keep=1,
            output_hidden_states=True,
        )
    anchor = int(out.logits[0, -1].argmax())
    context = zlab.extract_context_feature(out.hidden_states, drafter.target_layer_ids)
    block_ids = torch.full((1, block), int(drafter.mask_token_id), dtype=torch.long)
    block_ids[0, 0] = anchor
    scale = float(zlab._draft_value(drafter.config, "input_embedding_scale", 1.0))
    noise = zlab._raw_input_embeddings(target, block_ids, scale)
    hidden = drafter(
        target_hidden=context,
        noise_embedding=noise,
        position_ids=positions,
        past_key_values=zlab._make_cache(drafter.config),
        use_cache=True,
    )[:, 1 - block :, :]
    return drafter.compute_logits(hidden, zlab._output_head(target))[0]


def make_speculators_drafter(
    out_dir: Path,
    zlab_dir: Path,
    target_dir: Path,
    draft_token_ids: list[int] | None = None,
) -> Path:
    """The z-lab drafter at ``zlab_dir`` in vLLM's speculators format (what speculators'
    ``DFlashConverter`` writes): ``config.json`` with ``speculators_model_type: "dflash"``, the
    draft layers' Qwen3 config as ``transformer_layer_config`` (only fields that differ from
    Qwen3Config's defaults, as older transformers' ``to_diff_dict`` wrote it),
    ``aux_hidden_state_layer_ids`` = z-lab's ``target_layer_ids`` + 1, and ``speculators_config``;
    the weights add the target's ``embed_tokens`` and the target's ``lm_head`` rows of the draft
    vocabulary. ``draft_token_ids`` (sorted, distinct): a reduced draft vocabulary of those target
    tokens, with ``d2t`` (draft row -> offset to the target id) and ``t2d`` (target mask)."""
    out_dir = Path(out_dir)
    zlab = _read_config(zlab_dir)
    target = _read_tensors(target_dir)
    vocab = int(zlab["vocab_size"])
    block_size = int(zlab["block_size"])
    defaults = Qwen3Config().to_dict()
    layer = {
        k: v
        for k, v in zlab.items()
        if k
        not in ("architectures", "auto_map", "block_size", "dflash_config", "num_target_layers")
        and (k not in defaults or defaults[k] != v or k == "model_type")
    }
    ids = list(range(vocab)) if draft_token_ids is None else list(draft_token_ids)
    tensors = dict(load_file(zlab_dir / "model.safetensors"))
    tensors["embed_tokens.weight"] = target["model.embed_tokens.weight"].clone()
    tensors["lm_head.weight"] = target["lm_head.weight"][ids].clone()
    if draft_token_ids is not None:
        index = torch.tensor(ids, dtype=torch.int64)
        tensors["d2t"] = index - torch.arange(len(ids))
        tensors["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, index, True)
    config = {
        "architectures": ["DFlashSpeculator"],
        "speculators_model_type": "dflash",
        "speculators_version": "0.4.0",
        "transformer_layer_config": layer,
        "draft_vocab_size": len(ids),
        "block_size": block_size,
        "target_hidden_size": None,
        "aux_hidden_state_layer_ids": [i + 1 for i in zlab["dflash_config"]["target_layer_ids"]],
        "mask_token_id": zlab["dflash_config"]["mask_token_id"],
        "sliding_window_non_causal": False,
        "sample_from_anchor": False,
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": block_size - 1,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": str(target_dir), "architectures": ["Qwen3ForCausalLM"]},
        },
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, out_dir / "model.safetensors")
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir
