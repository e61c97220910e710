"""vLLM's "speculators" drafter config, translated into z-lab's DFlash `config.json` form.

A speculators checkpoint (vllm-project/speculators, `DFlashSpeculatorConfig`) keeps the draft
layers' Hugging Face config in `transformer_layer_config` (a Qwen3Config written by
`to_diff_dict`, so fields at Qwen3Config's defaults may be missing), and next to it:
`speculators_model_type`, `aux_hidden_state_layer_ids`, `mask_token_id`, `block_size`,
`draft_vocab_size` (with `d2t` / `t2d` in the weights when it is below the vocabulary),
`target_hidden_size`, `sample_from_anchor`, `sliding_window_non_causal`, and
`speculators_config` (algorithm, proposal methods, verifier). The tensors carry z-lab's names.

Layer ids: speculators counts hidden states as transformers' `hidden_states` tuple does (0 is
the embedding output, i the output of decoder layer i - 1): its converter writes z-lab's
`target_layer_ids` as `i + 1`, and vLLM reads them back as `i - 1`. Ours are z-lab's.

Fields whose meaning we do not implement exactly are refused with a ValueError naming them.
"""

from __future__ import annotations

# speculators_model_type -> the z-lab architecture with the same layers and weights.
SPECULATORS_ARCHITECTURES: dict[str, str] = {
    "dflash": "DFlashDraftModel",
}

# Qwen3Config's defaults (transformers 4.51 to 5.x), for fields `to_diff_dict` left out.
QWEN3_DEFAULTS: dict[str, object] = {
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 22016,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
}


def dflash_config_from_speculators(hf: dict) -> dict:
    """z-lab's config.json dict for the speculators config `hf` (a ValueError naming the field
    for anything this engine would not run exactly as trained)."""
    kind = hf.get("speculators_model_type")
    if kind not in SPECULATORS_ARCHITECTURES:
        raise ValueError(
            f"speculators_model_type {kind!r} is not supported "
            f"(supported: {', '.join(SPECULATORS_ARCHITECTURES)})"
        )
    if hf.get("sample_from_anchor"):
        raise ValueError(
            "this speculators drafter has sample_from_anchor=true (it also drafts at the anchor "
            "slot, DSpark style); only drafters whose anchor is the bonus token are supported"
        )
    _check_proposals(hf.get("speculators_config") or {}, kind)
    layer = hf.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ValueError("speculators config has no transformer_layer_config object")
    if layer.get("model_type", "qwen3") != "qwen3":
        raise ValueError(
            f"transformer_layer_config model_type {layer['model_type']!r} is not supported "
            "(DFlash draft layers are Qwen3 layers: 'qwen3')"
        )
    body = {**QWEN3_DEFAULTS, **layer}
    if body["hidden_act"] != "silu":
        raise ValueError(f"transformer_layer_config hidden_act {body['hidden_act']!r}: need silu")
    if "sliding_attention" in (body.get("layer_types") or []):
        # speculators trains sliding layers with the window counted back from the block's
        # anchor for every query of the block; our kernels (and z-lab's) count it back from
        # each query's own position.
        raise ValueError(
            "transformer_layer_config layer_types has sliding_attention layers: speculators' "
            "sliding-window mask (window counted from the anchor) is not supported"
        )
    target_hidden = hf.get("target_hidden_size")
    if target_hidden is not None and int(target_hidden) != int(body["hidden_size"]):
        raise ValueError(
            f"target_hidden_size {target_hidden} differs from the drafter's hidden_size "
            f"{body['hidden_size']}; the drafter must share the target's hidden size"
        )
    aux = hf.get("aux_hidden_state_layer_ids")
    if not isinstance(aux, list) or not aux:
        raise ValueError("speculators config has no aux_hidden_state_layer_ids")
    if any(not isinstance(i, int) or i < 1 for i in aux):
        raise ValueError(
            f"aux_hidden_state_layer_ids {aux} must be >= 1 (0 is the embedding output)"
        )
    if hf.get("mask_token_id") is None:
        raise ValueError("speculators config has no mask_token_id")
    config = {k: v for k, v in body.items() if k not in ("architectures", "dflash_config")}
    config.update(
        architectures=[SPECULATORS_ARCHITECTURES[kind]],
        block_size=int(hf.get("block_size", 8)),  # DFlashSpeculatorConfig's default
        draft_vocab_size=int(hf.get("draft_vocab_size") or body["vocab_size"]),
        dflash_config={
            "mask_token_id": int(hf["mask_token_id"]),
            "target_layer_ids": [i - 1 for i in aux],
        },
    )
    return config


def _check_proposals(speculators: dict, kind: str) -> None:
    algorithm = speculators.get("algorithm", kind)
    if algorithm != kind:
        raise ValueError(
            f"speculators_config algorithm {algorithm!r} does not match "
            f"speculators_model_type {kind!r}"
        )
    for method in speculators.get("proposal_methods") or []:
        kind_ = method.get("proposal_type", "greedy")
        if kind_ != "greedy":
            raise ValueError(f"speculators proposal_type {kind_!r} is not supported (greedy)")
        # Accepting a draft anywhere in the verifier's top k changes the output; this engine
        # verifies losslessly only.
        if int(method.get("verifier_accept_k", 1)) != 1:
            raise ValueError(
                f"speculators verifier_accept_k {method['verifier_accept_k']} is not supported: "
                "verification here is lossless (the draft must be the target's own choice)"
            )
