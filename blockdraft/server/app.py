"""The OpenAI-compatible HTTP API over one LLMEngine.

POST /v1/completions, POST /v1/chat/completions (both with SSE streaming), GET /v1/models,
GET /health, GET /metrics. Every error is answered in OpenAI's shape,
{"error": {"message", "type", "param", "code"}}; bad input is always a 4xx, never a 500, and is
rejected before it reaches the engine, so it cannot disturb the requests already running.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response, StreamingResponse

from blockdraft.engine.llm_engine import LLMEngine
from blockdraft.llm import describe_engine
from blockdraft.outputs import RequestOutput
from blockdraft.server.async_engine import (
    AsyncEngine,
    EngineError,
    QueueFullError,
    RequestAborted,
    RequestHandle,
)
from blockdraft.server.metrics import ServerMetrics
from blockdraft.server.protocol import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    MAX_BODY_BYTES,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    chat_messages,
    check_unsupported,
    completion_prompt,
    parse_json,
    parse_request,
    sampling_params,
)
from blockdraft.threads import apply_num_threads

logger = logging.getLogger(__name__)

DEFAULT_MAX_WAITING = 256
RETRY_AFTER_S = 1


def _json_response(
    content: Any, status: int = 200, headers: dict[str, str] | None = None, *, ascii: bool = False
) -> Response:
    # Error messages may quote client input, which can hold lone surrogates that UTF-8 cannot
    # encode; ASCII escapes make any string representable.
    body = json.dumps(content, ensure_ascii=ascii, separators=(",", ":")).encode()
    return Response(body, status_code=status, headers=headers, media_type="application/json")


def _error_response(error: ApiError) -> Response:
    return _json_response(error.body(), error.status, error.headers, ascii=True)


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _read_body(request: Request) -> bytes:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise ApiError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def _abort_on_disconnect(request: Request, handle: RequestHandle) -> None:
    """Aborts the request when its client goes away, so its KV blocks are freed at once.

    The body has been read by now, so the next ASGI message is the disconnect (uvicorn also
    sends one when the response completes, by which time the abort is a no-op)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            handle.abort()
            return


def _visible_text(text: str, finished: bool, holdback: int) -> str:
    """The part of a running request's text that cannot change any more.

    The tail may still become a stop string (which is cut from the output) and a trailing
    U+FFFD may be half of a multi-byte character; both are held back until more tokens come."""
    if finished:
        return text
    if holdback:
        text = text[: max(0, len(text) - holdback)]
    return text.rstrip("\ufffd")


@dataclass
class _Call:
    """One generation request as the handlers see it."""

    request_id: str
    kind: str  # "completion" | "chat"
    req: CompletionRequest | ChatCompletionRequest
    num_prompt_tokens: int
    created: int = field(default_factory=lambda: int(time.time()))
    arrival: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    last: RequestOutput | None = None

    def observe(self, out: RequestOutput) -> None:
        if self.first_token is None and out.outputs[0].token_ids:
            self.first_token = time.perf_counter()
        self.last = out

    @property
    def num_generated(self) -> int:
        return len(self.last.outputs[0].token_ids) if self.last is not None else 0

    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": self.num_generated,
            "total_tokens": self.num_prompt_tokens + self.num_generated,
        }

    def meta_info(self) -> dict[str, Any]:
        """SGLang's per-request statistics. spec_accept_length is, as in SGLang, generated
        tokens per verify step (the prefill's token included); 1.0 without speculation."""
        lengths = self.last.spec_accept_lengths if self.last is not None else []
        verify_ct = len(lengths)
        return {
            "id": self.request_id,
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": self.num_generated,
            "spec_verify_ct": verify_ct,
            "spec_accept_length": self.num_generated / verify_ct if verify_ct else 1.0,
            "e2e_latency": time.perf_counter() - self.arrival,
        }


class _Server:
    def __init__(
        self, engine: LLMEngine, served_model_name: str, api_key: str | None, max_waiting: int
    ) -> None:
        self.llm_engine = engine
        self.engine = AsyncEngine(engine, max_waiting)
        self.metrics = ServerMetrics(self.engine)
        self.model_name = served_model_name
        self.api_key = api_key
        self.started = int(time.time())

    # -- checks --------------------------------------------------------------------------
    def authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), self.api_key.encode()
        ):
            raise ApiError(
                401,
                "invalid or missing API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(
                404,
                f"the model '{model[:200]}' does not exist; this server has '{self.model_name}'",
                param="model",
                code="model_not_found",
            )

    # -- prompts -------------------------------------------------------------------------
    async def prompt_ids(self, req: CompletionRequest | ChatCompletionRequest) -> list[int]:
        tokenizer = self.llm_engine.tokenizer
        if isinstance(req, CompletionRequest):
            prompt = completion_prompt(req)
            if isinstance(prompt, list):
                return prompt
            if tokenizer is None:
                raise ApiError(400, "this model has no tokenizer: send token ids", param="prompt")
            return await self._tokenize(lambda: tokenizer.encode(prompt), "prompt")
        if tokenizer is None:
            raise ApiError(400, "this model has no tokenizer, so no chat template")
        messages = chat_messages(req)

        def render() -> list[int]:
            return tokenizer.encode_chat(
                messages, req.add_generation_prompt, req.continue_final_message
            )

        return await self._tokenize(render, "messages")

    @staticmethod
    async def _tokenize(fn: Any, param: str) -> list[int]:
        # Off the event loop: a long prompt takes a while to tokenize, and other requests'
        # streams must keep flowing meanwhile.
        try:
            return await asyncio.to_thread(fn)
        except ValueError as e:
            raise ApiError(400, str(e)[:500], param=param) from None
        except Exception as e:  # the tokenizer library's own errors, e.g. on lone surrogates
            raise ApiError(
                400, f"the {param} could not be tokenized: {e!r}"[:500], param=param
            ) from None

    # -- generation ----------------------------------------------------------------------
    async def generate(self, request: Request, kind: str) -> Response:
        self.authorize(request)
        data = parse_json(await _read_body(request))
        cls = CompletionRequest if kind == "completion" else ChatCompletionRequest
        req = parse_request(cls, data)
        check_unsupported(req)
        self.check_model(req.model)
        prompt_ids = await self.prompt_ids(req)
        params = sampling_params(
            req,
            prompt_len=len(prompt_ids),
            max_model_len=self.llm_engine.max_model_len,
            vocab_size=self.llm_engine.model.cfg.vocab_size,
            defaults=self.llm_engine.generation_defaults,
            default_max_tokens=DEFAULT_COMPLETION_MAX_TOKENS if kind == "completion" else None,
        )
        prefix = "cmpl" if kind == "completion" else "chatcmpl"
        call = _Call(f"{prefix}-{uuid.uuid4().hex}", kind, req, len(prompt_ids))
        try:
            handle = await self.engine.add_request(call.request_id, prompt_ids, params)
        except QueueFullError:
            raise ApiError(
                503,
                "the server is at capacity and its waiting queue is full; retry later",
                type="server_overloaded",
                code="queue_full",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            ) from None
        except ValueError as e:
            raise ApiError(400, str(e)[:500]) from None
        except EngineError as e:
            raise ApiError(503, str(e)[:500], type="server_error") from None
        if req.stream:
            return StreamingResponse(
                self._stream(request, handle, call),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return await self._complete(request, handle, call)

    def _finish(self, call: _Call, reason: str) -> None:
        self.metrics.record_finished(
            call.last, reason, call.arrival, call.first_token, time.perf_counter()
        )

    async def _complete(self, request: Request, handle: RequestHandle, call: _Call) -> Response:
        watcher = asyncio.create_task(_abort_on_disconnect(request, handle))
        reason = "error"
        try:
            async for out in handle.outputs():
                call.observe(out)
            assert call.last is not None
            reason = call.last.outputs[0].finish_reason or "stop"
        except RequestAborted:
            reason = "abort"
            return Response(status_code=499)  # nobody is listening any more
        except EngineError as e:
            raise ApiError(500, str(e)[:500], type="server_error") from None
        finally:
            watcher.cancel()
            handle.abort()
            self._finish(call, reason)
        return _json_response(self._full_response(call))

    def _full_response(self, call: _Call) -> dict[str, Any]:
        assert call.last is not None
        completion = call.last.outputs[0]
        choice: dict[str, Any] = {"index": 0}
        if call.kind == "completion":
            choice["text"] = completion.text
        else:
            choice["message"] = {"role": "assistant", "content": completion.text}
        choice.update(
            logprobs=None,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
        )
        body: dict[str, Any] = {
            "id": call.request_id,
            "object": "text_completion" if call.kind == "completion" else "chat.completion",
            "created": call.created,
            "model": self.model_name,
            "choices": [choice],
            "usage": call.usage(),
        }
        if call.req.return_meta_info:
            body["meta_info"] = call.meta_info()
        return body

    def _chunk(
        self, call: _Call, delta: str | None, finish_reason: str | None, role: bool = False
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if call.kind == "completion":
            choice["text"] = delta or ""
        else:
            message: dict[str, str] = {"role": "assistant"} if role else {}
            if delta is not None:
                message["content"] = delta
            choice["delta"] = message
        choice.update(logprobs=None, finish_reason=finish_reason)
        chunk: dict[str, Any] = {
            "id": call.request_id,
            "object": "text_completion" if call.kind == "completion" else "chat.completion.chunk",
            "created": call.created,
            "model": self.model_name,
            "choices": [choice],
        }
        if call.req.include_usage:
            chunk["usage"] = None  # OpenAI: null on every chunk but the last
        return chunk

    async def _stream(
        self, request: Request, handle: RequestHandle, call: _Call
    ) -> AsyncIterator[str]:
        watcher = asyncio.create_task(_abort_on_disconnect(request, handle))
        reason = "abort"  # what it is unless the loop below completes
        stop = call.req.stop
        holdback = (
            max((len(s) for s in ([stop] if isinstance(stop, str) else stop or [])), default=1) - 1
        )
        try:
            if call.kind == "chat":
                yield _sse(self._chunk(call, "", None, role=True))
            sent = 0
            async for out in handle.outputs():
                call.observe(out)
                completion = out.outputs[0]
                visible = _visible_text(completion.text, out.finished, holdback)
                delta = visible[sent:]
                sent = max(sent, len(visible))
                if out.finished:
                    reason = completion.finish_reason or "stop"
                    chunk = self._chunk(call, delta, reason)
                    chunk["choices"][0]["stop_reason"] = completion.stop_reason
                    if call.req.return_meta_info:
                        chunk["meta_info"] = call.meta_info()
                    yield _sse(chunk)
                elif delta:
                    yield _sse(self._chunk(call, delta, None))
            if call.req.include_usage:
                usage = self._chunk(call, None, None)
                usage["choices"], usage["usage"] = [], call.usage()
                yield _sse(usage)
            yield "data: [DONE]\n\n"
        except RequestAborted:
            pass
        except EngineError as e:
            reason = "error"
            yield _sse(ApiError(500, str(e)[:500], type="server_error").body())
            yield "data: [DONE]\n\n"
        finally:
            watcher.cancel()
            handle.abort()  # a no-op once finished; frees the blocks of a dropped stream
            self._finish(call, reason)

    # -- the rest ------------------------------------------------------------------------
    def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "created": self.started,
                    "owned_by": "blockdraft",
                    "max_model_len": self.llm_engine.max_model_len,
                }
            ],
        }


def build_app(
    engine: LLMEngine,
    served_model_name: str,
    api_key: str | None = None,
    max_waiting: int = DEFAULT_MAX_WAITING,
) -> FastAPI:
    """A FastAPI app serving `engine` under the model name `served_model_name`.

    `api_key` guards /v1/* (health and metrics stay open, for probes and scrapers).
    `max_waiting` bounds the queue: once all `max_num_seqs` slots are busy and that many
    requests already wait, new ones get 503 with Retry-After.
    """
    server = _Server(engine, served_model_name, api_key, max_waiting)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server.engine.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            server.engine.shutdown()

    app = FastAPI(
        title="blockdraft", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.server = server
    app.state.engine = engine
    app.state.async_engine = server.engine
    app.state.metrics = server.metrics

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> Response:
        server.metrics.record_rejected(exc.status)
        return _error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        server.metrics.record_rejected(exc.status_code)
        error = ApiError(
            exc.status_code,
            str(exc.detail)[:500],
            headers=dict(exc.headers) if exc.headers else None,
        )
        return _error_response(error)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        server.metrics.record_rejected(400)
        return _error_response(ApiError(400, f"invalid request: {exc.errors()!r}"[:500]))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        server.metrics.record_rejected(500)
        return _error_response(ApiError(500, "internal server error", type="server_error"))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await server.generate(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await server.generate(request, "chat")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        server.authorize(request)
        return _json_response(server.models())

    @app.get("/health")
    async def health() -> Response:
        if not server.engine.is_alive:
            return _error_response(
                ApiError(503, "the engine loop is not running", type="server_error")
            )
        return _json_response({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4")

    return app


def log_engine_start() -> None:
    """Shows blockdraft's INFO lines (the engine's load, CUDA-graph capture and warm-up times)
    on stderr, in uvicorn's format, unless the application configured its own handlers."""
    log = logging.getLogger("blockdraft")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)


def run_server(
    engine_kwargs: dict[str, Any],
    *,
    host: str,
    port: int,
    served_model_name: str,
    api_key: str | None = None,
    max_waiting: int = DEFAULT_MAX_WAITING,
) -> None:
    """Loads the engine and serves it until interrupted (`blockdraft serve`)."""
    import uvicorn

    from blockdraft.config import EngineConfig, check_can_run

    log_engine_start()
    config = EngineConfig(**engine_kwargs)
    check_can_run(config)
    threads = apply_num_threads(config.num_threads)
    engine = LLMEngine(config)
    logger.info("serving %s", describe_engine(engine, threads))
    app = build_app(engine, served_model_name, api_key=api_key, max_waiting=max_waiting)
    with contextlib.suppress(KeyboardInterrupt):
        uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5)
