"""Serving benchmark: the OpenAI-compatible server in-process, chat requests at rising
concurrency, requests/s and output tok/s per level. With --draft, the same run twice, without and
with DFlash, and the speedup.

    .venv/bin/python benchmarks/server_bench.py [--model DIR|GGUF] [--draft DIR]
        [--concurrency 1 2 4 8 16 32] [--max-tokens 64] [--json results/server_bench.json]

No --model: the embedded SmolLM2-135M-Instruct. Requests are greedy and streamed (the stream
gives time to first token); each level sends `--requests-per-level` x concurrency requests from
that many concurrent clients.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import platform
import socket
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import torch
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import print_table  # noqa: E402
from blockdraft.config import EngineConfig  # noqa: E402
from blockdraft.engine.llm_engine import LLMEngine  # noqa: E402
from blockdraft.server import build_app  # noqa: E402

MODEL_NAME = "bench"
PROMPTS = [
    "Explain why the sky is blue in a few sentences.",
    "Write a haiku about a lighthouse in winter.",
    "List three practical tips for learning a new language.",
    "What is the difference between a list and a tuple in Python?",
    "Describe the water cycle to a ten-year-old.",
    "Give me a short recipe for a tomato soup.",
    "Why do cats purr? Answer briefly.",
    "Summarize the plot of a heist movie you would like to see.",
    "How does a binary search work?",
    "Write two sentences about the history of the bicycle.",
    "What are the main causes of the seasons on Earth?",
    "Suggest a name for a bakery and explain it.",
    "Translate 'good morning, how are you?' into French and Spanish.",
    "What should I pack for a weekend hiking trip?",
    "Explain recursion with a simple example.",
    "Write a limerick about a forgetful robot.",
]


@contextlib.contextmanager
def running_server(engine: LLMEngine) -> Iterator[str]:
    """Serves `engine` from a uvicorn thread on a free local port; yields the base URL."""
    app = build_app(engine, MODEL_NAME, max_waiting=1024)
    sock = socket.socket()
    # A socket handed to asyncio does not get TCP_NODELAY, and Nagle + delayed ACKs would add
    # 40 ms to every keep-alive request.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        sock.close()


async def one_request(
    client: openai.AsyncOpenAI, prompt: str, args: argparse.Namespace
) -> dict[str, Any]:
    start = time.perf_counter()
    first = None
    text, usage = "", None
    stream = await client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=args.max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": args.ignore_eos},
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if first is None:
                first = time.perf_counter()
            text += chunk.choices[0].delta.content
        if chunk.usage is not None:
            usage = chunk.usage
    end = time.perf_counter()
    return {
        "prompt": prompt,
        "text": text,
        "completion_tokens": usage.completion_tokens if usage else 0,
        "ttft_s": (first or end) - start,
        "latency_s": end - start,
    }


async def run_level(url: str, concurrency: int, args: argparse.Namespace) -> dict[str, Any]:
    num = concurrency * args.requests_per_level
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(num)]
    todo: asyncio.Queue[str] = asyncio.Queue()
    for p in prompts:
        todo.put_nowait(p)
    results: list[dict[str, Any]] = []
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=3600)

    async def worker() -> None:
        while not todo.empty():
            results.append(await one_request(client, todo.get_nowait(), args))

    start = time.perf_counter()
    await asyncio.gather(*[worker() for _ in range(concurrency)])
    wall = time.perf_counter() - start
    await client.close()
    tokens = sum(r["completion_tokens"] for r in results)
    return {
        "concurrency": concurrency,
        "requests": num,
        "wall_s": wall,
        "requests_per_s": num / wall,
        "output_tok_per_s": tokens / wall,
        "mean_ttft_s": statistics.fmean(r["ttft_s"] for r in results),
        "mean_latency_s": statistics.fmean(r["latency_s"] for r in results),
        "completion_tokens": tokens,
        "texts": {r["prompt"]: r["text"] for r in results},
    }


def spec_metrics(url: str) -> dict[str, float]:
    wanted = {
        "blockdraft:spec_decode_num_drafts_total": "drafts",
        "blockdraft:spec_decode_num_accepted_tokens_total": "accepted_tokens",
        "blockdraft:spec_decode_mean_acceptance_length": "mean_acceptance_length",
    }
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            if sample.name in wanted:
                out[wanted[sample.name]] = sample.value
    return out


def run_server_bench(args: argparse.Namespace, draft: str | None) -> dict[str, Any]:
    spec = {"method": "dflash", "model": draft} if draft else None
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            speculative_config=spec,
            device=args.device,
            max_model_len=args.max_model_len,
            max_num_seqs=max(args.concurrency),
        )
    )
    levels = []
    with running_server(engine) as url:
        asyncio.run(
            run_level(url, 1, argparse.Namespace(**{**vars(args), "requests_per_level": 1}))
        )  # warmup
        for c in args.concurrency:
            level = asyncio.run(run_level(url, c, args))
            levels.append(level)
            print(
                f"  [{'dflash' if draft else 'autoregressive'}] concurrency {c}: "
                f"{level['requests_per_s']:.2f} req/s, {level['output_tok_per_s']:.1f} tok/s"
            )
        spec_stats = spec_metrics(url) if draft else {}
    return {"draft": draft, "levels": levels, "spec_decode": spec_stats}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--draft", default=None, help="DFlash drafter: compare against autoregressive")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    p.add_argument(
        "--requests-per-level", type=int, default=2, help="requests per client at each level"
    )
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--ignore-eos", action="store_true", help="always generate max-tokens")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--json", default="results/server_bench.json", help="where to write the results")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    runs = {"autoregressive": run_server_bench(args, None)}
    if args.draft:
        runs["dflash"] = run_server_bench(args, args.draft)

    header = ["concurrency", "req/s", "out tok/s", "mean TTFT s", "mean latency s"]
    for name, run in runs.items():
        rows = [
            [
                lv["concurrency"],
                lv["requests_per_s"],
                lv["output_tok_per_s"],
                lv["mean_ttft_s"],
                lv["mean_latency_s"],
            ]
            for lv in run["levels"]
        ]
        print_table(
            f"{name} ({args.model or 'SmolLM2-135M-Instruct'}, {args.device})", header, rows
        )
    summary: dict[str, Any] = {}
    if args.draft:
        ar, sd = runs["autoregressive"]["levels"], runs["dflash"]["levels"]
        rows = []
        # Greedy speculative decoding is lossless: any text that differs is a bug to look at.
        mismatches = sum(
            a["texts"][k] != s["texts"].get(k)
            for a, s in zip(ar, sd, strict=True)
            for k in a["texts"]
        )
        for a, s in zip(ar, sd, strict=True):
            rows.append(
                [
                    a["concurrency"],
                    a["output_tok_per_s"],
                    s["output_tok_per_s"],
                    s["output_tok_per_s"] / a["output_tok_per_s"],
                ]
            )
        print_table(
            "DFlash vs autoregressive", ["concurrency", "AR tok/s", "DFlash tok/s", "speedup"], rows
        )
        print(
            f"mean acceptance length: "
            f"{runs['dflash']['spec_decode'].get('mean_acceptance_length', 0):.2f}; "
            f"greedy texts differing between the runs: {mismatches}"
        )
        summary = {"text_mismatches": mismatches}

    for run in runs.values():
        for level in run["levels"]:
            level.pop("texts")
    result = {
        "model": args.model or "SmolLM2-135M-Instruct (embedded)",
        "device": args.device,
        "host": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
        "max_tokens": args.max_tokens,
        "runs": runs,
        **summary,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
