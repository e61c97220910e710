"""Request bodies of the OpenAI-compatible API, and their translation to engine inputs.

Validation is strict on purpose: a wrong type is an error (no "5" -> 5 coercion), unknown fields
are errors (a silently ignored `tools` or `response_format` would hand back an answer the client
did not ask for), and every number is bounded so that nothing a client sends can reach the
sampler as an overflowing tensor.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from blockdraft.sampling_params import SamplingParams

RequestT = TypeVar("RequestT", bound=BaseModel)

MAX_BODY_BYTES = 8 * 2**20
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
# Temperatures this small behave as greedy anyway, and logits / t would overflow float32.
MIN_SAMPLING_TEMPERATURE = 1e-5
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {message, type, param, code}}."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


TokenIds = list[Annotated[int, Field(ge=0, lt=2**63)]]


class _CommonRequest(_Strict):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    stop: (
        Annotated[str, Field(min_length=1, max_length=MAX_STOP_LENGTH)]
        | list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_LENGTH)]]
        | None
    ) = Field(default=None)
    stop_token_ids: TokenIds | None = Field(default=None, max_length=MAX_STOP_STRINGS)
    # OpenAI documents seeds as any int64; the engine takes [0, 2**63), so negatives wrap.
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)
    n: int = Field(default=1, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(default=0.0, ge=0, le=0)
    frequency_penalty: float = Field(default=0.0, ge=0, le=0)
    logit_bias: dict[str, float] | None = Field(default=None, max_length=0)
    user: str | None = None
    ignore_eos: bool = False
    return_meta_info: bool = False  # SGLang: per-request speculative-decoding statistics

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


class CompletionRequest(_CommonRequest):
    prompt: str | TokenIds | list[str] | list[TokenIds]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1, le=1)
    logprobs: int | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ChatCompletionRequest(_CommonRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=0)
    # vLLM's extra chat parameters: continue the final assistant message instead of replying.
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def requested_max_tokens(self) -> int | None:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ApiError(
                400,
                "give max_tokens or max_completion_tokens, not both",
                param="max_completion_tokens",
            )
        return self.max_completion_tokens or self.max_tokens


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def parse_json(body: bytes) -> dict[str, Any]:
    """Decodes a request body; anything but a JSON object is a 400."""
    try:
        data = json.loads(body, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        # ValueError covers JSONDecodeError, UnicodeDecodeError and over-long integers.
        reason = "nesting too deep" if isinstance(e, RecursionError) else str(e)[:200]
        raise ApiError(400, f"the request body is not valid JSON: {reason}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return data


def parse_request(cls: type[RequestT], data: dict[str, Any]) -> RequestT:
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        errors = e.errors(include_input=False, include_url=False)
        first = errors[0]
        # Union members each report their own error; the location's first element is the
        # field the client got wrong, which is what OpenAI's `param` names.
        param = str(first["loc"][0])[:100] if first["loc"] else None
        where = ".".join(str(p) for p in first["loc"])[:200]
        message = first["msg"]
        if first["type"] == "extra_forbidden":
            message = "unknown or unsupported parameter"
        more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
        raise ApiError(400, f"{where}: {message}{more}", param=param) from None


def check_unsupported(req: CompletionRequest | ChatCompletionRequest) -> None:
    """Parameters that are accepted only at their trivial value."""
    if isinstance(req, CompletionRequest):
        if req.logprobs is not None:
            raise ApiError(400, "logprobs are not supported", param="logprobs")
        if req.echo:
            raise ApiError(400, "echo is not supported", param="echo")
        if req.suffix:
            raise ApiError(400, "suffix is not supported", param="suffix")
    elif req.logprobs:
        raise ApiError(400, "logprobs are not supported", param="logprobs")


def completion_prompt(req: CompletionRequest) -> str | list[int]:
    """The single prompt of a completion request (a list of one prompt is accepted too)."""
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise ApiError(400, "only one prompt per request is supported", param="prompt")
        prompt = prompt[0]
    if not prompt:
        raise ApiError(400, "prompt is empty", param="prompt")
    return prompt


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.text()} for m in req.messages]


def sampling_params(
    req: CompletionRequest | ChatCompletionRequest,
    *,
    prompt_len: int,
    max_model_len: int,
    vocab_size: int,
    defaults: dict[str, Any],
    default_max_tokens: int | None,
) -> SamplingParams:
    """SamplingParams for a request; unset sampling fields take the checkpoint's defaults."""
    room = max_model_len - prompt_len
    if room < 1:
        raise ApiError(
            400,
            f"the prompt has {prompt_len} tokens, but this model's maximum context length is "
            f"{max_model_len} tokens, which leaves no room for a completion",
            param="messages" if isinstance(req, ChatCompletionRequest) else "prompt",
            code="context_length_exceeded",
        )
    max_tokens = req.requested_max_tokens()
    if max_tokens is not None and max_tokens > room:
        raise ApiError(
            400,
            f"this model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{prompt_len} and max_tokens asks for {max_tokens} more",
            param="max_tokens",
            code="context_length_exceeded",
        )
    if max_tokens is None:
        max_tokens = min(default_max_tokens or room, room)

    def pick(name: str, fallback: float | int) -> Any:
        value = getattr(req, name)
        return value if value is not None else defaults.get(name, fallback)

    temperature = float(pick("temperature", 1.0))
    if temperature < MIN_SAMPLING_TEMPERATURE:
        temperature = 0.0
    top_k = int(pick("top_k", 0))
    if top_k >= vocab_size:
        top_k = 0  # keeping the whole vocabulary is no top-k at all
    stop = req.stop
    if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:
        raise ApiError(400, f"at most {MAX_STOP_STRINGS} stop strings", param="stop")
    try:
        return SamplingParams(
            temperature=temperature,
            top_p=float(pick("top_p", 1.0)),
            top_k=top_k,
            min_p=float(pick("min_p", 0.0)),
            max_tokens=max_tokens,
            seed=None if req.seed is None else req.seed % 2**63,
            stop=stop,
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos,
        )
    except ValueError as e:
        raise ApiError(400, str(e)[:500]) from None
