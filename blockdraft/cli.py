"""Command line: blockdraft generate | chat | serve | bench | train-draft."""

from __future__ import annotations

import argparse
import json
import sys
import time


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF directory or .gguf (default: SmolLM2-135M)")
    p.add_argument(
        "--draft",
        default=None,
        help="DFlash drafter directory; 'default': the drafter shipped for the default target; "
        "'none': no speculation (unset: the default target speculates with its drafter on the "
        "CPU, nothing else does)",
    )
    p.add_argument("--num-speculative-tokens", type=int, default=None)
    p.add_argument(
        "--speculative-config",
        default=None,
        help='JSON, as in vLLM: {"method": "dflash", "model": DIR, "num_speculative_tokens": 15, '
        '"num_speculative_tokens_by_batch": {"24": 7}}; --draft and --num-speculative-tokens '
        "override its fields",
    )
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)


def _speculative_config(args: argparse.Namespace) -> dict | str | None:
    if args.draft == "none":
        return None
    if not args.draft and not args.speculative_config:
        return "auto"
    spec = _parse_speculative_json(args.speculative_config) if args.speculative_config else None
    if args.draft:
        spec = {"method": "dflash", **(spec or {}), "model": args.draft}
    if spec is not None and args.num_speculative_tokens:
        spec["num_speculative_tokens"] = args.num_speculative_tokens
    return spec


def _parse_speculative_json(text: str) -> dict:
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--speculative-config is not valid JSON: {e}") from None
    if not isinstance(spec, dict):
        raise ValueError(f"--speculative-config must be a JSON object, got {text!r}")
    by_batch = spec.get("num_speculative_tokens_by_batch")
    if isinstance(by_batch, dict):  # JSON keys are strings; the config wants batch sizes
        spec["num_speculative_tokens_by_batch"] = {
            int(k) if isinstance(k, str) and k.strip().isdigit() else k: v
            for k, v in by_batch.items()
        }
    return spec


def _engine_kwargs(args: argparse.Namespace) -> dict:
    spec = _speculative_config(args)
    return dict(
        model=args.model,
        speculative_config=spec,
        device=args.device,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        seed=args.seed,
    )


def _sampling(args: argparse.Namespace):
    from blockdraft import SamplingParams

    return SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.sample_seed,
    )


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--sample-seed", type=int, default=None)


def cmd_generate(args: argparse.Namespace) -> None:
    from blockdraft import LLM

    llm = LLM(**_engine_kwargs(args))
    params = _sampling(args)
    start = time.perf_counter()
    if args.raw:
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    else:
        outputs = llm.chat(
            [[{"role": "user", "content": p}] for p in args.prompt], params, use_tqdm=False
        )
    elapsed = time.perf_counter() - start
    total = 0
    for out in outputs:
        print(out.outputs[0].text)
        total += len(out.outputs[0].token_ids)
    print(
        f"[{total} tokens in {elapsed:.2f} s, {total / elapsed:.1f} tok/s, "
        f"device {llm.config.device}, {llm.config.dtype}]"
    )
    if llm.engine.proposer is not None:
        print(f"[{llm.engine.spec_stats.summary()}]")


def cmd_chat(args: argparse.Namespace) -> None:
    from blockdraft import LLM

    llm = LLM(**_engine_kwargs(args))
    params = _sampling(args)
    history: list[dict] = []
    print("blockdraft chat: an empty line or Ctrl-D quits.")
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            break
        if not line:
            break
        history.append({"role": "user", "content": line})
        out = llm.chat(history, params, use_tqdm=False)[0].outputs[0].text
        history.append({"role": "assistant", "content": out})
        print(out)


def cmd_serve(args: argparse.Namespace) -> None:
    try:
        from blockdraft.server import run_server
    except ImportError as e:
        raise ValueError(
            f"serve needs the server extra (pip install 'blockdraft[server]'): {e}"
        ) from None
    run_server(
        _engine_kwargs(args),
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name or args.model or "SmolLM2-135M-Instruct",
        api_key=args.api_key,
        max_waiting=args.max_waiting,
    )


def cmd_bench(args: argparse.Namespace) -> None:
    from blockdraft import LLM
    from blockdraft.bench import format_table, load_prompt_set, results_json, run_bench, save_plot

    kwargs = _engine_kwargs(args)
    if kwargs["speculative_config"] in (None, "auto"):
        raise ValueError(
            "bench compares DFlash with autoregressive decoding: give --draft or "
            "--speculative-config"
        )
    sets = {name: load_prompt_set(name, args.num_prompts) for name in args.sets}
    dflash = LLM(**kwargs)
    ar = LLM(**{**kwargs, "speculative_config": None})
    results = run_bench(
        ar, dflash, sets, args.temperatures, args.max_tokens, args.seed, args.repeats
    )
    print(format_table(results))
    with open(args.json, "w") as f:
        json.dump(results_json(results), f, indent=2)
    plotted = save_plot(results, args.plot)
    print(
        f"[results in {args.json}"
        + (f", plot in {args.plot}]" if plotted else "; pip install matplotlib for the plot]")
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="blockdraft")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    gen.add_argument("prompt", nargs="+")
    gen.add_argument("--raw", action="store_true", help="no chat template")
    _add_engine_args(gen)
    _add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser("chat", help="interactive chat")
    _add_engine_args(chat)
    _add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat)
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    serve.add_argument(
        "--max-waiting",
        type=int,
        default=256,
        help="queued requests beyond max-num-seqs before 503",
    )
    serve.add_argument("--served-model-name", default=None)
    serve.set_defaults(func=cmd_serve)
    bench = sub.add_parser("bench", help="acceptance and speed of DFlash on prompt sets")
    _add_engine_args(bench)
    bench.add_argument("--sets", nargs="+", default=["gsm8k", "aime2025", "humaneval", "mtbench"])
    bench.add_argument("--num-prompts", type=int, default=20, help="per set")
    bench.add_argument("--max-tokens", type=int, default=256)
    bench.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    bench.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="timed passes per engine, taken in turns; the median tok/s is reported",
    )
    bench.add_argument("--json", default="bench.json")
    bench.add_argument("--plot", default="bench.png")
    bench.set_defaults(func=cmd_bench)
    from blockdraft.train.cli import add_train_draft_parser

    add_train_draft_parser(sub)
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except ValueError as e:
        print(f"blockdraft: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
