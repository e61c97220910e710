"""The drafter under training: config of a fresh drafter, its training forward, and saving it.

Training uses the inference module itself (`blockdraft.models.dflash_drafter.DFlashDrafter`)
and calls its submodules in the same order as its paged forward, only with the attention done
densely or by FlexAttention over a packed batch. So the trained parameters are, name for name, what
the engine and z-lab's `DFlashDraftModel` load.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from blockdraft.kernels import select
from blockdraft.kernels.cross_entropy import chunked_cross_entropy
from blockdraft.kernels.forward_context import forward_context
from blockdraft.kernels.triton_env import triton_interpreting
from blockdraft.models.dflash2_drafter import DFlash2Config
from blockdraft.models.dflash_drafter import (
    DFlashConfig,
    DFlashDrafter,
    default_target_layer_ids,
)
from blockdraft.models.llama import DecoderLM
from blockdraft.models.loader import (
    init_dummy_weights,
    iter_checkpoint_tensors,
    load_weights,
    read_checkpoint,
)
from blockdraft.models.registry import resolve_architecture, resolve_drafter
from blockdraft.runtime.host_batch import build_attention_metadata
from blockdraft.tokenizer import Tokenizer

SHARED_PREFIXES = ("embed_tokens.", "lm_head.")  # the target's, frozen, never saved

# attend(layer index, q [Q, H, D], k [C+Q, Hkv, D], v [C+Q, Hkv, D]) -> [Q, H, D]
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


# ---------------------------------------------------------------------------------------------
# Target
# ---------------------------------------------------------------------------------------------


def load_target(
    model: str | None,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    load_format: str = "auto",
) -> tuple[DecoderLM, Tokenizer | None, dict]:
    """The frozen target (as the engine builds it), its tokenizer and its HF config dict.
    load_format="dummy": random weights from config.json alone (training benchmarks)."""
    if model is None:
        from blockdraft.models.gguf_loader import default_model_path

        model = default_model_path()
    ckpt = read_checkpoint(model, load_format)
    architecture = resolve_architecture(ckpt.hf_config)
    cfg = architecture.parse_config(ckpt.hf_config)
    cfg = dataclasses.replace(
        cfg, max_position_embeddings=max(cfg.max_position_embeddings, max_positions)
    )
    with torch.device(device):
        target = architecture.model_class(cfg).to(dtype)
    if load_format == "dummy":
        init_dummy_weights(target)
    else:
        load_weights(
            dict(target.named_parameters()),
            iter_checkpoint_tensors(ckpt),
            str(model),
            ignore=lambda name: (
                "rotary_emb" in name or (name == "lm_head.weight" and cfg.tie_word_embeddings)
            ),
        )
    target.eval().requires_grad_(False)
    return target, ckpt.tokenizer, ckpt.hf_config


class TargetFeatures:
    """Runs the target over whole sequences through the engine's own paged attention path (a
    private KV pool, grown on demand) and returns the features at `capture_layer_ids`."""

    def __init__(self, target: DecoderLM, block_size: int = 16) -> None:
        self.target = target
        self.block_size = block_size
        self.num_blocks = 0

    @torch.no_grad()
    def __call__(
        self,
        input_ids: torch.Tensor,  # [C] int64, sequences back to back
        seq_lens: list[int],
    ) -> torch.Tensor:  # [C, K * hidden]
        from blockdraft.engine.kv_cache import allocate_kv_cache

        bs = self.block_size
        per_seq = [-(-n // bs) for n in seq_lens]
        needed = sum(per_seq)
        layers = self.target.attention_layers
        if needed > self.num_blocks:
            param = self.target.lm_head.weight
            allocate_kv_cache(layers, needed, bs, param.dtype, param.device)
            self.num_blocks = needed
        tables, first = [], 0
        for count in per_seq:
            tables.append(list(range(first, first + count)))
            first += count
        device = input_ids.device
        meta = build_attention_metadata(tables, [0] * len(seq_lens), seq_lens, bs, device)
        positions = torch.cat([torch.arange(n, device=device) for n in seq_lens])
        with forward_context(meta):
            _, features = self.target(input_ids, positions)
        if features is None:
            raise ValueError("the target captures no layers: set capture_layer_ids")
        return features


# ---------------------------------------------------------------------------------------------
# A fresh drafter
# ---------------------------------------------------------------------------------------------


def default_mask_token_id(tokenizer: Tokenizer | None, hf_config: dict) -> int:
    """A token the target never sees in real text, for the block's MASK rows: a special token
    named like a mask; else the last special token that is not bos/eos/pad and does not
    appear in the chat template (SmolLM2: `<empty_output>`)."""
    if tokenizer is None:
        raise ValueError("the target has no tokenizer: pass mask_token_id")
    # The tokenizers library lists the added (special) tokens; our wrapper does not expose them.
    added = tokenizer._tok.get_added_tokens_decoder()
    specials = sorted((i, t.content) for i, t in added.items() if t.special)
    for i, text in specials:
        if "mask" in text.lower():
            return i
    busy = {hf_config.get("bos_token_id"), hf_config.get("pad_token_id")}
    eos = hf_config.get("eos_token_id")
    busy |= set(eos) if isinstance(eos, list) else {eos}
    busy |= {tokenizer.bos_token_id, tokenizer.eos_token_id}
    template = tokenizer.chat_template or ""
    for i, text in reversed(specials):
        if i not in busy and text not in template:
            return i
    raise ValueError("found no unused special token for the mask: pass mask_token_id")


@dataclasses.dataclass(frozen=True)
class DFlash2Shape:
    """A DFlash2 drafter's own `dflash_config` fields. The defaults are those of the published
    drafters (incoai/Qwen3.8-27B-DFlash2: a two-tap convolution, groups of 16 channels, a rank
    256 selector over the top 16 candidates)."""

    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16


def drafter_hf_config(
    target_hf: dict,
    *,
    num_layers: int = 1,
    block_size: int = 16,
    mask_token_id: int,
    target_layer_ids: list[int] | None = None,
    num_target_features: int | None = None,
    intermediate_size: int | None = None,
    layer_types: list[str] | None = None,
    sliding_window: int | None = None,
    max_position_embeddings: int | None = None,
    dflash2: DFlash2Shape | None = None,
) -> dict:
    """A z-lab `config.json` for a new drafter of `target_hf`: the target's widths (hidden,
    heads, head_dim, MLP, eps, RoPE, vocab) with `num_layers` Qwen3 layers; a DFlash2 drafter
    (`DFlash2DraftModel`, its convolutions and selector in `dflash_config`) with `dflash2`."""
    t = resolve_architecture(target_hf).parse_config(target_hf)
    if target_layer_ids is None:
        target_layer_ids = default_target_layer_ids(t.num_layers, num_target_features or num_layers)
    if not 0 <= mask_token_id < t.vocab_size:
        raise ValueError(
            f"mask_token_id {mask_token_id} is outside the vocabulary ({t.vocab_size})"
        )
    layer_types = list(layer_types or ["full_attention"] * num_layers)
    sliding = "sliding_attention" in layer_types
    cfg = {
        "architectures": [(DFlash2Config if dflash2 else DFlashConfig).architecture],
        "model_type": "qwen3",
        "hidden_size": t.hidden_size,
        "intermediate_size": intermediate_size or t.intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": t.num_heads,
        "num_key_value_heads": t.num_kv_heads,
        "head_dim": t.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": t.rms_norm_eps,
        "rope_theta": t.rope_theta,
        "rope_scaling": t.rope_scaling,
        "max_position_embeddings": max_position_embeddings or t.max_position_embeddings,
        "vocab_size": t.vocab_size,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "use_sliding_window": sliding,
        "sliding_window": sliding_window if sliding else None,
        "max_window_layers": num_layers,
        "layer_types": layer_types,
        "initializer_range": 0.02,
        "num_target_layers": t.num_layers,
        "block_size": block_size,
        "dflash_config": {
            "mask_token_id": int(mask_token_id),
            "target_layer_ids": [int(i) for i in target_layer_ids],
            **(dataclasses.asdict(dflash2) if dflash2 else {}),
        },
    }
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if target_hf.get(name) is not None:
            cfg[name] = target_hf[name]
    resolve_drafter(cfg)  # fail here, not at load time
    return cfg


def trainable_parameters(drafter: DFlashDrafter) -> dict[str, torch.nn.Parameter]:
    return {
        name: p for name, p in drafter.named_parameters() if not name.startswith(SHARED_PREFIXES)
    }


@torch.no_grad()
def init_drafter_weights(drafter: DFlashDrafter, seed: int, std: float = 0.02) -> None:
    """Normal(0, std) matrices, unit norm weights, drawn on the CPU so that a seed gives the
    same drafter on every device. A fresh DFlash2 drafter starts as a DFlash one: its
    convolutions are the identity (static kernel one at offset 0, no dynamic part) and its
    selector adds nothing to the logits (a zero hidden projection, as LoRA starts one factor at
    zero; unit normal codebooks, so that the projection's gradient is not zero too)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in trainable_parameters(drafter).items():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith("base_kernel"):  # [2, kernel_size, hidden]
            p.zero_()
            p[:, 0] = 1.0
        elif name.endswith(("kernel_projection.weight", "hidden_projection.weight")):
            p.zero_()
        elif name.endswith("_codebook.weight"):
            p.copy_(torch.randn(p.shape, generator=g))
        else:
            p.copy_(torch.randn(p.shape, generator=g) * std)


def save_drafter(
    drafter: DFlashDrafter, hf_config: dict, out_dir: str | Path, dtype: torch.dtype
) -> Path:
    """Writes a z-lab format checkpoint: config.json + model.safetensors (own weights only)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {
        drafter.saved_name(name): p.detach().to("cpu", dtype).contiguous()
        for name, p in trainable_parameters(drafter).items()
    }
    cfg = dict(hf_config, torch_dtype=str(dtype).removeprefix("torch."))
    # Write-then-rename: a reader (or a crash) never sees half a checkpoint file.
    tmp = out_dir / "model.safetensors.tmp"
    save_file(tensors, tmp, {"format": "pt"})
    tmp.replace(out_dir / "model.safetensors")
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out_dir


# ---------------------------------------------------------------------------------------------
# Training forward
# ---------------------------------------------------------------------------------------------


def drafter_train_forward(
    drafter: DFlashDrafter,
    features: torch.Tensor,  # [C, K * hidden] target features of the context rows
    ctx_pos: torch.Tensor,  # [C] int64
    block_ids: torch.Tensor,  # [Q] int64, [anchor, MASK x (B-1)] per block
    q_pos: torch.Tensor,  # [Q] int64
    attend: Attend,
    block_len: int | None = None,
) -> torch.Tensor:  # [Q, hidden], after the final norm
    """`DFlashDrafter.write_context` + `forward` over a packed batch: context K/V from
    fc/hidden_norm(features) at every layer, block queries, attention through `attend`.
    DFlash2 layers (`block_len` rows per block, the blocks back to back) also run their
    convolutions around attention and MLP, within each block, as `DFlash2DecoderLayer` does."""
    cfg = drafter.cfg
    convs = isinstance(drafter.cfg, DFlash2Config)
    if convs and block_len is None:
        raise ValueError("a DFlash2 drafter's training forward needs block_len")
    ctx = drafter.hidden_norm(drafter.fc(features))
    x = drafter.embed_tokens(block_ids)
    if cfg.input_embedding_scale != 1.0:
        x = x * cfg.input_embedding_scale
    for i, layer in enumerate(drafter.layers):
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        if convs:
            h, attn_kernel = layer.attention_conv.prepare(h, block_len)
        q = attn.q_proj(h).view(-1, attn.num_heads, attn.head_dim)
        if attn.qk_norm:
            q = attn.q_norm(q)
        q = attn.rotary.rotate(q_pos, q)
        k_blk, v_blk = attn.project_kv(h, q_pos)
        k_ctx, v_ctx = attn.project_kv(ctx, ctx_pos)
        # v comes straight out of a linear: its dtype is the compute dtype (bf16 under autocast),
        # while the norms hand q and k back in float32.
        dtype = v_blk.dtype
        k = torch.cat([k_ctx, k_blk]).to(dtype)
        v = torch.cat([v_ctx.to(dtype), v_blk])
        out = attn.o_proj(attend(i, q.to(dtype), k, v).flatten(1))
        if convs:
            out = layer.attention_conv.finish(out, attn_kernel, block_len)
        x = x + out
        h = layer.post_attention_layernorm(x)
        if convs:
            h, mlp_kernel = layer.mlp_conv.prepare(h, block_len)
        h = layer.mlp(h)
        if convs:
            h = layer.mlp_conv.finish(h, mlp_kernel, block_len)
        x = x + h
    return drafter.norm(x)


def dense_attend(
    drafter: DFlashDrafter, masks: dict[tuple[bool, int | None], torch.Tensor]
) -> Attend:
    """SDPA with a dense boolean mask per (causal, window) kind of layer."""

    def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        paged = drafter.layers[i].self_attn.attn
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],  # [1, H, Q, D]
            k.transpose(0, 1)[None],  # [1, Hkv, C+Q, D]
            v.transpose(0, 1)[None],
            attn_mask=masks[(paged.causal, paged.window)],  # [Q, C+Q]
            scale=paged.scale,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1)

    return attend


def flex_attend(
    drafter: DFlashDrafter,
    block_masks: dict[tuple[bool, int | None], object],
    num_context: int,
    num_queries: int,
    padded_context: int,
    padded_queries: int,
    flex: Callable[..., torch.Tensor],
) -> Attend:
    """FlexAttention over keys padded to `padded_context + padded_queries` rows (fixed shapes
    keep one compiled kernel for every batch); the padding is masked and cut off again."""

    def pad_rows(x: torch.Tensor, real: int, padded: int) -> torch.Tensor:
        return F.pad(x, (0, 0, 0, 0, 0, padded - real)) if padded > real else x

    def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        paged = drafter.layers[i].self_attn.attn
        c, nq = num_context, num_queries
        qp = pad_rows(q, nq, padded_queries)
        kp = torch.cat([pad_rows(k[:c], c, padded_context), pad_rows(k[c:], nq, padded_queries)])
        vp = torch.cat([pad_rows(v[:c], c, padded_context), pad_rows(v[c:], nq, padded_queries)])
        out = flex(
            qp.transpose(0, 1)[None].contiguous(),  # [1, H, Q', D]
            kp.transpose(0, 1)[None].contiguous(),  # [1, Hkv, C'+Q', D]
            vp.transpose(0, 1)[None].contiguous(),
            block_mask=block_masks[(paged.causal, paged.window)],
            scale=paged.scale,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1)[:nq]

    return attend


def plain_linear_logits(drafter: DFlashDrafter) -> bool:
    """Whether the drafter's logits are `hidden @ lm_head.weight.T` and nothing more (no
    output multiplier, softcap or bias): what the fused loss computes."""
    cfg = drafter.cfg
    return (
        cfg.output_multiplier == 1.0
        and not cfg.final_logit_softcapping
        and getattr(drafter.lm_head, "bias", None) is None
    )


def use_fused_loss(drafter: DFlashDrafter, device: torch.device, fused: bool | None) -> bool:
    """`fused` None: the fused Triton loss where the kernels' switch picks Triton (CUDA);
    True forces it (on the CPU only under TRITON_INTERPRET=1). Either way only for a plain
    linear LM head; otherwise the float32 path, which applies multiplier and softcap."""
    if not plain_linear_logits(drafter):
        return False
    if fused is None:
        return select.use_triton(device)
    if fused:
        check_fused_loss_device(device)
    return fused


def check_fused_loss_device(device: torch.device | str) -> None:
    """The fused loss is a Triton kernel: compiled on CUDA, or interpreted on the CPU."""
    if torch.device(device).type != "cuda" and not triton_interpreting():
        raise ValueError("fused_loss=True needs a CUDA device (or TRITON_INTERPRET=1)")


def block_loss(
    drafter: DFlashDrafter,
    hidden: torch.Tensor,  # [R, hidden], rows with a label
    labels: torch.Tensor,  # [R] int64
    weights: torch.Tensor,  # [R] float32
    chunk_rows: int = 8192,
    fused: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # (sum of weighted CE, [R] bool correct)
    """Weighted cross-entropy through the target's LM head, `chunk_rows` rows at a time, and
    whether each row's argmax is its label. Fused (`use_fused_loss`): one Triton kernel per
    chunk over logits in the compute dtype that also writes their gradient
    (`blockdraft.kernels.triton_cross_entropy`). Else float32 logits from `compute_logits`,
    recomputed in backward (`chunked_cross_entropy`)."""
    if use_fused_loss(drafter, hidden.device, fused):
        from blockdraft.kernels import triton_cross_entropy

        return triton_cross_entropy.triton_linear_cross_entropy(
            hidden, drafter.lm_head.weight, labels, weights, chunk_rows
        )
    return chunked_cross_entropy(drafter.compute_logits, hidden, labels, weights, chunk_rows)
