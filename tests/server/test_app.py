"""The OpenAI-compatible server, end to end: a real uvicorn on a free local port, driven by the
official `openai` client and raw httpx, against tiny checkpoints.

Greedy answers must equal offline `LLM.generate` / `LLM.chat` text, streams must reassemble into
the non-streamed answer, hostile input must always get a JSON 4xx while the server stays
healthy, and a dropped client must give its KV blocks back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from fastapi import FastAPI
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from blockdraft import LLM, EngineConfig, SamplingParams
from blockdraft.cli import main as cli_main
from blockdraft.engine.llm_engine import LLMEngine
from blockdraft.server import build_app
from blockdraft.server.app import log_engine_start

from checkpoints import (
    make_dflash_drafter,
    make_predictable_target,
    make_qwen3_checkpoint,
    predictable_continuation,
)

MODEL = "tiny"
VOCAB = 128  # make_qwen3_checkpoint's default
PRED_VOCAB = 64  # make_predictable_target's default


@dataclass
class Served:
    url: str
    app: FastAPI
    engine: LLMEngine

    def client(self, api_key: str = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=60)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=120
        )

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics, keyed by name plus labels, e.g. 'x_total{a="b"}'."""
        text = httpx.get(f"{self.url}/metrics").text
        samples = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return samples


@contextlib.contextmanager
def serve(engine: LLMEngine, **kwargs: Any) -> Iterator[Served]:
    app = build_app(engine, MODEL, **kwargs)
    sock = socket.socket()
    # asyncio sets TCP_NODELAY only on servers it creates itself; on a socket handed to it,
    # Nagle's algorithm meets delayed ACKs and every keep-alive request waits 40 ms.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind(("127.0.0.1", 0))  # the OS picks a free port; uvicorn takes the bound socket
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on")
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.01)
    try:
        yield Served(f"http://127.0.0.1:{port}", app, engine)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("server")
    target = make_predictable_target(root / "predictable")
    return {
        "qwen3": make_qwen3_checkpoint(root / "qwen3", seed=1234),
        "predictable": target,
        "drafter": make_dflash_drafter(root / "drafter", target, agree_with_target=True),
    }


@pytest.fixture(scope="module")
def offline(checkpoints: dict[str, Path]) -> LLM:
    return LLM(str(checkpoints["qwen3"]))


@pytest.fixture(scope="module")
def plain(checkpoints: dict[str, Path]) -> Iterator[Served]:
    with serve(LLMEngine(EngineConfig(model=str(checkpoints["qwen3"])))) as served:
        yield served


@pytest.fixture(scope="module")
def spec(checkpoints: dict[str, Path]) -> Iterator[Served]:
    config = EngineConfig(
        model=str(checkpoints["predictable"]),
        speculative_config={
            "method": "dflash",
            "model": str(checkpoints["drafter"]),
            "num_speculative_tokens": 15,
        },
    )
    with serve(LLMEngine(config)) as served:
        yield served


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens)


def sse_events(response: httpx.Response) -> list[str]:
    return [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]


def assert_error(response: httpx.Response, status: int | None = None) -> dict[str, Any]:
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:300])
    if status is not None:
        assert response.status_code == status, response.text[:300]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return error


# ---------------------------------------------------------------------------------------
# Correctness against the offline API
# ---------------------------------------------------------------------------------------


def test_models_and_health(plain: Served) -> None:
    assert [m.id for m in plain.client().models.list().data] == [MODEL]
    assert httpx.get(f"{plain.url}/health").status_code == 200


def test_completion_equals_offline_greedy(plain: Served, offline: LLM) -> None:
    prompt = "w10 w20 w30 w40 w50"
    ref = offline.generate(prompt, greedy(12), use_tqdm=False)[0]
    resp = plain.client().completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0
    )
    choice = resp.choices[0]
    assert choice.text == ref.outputs[0].text
    assert choice.finish_reason == ref.outputs[0].finish_reason
    assert resp.object == "text_completion"
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert resp.usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens

    # Seeded sampling is a pure function of (seed, position): the server matches offline.
    seeded = SamplingParams(temperature=0.9, top_k=20, seed=7, max_tokens=12)
    sampled = offline.generate(prompt, seeded, use_tqdm=False)[0].outputs[0].text
    for _ in range(2):
        again = plain.client().completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=12,
            temperature=0.9,
            seed=7,
            extra_body={"top_k": 20},
        )
        assert again.choices[0].text == sampled

    # Token-id prompts go in unchanged.
    by_ids = plain.client().completions.create(
        model=MODEL, prompt=ref.prompt_token_ids, max_tokens=12, temperature=0
    )
    assert by_ids.choices[0].text == ref.outputs[0].text


def test_chat_equals_offline_greedy(plain: Served, offline: LLM) -> None:
    messages = [
        {"role": "system", "content": "w7 w8"},
        {"role": "user", "content": "w11 w12 w13"},
    ]
    ref = offline.chat(messages, greedy(10), use_tqdm=False)[0]
    resp = plain.client().chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0
    )
    assert resp.object == "chat.completion"
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == ref.outputs[0].text
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert resp.usage.completion_tokens == len(ref.outputs[0].token_ids)


def test_chat_continues_the_final_message(plain: Served, offline: LLM) -> None:
    """vLLM's extra chat parameters: add_generation_prompt=false + continue_final_message=true
    continue the last assistant message (as `LLM.chat` does); a chat that does not end with one
    is a 400 naming the problem."""
    messages = [
        {"role": "user", "content": "w11 w12 w13"},
        {"role": "assistant", "content": "w21 w22"},
    ]
    ref = offline.chat(
        messages,
        greedy(10),
        use_tqdm=False,
        add_generation_prompt=False,
        continue_final_message=True,
    )[0]
    extra = {"add_generation_prompt": False, "continue_final_message": True}
    resp = plain.client().chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0, extra_body=extra
    )
    assert resp.choices[0].message.content == ref.outputs[0].text
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    r = httpx.post(
        f"{plain.url}/v1/chat/completions", json={"model": MODEL, "messages": messages[:1], **extra}
    )
    assert r.status_code == 400 and "assistant message last" in r.json()["error"]["message"]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_stream_assembles_to_the_non_streamed_answer(plain: Served, endpoint: str) -> None:
    client = plain.client()
    common: dict[str, Any] = dict(model=MODEL, max_tokens=14, temperature=0)
    if endpoint == "completions":
        create, common["prompt"] = client.completions.create, "w33 w44 w55"
    else:
        create = client.chat.completions.create
        common["messages"] = [{"role": "user", "content": "w33 w44 w55"}]
    full = create(**common)
    chunks = list(create(**common, stream=True, stream_options={"include_usage": True}))
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1 and chunks[-1] is usage_chunks[0] and not chunks[-1].choices
    assert usage_chunks[0].usage.model_dump() == full.usage.model_dump()
    if endpoint == "completions":
        assert all(c.object == "text_completion" for c in chunks)
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        expected = full.choices[0].text
    else:
        assert all(c.object == "chat.completion.chunk" for c in chunks)
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        expected = full.choices[0].message.content
    assert text == expected
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == full.choices[0].finish_reason and not any(finishes[:-1])
    assert len({c.id for c in chunks}) == 1


def test_stream_with_stop_string_never_leaks_the_stop(plain: Served, offline: LLM) -> None:
    prompt = "w9 w99 w19"
    words = offline.generate(prompt, greedy(12), use_tqdm=False)[0].outputs[0].text.split()
    stop = " ".join(words[4:6])  # a two-word stop string in the middle of the greedy text
    expected = (
        offline.generate(
            prompt, SamplingParams(temperature=0, max_tokens=12, stop=stop), use_tqdm=False
        )[0]
        .outputs[0]
        .text
    )
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 12,
        "temperature": 0,
        "stop": [stop],
        "stream": True,
    }
    with httpx.stream("POST", f"{plain.url}/v1/completions", json=body) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert stop not in "".join(c["choices"][0]["text"] for c in chunks)


def test_raw_sse_format(plain: Served) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "w5"}],
        "max_tokens": 3,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", f"{plain.url}/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    assert raw.endswith("data: [DONE]\n\n")
    assert all(part.startswith("data: ") for part in raw.strip().split("\n\n"))


def test_64_concurrent_streams_with_hostile_neighbours(plain: Served, offline: LLM) -> None:
    prompts = [
        " ".join(f"w{4 + (i * 7 + j * 13) % 120}" for j in range(1 + i % 9)) for i in range(64)
    ]
    expected = [o.outputs[0].text for o in offline.generate(prompts, greedy(8), use_tqdm=False)]
    hostile = [
        {"prompt": "w5", "max_tokens": -1},
        {"prompt": 5},
        {"messages": []},
        {"prompt": "w5", "temperature": "hot"},
        {"prompt": [10**9]},
        {"prompt": "w5 " * 600},
    ]

    async def one(client: openai.AsyncOpenAI, prompt: str) -> tuple[str, str, int]:
        stream = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True
        )
        ids, text = set(), ""
        async for chunk in stream:
            ids.add(chunk.id)
            text += chunk.choices[0].text
        assert len(ids) == 1
        return ids.pop(), text, 0

    async def bad(http: httpx.AsyncClient, body: dict[str, Any]) -> int:
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        return (await http.post(f"{plain.url}{path}", json=body)).status_code

    async def run() -> tuple[list[tuple[str, str, int]], list[int]]:
        client = plain.async_client()
        async with httpx.AsyncClient(timeout=60) as http:
            good = [one(client, p) for p in prompts]
            worse = [bad(http, b) for b in hostile * 4]
            results = await asyncio.gather(*good, *worse)
        await client.close()
        return results[: len(good)], results[len(good) :]

    good, statuses = asyncio.run(run())
    assert [text for _, text, _ in good] == expected
    assert len({request_id for request_id, _, _ in good}) == 64
    assert all(status == 400 for status in statuses)
    engine = plain.engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


# ---------------------------------------------------------------------------------------
# Disconnects free the blocks
# ---------------------------------------------------------------------------------------


def _wait_until_idle(served: Served) -> None:
    engine = served.engine
    deadline = time.monotonic() + 20
    while engine.block_manager.num_free_blocks != engine.block_manager.num_blocks:
        assert time.monotonic() < deadline, "KV blocks were not freed"
        time.sleep(0.01)
    assert served.metrics()["blockdraft:kv_cache_usage_perc"] == 0.0


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_and_frees_blocks(
    plain: Served, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    engine = plain.engine
    aborted: list[tuple[str, bool]] = []
    original = engine.abort_request

    def spy(request_id: str) -> None:
        aborted.append((request_id, request_id in engine.requests))  # (id, still running?)
        original(request_id)

    monkeypatch.setattr(engine, "abort_request", spy)
    before = plain.metrics()['blockdraft:requests_total{finished_reason="abort"}']
    # ~500 tokens: seconds of work, far longer than it takes to notice the client is gone.
    body = {
        "model": MODEL,
        "prompt": "w5 w6",
        "max_tokens": 500,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    if stream:
        with httpx.Client(timeout=30) as http:
            with http.stream("POST", f"{plain.url}/v1/completions", json=body) as r:
                lines = r.iter_lines()
                first = next(line for line in lines if line.startswith("data: "))
                assert json.loads(first[6:])["object"] == "text_completion"
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{plain.url}/v1/completions", json=body, timeout=0.3)
    deadline = time.monotonic() + 20
    while not aborted:
        assert time.monotonic() < deadline, "the server never aborted the request"
        time.sleep(0.01)
    assert len(aborted) == 1 and aborted[0][1], "the abort came after the request had finished"
    _wait_until_idle(plain)
    after = plain.metrics()['blockdraft:requests_total{finished_reason="abort"}']
    assert after == before + 1
    assert httpx.get(f"{plain.url}/health").status_code == 200


# ---------------------------------------------------------------------------------------
# Speculative decoding: meta_info and metrics
# ---------------------------------------------------------------------------------------


def test_spec_decode_meta_info_and_metrics(spec: Served) -> None:
    before = spec.metrics()
    assert before["blockdraft:spec_decode_num_drafts_total"] == 0
    prompt_ids = [10, 11, 12]
    resp = spec.client().completions.create(
        model=MODEL,
        prompt=prompt_ids,
        max_tokens=40,
        temperature=0,
        extra_body={"return_meta_info": True},
    )
    expected = predictable_continuation(prompt_ids, 40, PRED_VOCAB)
    assert resp.choices[0].text == " ".join(f"w{t}" for t in expected)
    meta = resp.model_extra["meta_info"]
    assert meta["prompt_tokens"] == 3 and meta["completion_tokens"] == 40
    assert meta["spec_verify_ct"] >= 1
    # The agreeing drafter gets whole blocks accepted: far more than one token per step.
    assert meta["spec_accept_length"] == pytest.approx(40 / meta["spec_verify_ct"])
    assert meta["spec_accept_length"] > 4

    after = spec.metrics()
    drafts = after["blockdraft:spec_decode_num_drafts_total"]
    assert drafts == meta["spec_verify_ct"]
    assert after["blockdraft:spec_decode_num_draft_tokens_total"] > 0
    assert after["blockdraft:spec_decode_num_accepted_tokens_total"] > 0
    assert after["blockdraft:spec_decode_mean_acceptance_length"] > 4
    # Steps by chosen N: every speculative step counted once, drafts chosen in some.
    per_step = "blockdraft:spec_decode_num_drafts_per_step"
    steps = after[f"{per_step}_count"]
    assert steps == sum(spec.engine.spec_stats.steps_by_num_drafts.values()) >= drafts
    assert after[f'{per_step}_bucket{{le="15.0"}}'] == after[f'{per_step}_bucket{{le="+Inf"}}']
    assert after[f'{per_step}_bucket{{le="0.0"}}'] < steps
    assert after[f"{per_step}_sum"] >= after["blockdraft:spec_decode_num_draft_tokens_total"]
    assert after['blockdraft:requests_total{finished_reason="length"}'] == 1
    assert after["blockdraft:prompt_tokens_total"] == 3
    assert after["blockdraft:generation_tokens_total"] == 40
    for name in ("time_to_first_token", "time_per_output_token", "e2e_request_latency"):
        assert after[f"blockdraft:{name}_seconds_count"] == 1
    assert after["blockdraft:num_requests_running"] == 0
    assert after["blockdraft:num_requests_waiting"] == 0

    # Streaming carries meta_info on the finishing chunk.
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "w9"}],
        "max_tokens": 20,
        "temperature": 0,
        "stream": True,
        "return_meta_info": True,
    }
    with httpx.stream("POST", f"{spec.url}/v1/chat/completions", json=body) as r:
        chunks = [json.loads(e) for e in sse_events(r)[:-1]]
    assert chunks[-1]["meta_info"]["completion_tokens"] == 20
    assert "meta_info" not in chunks[0]


# ---------------------------------------------------------------------------------------
# API key and the bounded queue
# ---------------------------------------------------------------------------------------


def test_api_key_and_full_queue(checkpoints: dict[str, Path]) -> None:
    engine = LLMEngine(EngineConfig(model=str(checkpoints["qwen3"]), max_num_seqs=2))
    with serve(engine, api_key="sekrit", max_waiting=0) as served:
        with pytest.raises(openai.AuthenticationError):
            served.client("wrong").completions.create(model=MODEL, prompt="w5", max_tokens=2)
        r = httpx.post(f"{served.url}/v1/completions", json={"prompt": "w5"})
        assert_error(r, 401)
        assert httpx.get(f"{served.url}/v1/models").status_code == 401
        assert httpx.get(f"{served.url}/health").status_code == 200  # probes need no key
        ok = served.client("sekrit").completions.create(model=MODEL, prompt="w5", max_tokens=2)
        assert ok.usage.completion_tokens == 2

        # Two slots and no waiting room: of a burst of eight long requests, two run and the
        # rest are turned away at once.
        body = {
            "model": MODEL,
            "prompt": "w5 w6",
            "max_tokens": 150,
            "ignore_eos": True,
            "temperature": 0,
        }
        headers = {"Authorization": "Bearer sekrit"}

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=60, headers=headers) as http:
                return await asyncio.gather(
                    *[http.post(f"{served.url}/v1/completions", json=body) for _ in range(8)]
                )

        responses = asyncio.run(burst())
        statuses = sorted(r.status_code for r in responses)
        assert statuses == [200, 200] + [503] * 6, statuses
        for r in responses:
            if r.status_code == 503:
                assert r.headers["retry-after"] == "1"
                assert_error_shape = r.json()["error"]
                assert assert_error_shape["code"] == "queue_full"
            else:
                assert r.json()["usage"]["completion_tokens"] == 150
        with pytest.raises(openai.APIStatusError) as e:
            served.client("sekrit").completions.create(model=MODEL, prompt="w5", n=2)
        assert e.value.status_code == 400
        assert served.metrics()['blockdraft:rejected_requests_total{status="503"}'] == 6
        _wait_until_idle(served)


def test_openai_client_errors(plain: Served) -> None:
    client = plain.client()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="w5", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="not supported"):
        client.completions.create(model=MODEL, prompt="w5", max_tokens=2, logprobs=1)
    with pytest.raises(openai.BadRequestError, match="not supported"):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "w5"}], logprobs=True
        )
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="w5", n=3)
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.completions.create(model=MODEL, prompt="w5 " * 1000, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.completions.create(model=MODEL, prompt="w5", max_tokens=10**12)


# ---------------------------------------------------------------------------------------
# Hostile input
# ---------------------------------------------------------------------------------------


def finite(**bounds: float) -> st.SearchStrategy[float]:
    return st.floats(allow_nan=False, allow_infinity=False, **bounds)  # JSON has neither


JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), finite(), st.text(max_size=20))
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
NOT_INT = st.one_of(
    st.text(max_size=5),
    finite(),
    st.booleans(),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(), st.integers(), max_size=1),
)
NOT_NUMBER = st.one_of(st.text(max_size=5), st.booleans(), st.lists(finite(), max_size=2))
HUGE = st.integers(min_value=2**63, max_value=2**200)
# For each field, values that are certainly wrong (the type, the range, or the size).
INVALID_FIELD = {
    "max_tokens": st.one_of(NOT_INT, st.integers(max_value=0), st.integers(min_value=600), HUGE),
    "temperature": st.one_of(NOT_NUMBER, finite(max_value=-1e-9), finite(min_value=2.001)),
    "top_p": st.one_of(NOT_NUMBER, finite(max_value=0), finite(min_value=1.0001)),
    "top_k": st.one_of(NOT_INT, st.integers(max_value=-2)),
    "min_p": st.one_of(NOT_NUMBER, finite(max_value=-1e-9), finite(min_value=1.0001)),
    "seed": st.one_of(NOT_INT, HUGE, st.integers(max_value=-(2**63) - 1)),
    "n": st.one_of(NOT_INT, st.integers().filter(lambda n: n != 1)),
    "stop": st.one_of(
        st.just(""),
        st.integers(),
        st.lists(st.integers(), min_size=1),
        st.lists(st.just("w5"), min_size=17, max_size=40),
        st.text(min_size=257, max_size=300),
    ),
    "stream": st.one_of(st.integers(), st.text(max_size=3), st.none()),
    "model": st.one_of(st.integers(), st.text(max_size=10).filter(lambda m: m != MODEL)),
    "prompt": st.one_of(
        st.just(""),
        st.just([]),
        st.just("   "),
        st.integers(),
        st.dictionaries(st.text(), st.text()),
        st.lists(st.integers(min_value=VOCAB), min_size=1, max_size=3),
        st.lists(st.integers(max_value=-1), min_size=1, max_size=3),
        st.lists(st.text(min_size=1, max_size=5), min_size=2, max_size=3),
        st.just("w5 " * 2000),
    ),
    "logprobs": st.integers(min_value=0, max_value=5),
    "presence_penalty": finite(min_value=0.01, max_value=2),
}
INVALID_CHAT_FIELD = {
    "messages": st.one_of(
        st.just([]),
        st.text(max_size=5),
        st.lists(st.integers(), min_size=1, max_size=2),
        st.lists(
            st.fixed_dictionaries(
                {
                    "role": st.text(max_size=6).filter(
                        lambda r: r not in ("system", "developer", "user", "assistant", "tool")
                    ),
                    "content": st.text(max_size=5),
                }
            ),
            min_size=1,
            max_size=2,
        ),
        st.just([{"role": "user"}]),
        st.just([{"role": "user", "content": 5}]),
        st.just([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]),
        st.just([{"role": "user", "content": "w5 " * 2000}]),
    ),
    "logprobs": st.just(True),
    "top_logprobs": st.integers(min_value=1, max_value=5),
}
KNOWN_FIELDS = (
    set(INVALID_FIELD)
    | set(INVALID_CHAT_FIELD)
    | {
        "stop_token_ids",
        "stream_options",
        "frequency_penalty",
        "logit_bias",
        "user",
        "ignore_eos",
        "return_meta_info",
        "echo",
        "suffix",
        "best_of",
        "max_completion_tokens",
    }
)


def _valid_body(chat: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 2, "temperature": 0}
    if chat:
        body["messages"] = [{"role": "user", "content": "w5 w6"}]
    else:
        body["prompt"] = "w5 w6"
    return body


@st.composite
def hostile_request(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    chat = draw(st.booleans())
    body = _valid_body(chat)
    fields = {**INVALID_FIELD, **INVALID_CHAT_FIELD} if chat else INVALID_FIELD
    if chat:
        fields = {k: v for k, v in fields.items() if k != "prompt"}
    kind = draw(st.sampled_from([*fields, "unknown field"]))
    if kind == "unknown field":
        name = draw(st.text(min_size=1, max_size=12).filter(lambda k: k not in KNOWN_FIELDS))
        body[name] = draw(JSON_VALUES)
    else:
        body[kind] = draw(fields[kind])
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


@pytest.fixture(scope="module")
def http(plain: Served) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=plain.url, timeout=30) as client:
        yield client


HYPOTHESIS = settings(
    max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)


@pytest.mark.slow
@HYPOTHESIS
@given(hostile_request())
def test_invalid_fields_get_a_json_4xx(http: httpx.Client, request: tuple[str, dict]) -> None:
    path, body = request
    assert_error(http.post(path, json=body))
    assert http.get("/health").status_code == 200


@HYPOTHESIS
@given(JSON_VALUES, st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_arbitrary_json_never_breaks_the_server(http: httpx.Client, body: Any, path: str) -> None:
    r = http.post(path, json=body)
    if r.status_code != 200:  # an arbitrary value is almost never a valid request
        assert_error(r)
    assert http.get("/health").status_code == 200


@HYPOTHESIS
@given(st.binary(max_size=64))
def test_arbitrary_bytes_get_400(http: httpx.Client, body: bytes) -> None:
    assert_error(http.post("/v1/completions", content=body), 400)
    assert http.get("/health").status_code == 200


@pytest.mark.parametrize(
    "raw",
    [
        b'{"prompt": "\xff\xfe w5"}',  # invalid UTF-8
        b'{"prompt": "\\ud800 w5", "max_tokens": 2}',  # a lone surrogate
        b'{"prompt": "w5", "temperature": NaN}',
        b'{"prompt": "w5", "temperature": 1e999}',
        b'{"prompt": "w5", "max_tokens": 1' + b"0" * 5000 + b"}",  # beyond int parsing
        b"[" * 100_000 + b"]" * 100_000,  # nesting
        b'{"prompt": "w5", "prompt": 7}',  # the last duplicate wins: not a string
        b"",
        b"null",
    ],
)
def test_malformed_bodies(http: httpx.Client, raw: bytes) -> None:
    assert_error(http.post("/v1/completions", content=raw))
    assert http.get("/health").status_code == 200


def test_enormous_and_odd_requests(http: httpx.Client) -> None:
    huge = b'{"prompt": "' + b"w5 " * (3 * 2**20) + b'"}'  # 9 MiB: over the body limit
    assert_error(http.post("/v1/completions", content=huge), 413)
    big = {"model": MODEL, "prompt": "w5 " * 200_000, "max_tokens": 2}  # fits, too long
    assert "context length" in assert_error(http.post("/v1/completions", json=big), 400)["message"]
    ids = {"model": MODEL, "prompt": list(range(4, 100)) * 100, "max_tokens": 2}
    assert_error(http.post("/v1/completions", json=ids), 400)
    assert_error(http.get("/v1/completions"), 405)
    assert_error(http.get("/nowhere"), 404)
    # Empty string content is a valid (if pointless) chat turn; the template gives it tokens.
    ok = http.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": ""}], "max_tokens": 2},
    )
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] <= 2
    assert http.get("/health").status_code == 200


def test_cli_has_serve() -> None:
    with pytest.raises(SystemExit) as e:
        cli_main(["serve", "--help"])
    assert e.value.code == 0


def test_log_engine_start_shows_the_engine_times_on_stderr(capsys) -> None:
    log = logging.getLogger("blockdraft")
    handlers, level = list(log.handlers), log.level
    log.handlers = []
    try:
        log_engine_start()
        log_engine_start()  # a second call adds no second handler
        assert len(log.handlers) == 1
        logging.getLogger("blockdraft.engine.llm_engine").info("engine ready in 1.0 s")
        assert "INFO:     engine ready in 1.0 s" in capsys.readouterr().err
    finally:
        log.handlers = handlers
        log.setLevel(level)
