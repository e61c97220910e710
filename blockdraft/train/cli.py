"""`blockdraft train-draft`: its arguments and command (registered by blockdraft.cli)."""

from __future__ import annotations

import argparse


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def add_train_draft_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train-draft",
        help="train a DFlash (or DFlash2) drafter for a target",
        description="Regenerates the responses of --data with the target (unless it already is "
        "a regenerated shard), trains a DFlash drafter (--arch dflash2: a DFlash2 drafter) and "
        "saves it to --out in z-lab format.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", default=None, help="target (unset: the embedded SmolLM2-135M)")
    p.add_argument(
        "--data",
        required=True,
        help="prompts: .jsonl (one record a line with 'messages', ShareGPT 'conversations', "
        "'prompt' or 'text'), .json (an array of them) or plain text (one prompt a line); or a "
        "shard regenerated before (.jsonl with input_ids and loss_start)",
    )
    p.add_argument(
        "--out", required=True, help="output directory: drafter, checkpoints, data.jsonl"
    )
    g = p.add_argument_group("drafter")
    g.add_argument(
        "--arch",
        default="dflash",
        choices=["dflash", "dflash2"],
        help="dflash2: DFlash2DraftModel (dynamic convolutions + candidate selector)",
    )
    g.add_argument("--num-layers", type=int, default=1, help="drafter decoder layers")
    g.add_argument("--block-size", type=int, default=16, help="tokens per block: anchor + masks")
    g.add_argument(
        "--mask-token-id",
        type=int,
        default=None,
        help="token the masked positions hold (unset: an unused special token of the target)",
    )
    g.add_argument(
        "--target-layer-ids",
        type=_int_list,
        default=None,
        help="target layers whose hidden states feed the drafter, e.g. 2,15,27 (unset: "
        "z-lab's rule, spread over the target's depth)",
    )
    g.add_argument(
        "--num-target-features",
        type=int,
        default=None,
        help="how many target layers z-lab's rule picks (unset: --num-layers)",
    )
    g.add_argument("--init-drafter", default=None, help="start from this drafter checkpoint")
    g.add_argument(
        "--grow-layers",
        type=int,
        default=0,
        help="with --init-drafter: add this many layers on top, starting as the identity",
    )
    g = p.add_argument_group(
        "DFlash2 (--arch dflash2; unset: the published drafters' values, or --init-drafter's)"
    )
    g.add_argument("--conv-kernel-size", type=int, default=None, help="convolution taps (2)")
    g.add_argument(
        "--conv-group-size", type=int, default=None, help="channels per dynamic kernel (16)"
    )
    g.add_argument("--selector-rank", type=int, default=None, help="codebook rank (256)")
    g.add_argument("--selector-top-k", type=int, default=None, help="candidates per position (16)")
    g.add_argument(
        "--selector-loss-weight",
        type=float,
        default=None,
        help="weight of the selector's loss against the block loss (1.0)",
    )
    g = p.add_argument_group("regeneration")
    g.add_argument(
        "--num-prompts", type=int, default=None, help="first N prompts of --data (unset: all)"
    )
    g.add_argument("--max-tokens", type=int, default=512, help="response length cap")
    g.add_argument("--max-prompt-tokens", type=int, default=1024, help="longer prompts are skipped")
    g.add_argument("--temperature", type=float, default=0.0, help="of the target's responses")
    g.add_argument("--regen-batch-size", type=int, default=1024, help="prompts per generate call")
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=None, help="optimizer steps (unset: --epochs)")
    g.add_argument("--epochs", type=float, default=1.0, help="passes over the data")
    g.add_argument("--batch-size", type=int, default=8, help="sequences per micro-batch")
    g.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    g.add_argument("--lr", type=float, default=6e-4, help="peak AdamW learning rate")
    g.add_argument(
        "--warmup-ratio", type=float, default=0.04, help="share of steps warming the lr up"
    )
    g.add_argument("--anchors", type=int, default=512, help="blocks per sequence")
    g.add_argument(
        "--loss-gamma",
        type=float,
        default=None,
        help="loss weight decay exp(-(k-1)/gamma) over block positions (unset: by block size)",
    )
    g.add_argument("--max-seq-len", type=int, default=2048, help="longer sequences are truncated")
    g.add_argument("--seed", type=int, default=0, help="anchors, initial weights, sampling")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    g.add_argument(
        "--attention",
        default="auto",
        choices=["auto", "dense", "flex"],
        help="block attention: flex (FlexAttention, GPU only) or dense (auto: flex on CUDA)",
    )
    g.add_argument("--no-compile", action="store_true", help="eager FlexAttention")
    g.add_argument(
        "--fused-loss",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="LM head + cross-entropy in a fused Triton kernel (unset: on CUDA)",
    )
    g.add_argument(
        "--save-every", type=int, default=0, help="steps between checkpoints (0: at the end)"
    )
    g.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    g.add_argument("--stop-after", type=int, default=None, help="stop at this step (resumable)")
    g.add_argument(
        "--time-limit",
        type=float,
        default=None,
        help="stop training this many seconds after the start (resumable)",
    )
    g = p.add_argument_group("evaluation")
    g.add_argument("--eval-holdout", type=int, default=0, help="regenerated samples held out")
    g.add_argument("--eval-prompts", default=None, help="prompt file for evaluation")
    g.add_argument("--eval-num-prompts", type=int, default=64, help="prompts evaluated at most")
    g.add_argument("--eval-max-tokens", type=int, default=256, help="tokens generated per prompt")
    g.add_argument(
        "--eval-every",
        type=int,
        default=0,
        help="steps between evaluations (0: at the end); needs --eval-holdout or --eval-prompts",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_train_draft)


def cmd_train_draft(args: argparse.Namespace) -> None:
    from blockdraft.train.config import TrainConfig
    from blockdraft.train.trainer import train_drafter

    if args.eval_every and not (args.eval_holdout or args.eval_prompts):
        raise ValueError(
            "--eval-every needs something to evaluate: give --eval-holdout or --eval-prompts"
        )
    cfg = TrainConfig(
        out_dir=args.out,
        data=args.data,
        model=args.model,
        arch=args.arch,
        conv_kernel_size=args.conv_kernel_size,
        conv_group_size=args.conv_group_size,
        selector_rank=args.selector_rank,
        selector_top_k=args.selector_top_k,
        selector_loss_weight=args.selector_loss_weight,
        num_layers=args.num_layers,
        block_size=args.block_size,
        mask_token_id=args.mask_token_id,
        target_layer_ids=args.target_layer_ids,
        num_target_features=args.num_target_features,
        init_drafter=args.init_drafter,
        grow_layers=args.grow_layers,
        num_prompts=args.num_prompts,
        regen_max_tokens=args.max_tokens,
        max_prompt_tokens=args.max_prompt_tokens,
        regen_temperature=args.temperature,
        regen_batch_size=args.regen_batch_size,
        steps=args.steps,
        epochs=args.epochs,
        batch_size=args.batch_size,
        grad_accum=args.grad_accum,
        lr=args.lr,
        warmup_ratio=args.warmup_ratio,
        anchors=args.anchors,
        loss_gamma=args.loss_gamma,
        max_seq_len=args.max_seq_len,
        seed=args.seed,
        device=args.device,
        attention=args.attention,
        compile=False if args.no_compile else None,
        fused_loss=args.fused_loss,
        save_every=args.save_every,
        resume=args.resume,
        stop_after=args.stop_after,
        time_limit_s=args.time_limit,
        eval_holdout=args.eval_holdout,
        eval_prompts=args.eval_prompts,
        eval_num_prompts=args.eval_num_prompts,
        eval_max_tokens=args.eval_max_tokens,
        eval_every=args.eval_every,
        use_tqdm=not args.quiet,
    )
    result = train_drafter(cfg)
    last = result.history[-1] if result.history else None
    line = f"[drafter at {result.out_dir}, step {result.step}"
    if last is not None:
        line += f", loss {last.loss:.3f}, estimated acceptance length {last.acceptance_length:.2f}"
    if result.eval_acceptance_length is not None:
        line += f", engine acceptance length {result.eval_acceptance_length:.2f}"
    print(line + "]")
