"""Tiny DFlash2 drafters in z-lab's format, built with z-lab's `DFlash2DraftModel`, and the
reference runs of z-lab's `dflash_generate` with them (CPU, float32)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from unittest import mock

import torch
from safetensors.torch import load_file, save_file

from checkpoints import _quiet, _seeded, load_hf_target, make_dflash_drafter


def make_dflash2_drafter(
    out_dir: Path,
    target_dir: Path,
    *,
    conv_kernel_size: int = 3,
    conv_group_size: int = 16,
    selector_rank: int = 8,
    selector_top_k: int = 6,
    codebook_std: float = 0.5,
    seed: int | None = None,
    agree_with_target: bool = False,
    **dflash_kwargs,
) -> Path:
    """A z-lab format DFlash2 drafter: `make_dflash_drafter`'s layers (its random or agreeing
    weights, same arguments) plus the convolutions and the candidate selector.

    Random drafters get random conv kernels (static and dynamic parts) and codebooks of std
    `codebook_std`, large enough that the selector often picks another candidate than the
    argmax. Agreeing drafters (`agree_with_target=True`) get identity convolutions (offset 0
    of the static kernel one, the rest zero) and codebooks of std `codebook_std`: with a small
    one the agreeing drafts survive the selector. Codebooks are saved as bare tensors
    (`candidate_selector.predecessor_codebook`), as published checkpoints store them."""
    from dflash.model import DFlash2DraftModel
    from transformers import Qwen3Config

    out_dir = Path(out_dir)
    make_dflash_drafter(
        out_dir, target_dir, seed=seed, agree_with_target=agree_with_target, **dflash_kwargs
    )
    cfg = json.loads((out_dir / "config.json").read_text())
    cfg["architectures"] = ["DFlash2DraftModel"]
    cfg["dflash_config"].update(
        conv_kernel_size=conv_kernel_size,
        conv_group_size=conv_group_size,
        selector_rank=selector_rank,
        selector_top_k=selector_top_k,
    )
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    with _seeded(seed), _quiet():
        model = DFlash2DraftModel(Qwen3Config.from_pretrained(out_dir)).float().eval()
        gen = torch.Generator().manual_seed(0 if seed is None else seed)
        with torch.no_grad():
            model.load_state_dict(load_file(out_dir / "model.safetensors"), strict=False)
            for layer in model.layers:
                for conv in (layer.attention_conv, layer.mlp_conv):
                    if agree_with_target:
                        conv.base_kernel.zero_()
                        conv.base_kernel[:, 0] = 1.0
                        conv.kernel_projection.weight.zero_()
                    else:
                        shape = conv.base_kernel.shape
                        conv.base_kernel.copy_(0.5 * torch.randn(shape, generator=gen))
                        conv.base_kernel[:, 0] += 1.0
            selector = model.candidate_selector
            for book in (selector.predecessor_codebook, selector.successor_codebook):
                book.weight.copy_(codebook_std * torch.randn(book.weight.shape, generator=gen))
    state = {
        k.removesuffix(".weight") if k.endswith("_codebook.weight") else k: v.contiguous()
        for k, v in model.state_dict().items()
    }
    save_file(state, out_dir / "model.safetensors", {"format": "pt"})
    return out_dir


def load_zlab_dflash2(drafter_dir: Path):
    """z-lab's `DFlash2DraftModel.from_pretrained` in float32 on CPU, in eval mode."""
    from dflash.model import DFlash2DraftModel

    with _quiet():
        model = DFlash2DraftModel.from_pretrained(str(drafter_dir), dtype=torch.float32)
    return model.float().eval()


def load_zlab_dflash2_strict(drafter_dir: Path):
    """`load_zlab_dflash2`, asserting that the checkpoint's tensors and the model's parameters
    match one to one (no missing, unexpected or reshaped tensor)."""
    from dflash.model import DFlash2DraftModel

    with _quiet():
        model, info = DFlash2DraftModel.from_pretrained(
            str(drafter_dir), dtype=torch.float32, output_loading_info=True
        )
    problems = {k: v for k, v in info.items() if v and k != "error_msgs"}
    assert not problems and not info.get("error_msgs"), info
    return model.float().eval()


def zlab2_generate(
    target_dir: Path,
    drafter_dir: Path,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    runs: int = 1,
) -> list[tuple[list[int], list[int]]]:
    """`runs` z-lab `dflash_generate` runs (batch 1, from torch's global RNG at T > 0): each
    (generated ids after the prompt, acceptance_lengths)."""
    import dflash.model as zlab

    target = load_hf_target(target_dir)
    drafter = load_zlab_dflash2(drafter_dir)
    input_ids = torch.tensor([prompt_ids], dtype=torch.long)
    out = []
    with mock.patch.object(zlab, "_cuda_time", time.perf_counter), _quiet():
        for _ in range(runs):
            stats = zlab.dflash_generate(
                drafter,
                target,
                input_ids,
                max_new_tokens=max_new_tokens,
                stop_token_ids=None,
                temperature=temperature,
                return_stats=True,
            )
            generated = stats.output_ids[0, len(prompt_ids) :].tolist()
            out.append((generated, [int(n) for n in stats.acceptance_lengths]))
    return out


@torch.inference_mode()
def zlab2_first_step(
    target_dir: Path, drafter_dir: Path, prompt_ids: list[int]
) -> tuple[torch.Tensor, list[int]]:
    """The first draft step of a greedy `dflash_generate`: the drafter's logits
    [block_size - 1, vocab] and the selector's proposals (block_size - 1 tokens)."""
    import dflash.model as zlab

    target = load_hf_target(target_dir)
    drafter = load_zlab_dflash2(drafter_dir)
    n, block = len(prompt_ids), drafter.block_size
    positions = torch.arange(n + block, dtype=torch.long)[None]
    with _quiet():
        out = target(
            torch.tensor([prompt_ids]),
            position_ids=positions[:, :n],
            past_key_values=zlab._make_cache(target.config),
            use_cache=True,
            logits_to_keep=1,
            output_hidden_states=True,
        )
        anchor = out.logits[0, -1].argmax()
        block_ids = torch.full((1, block), int(drafter.mask_token_id), dtype=torch.long)
        block_ids[0, 0] = anchor
        hidden = drafter(
            target_hidden=zlab.extract_context_feature(out.hidden_states, drafter.target_layer_ids),
            noise_embedding=zlab._raw_input_embeddings(target, block_ids),
            position_ids=positions,
            past_key_values=zlab._make_cache(drafter.config),
            use_cache=True,
        )[:, 1 - block :, :]
    head = zlab._output_head(target)
    tokens, _, _ = drafter.propose(hidden, block_ids[:, 0], head, 0.0)
    return drafter.compute_logits(hidden, head)[0], tokens[0].tolist()


def prompt_where_selector_picks(
    target_dir: Path, drafter_dir: Path, rng: torch.Generator, length: int, vocab: int
) -> tuple[list[int], torch.Tensor, list[int]]:
    """A random prompt whose first proposals are not the drafter's argmax, with
    `zlab2_first_step`'s logits and proposals for it. A random selector agrees with the
    argmax on about one prompt in fifty, and a test of the selector must see it choose."""
    for _ in range(8):
        prompt = torch.randint(4, vocab, (length,), generator=rng).tolist()
        logits, proposals = zlab2_first_step(target_dir, drafter_dir, prompt)
        if proposals != logits.argmax(-1).tolist():
            return prompt, logits, proposals
    raise AssertionError("the selector picked the argmax on 8 random prompts: is it wired in?")
