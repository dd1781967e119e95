"""The OpenAI request bodies the server takes (`/v1/completions`, `/v1/chat/completions`), checked
by pydantic, and the one-line error a client gets for a bad one, in OpenAI's shape
(`{"error": {"message", "type", "param", "code"}}`), whatever raised it: the handlers' own
(`ApiError`), pydantic's (a body that does not validate), Starlette's (an unknown route, a wrong
method, a body that cannot be read) and an unexpected exception (500). Each error is counted in
/metrics: refused (4xx, and 503 while draining) or failed (5xx). Also the refusals that need words
of their own: text that is not Unicode, a request larger than the pool ever holds."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from starlette.exceptions import HTTPException

from fbt_jax.serve.engine import TOP_LOGPROBS
from fbt_jax.serve.metrics import Metrics

if TYPE_CHECKING:
    from fbt_jax.serve.pool import Pool

MAX_CHOICES = 16  # n: choices per prompt
# Fields OpenAI documents as nullable that this server does not model: null is their default (absent),
# so a client that sends them as null asks for nothing the server lacks.
OPENAI_NULLABLE = frozenset({"logit_bias", "tools", "tool_choice", "functions", "function_call", "response_format",
                             "parallel_tool_calls", "service_tier", "store", "metadata", "modalities", "prediction",
                             "audio", "reasoning_effort", "web_search_options"})  # fmt: skip


class ApiError(Exception):
    """An error answered as {"error": {...}} with its HTTP status (4xx for the client's mistakes)."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 headers: dict[str, str] | None = None, code: str | None = None):  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.headers = status, message, kind, param, headers or {}
        self.code = code  # OpenAI's machine-readable reason where it has one (model_not_found)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def validation_line(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """pydantic's first complaint as one line naming the field, and the field."""
    first = errors[0]
    where = [str(part) for part in first.get("loc", ()) if part != "body"]
    field = where[0] if where else None
    if first.get("type") == "json_invalid":
        return (
            f"the request body is not valid JSON ({first.get('ctx', {}).get('error', first['msg'])}); send a JSON object",
            None,
        )
    if first.get("type") == "missing":
        if not where:
            return "the request has no body; send a JSON object", None
        return f"the request has no {'.'.join(where)!r}; it is required", field
    if first.get("type") == "extra_forbidden":
        return f"{'.'.join(where)!r} is not a field this server takes; remove it", field
    if not where:
        return f"the request body must be a JSON object ({first['msg']})", None
    value = first.get("input")
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    message = first["msg"].removeprefix("Value error, ")
    return f"{'.'.join(where)}={shown}: {message}", field


ENDPOINTS = "POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, GET /metrics"


def install_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    """Answer every error of `app` in OpenAI's shape, and count it."""

    def answer(err: ApiError) -> JSONResponse:
        metrics.error(err.status)
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError) -> JSONResponse:
        return answer(err)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        message, param = validation_line(list(err.errors()))
        return answer(ApiError(400, message, param=param))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> JSONResponse:
        return answer(route_error(request.method, request.url.path, err))

    # Starlette logs the traceback of what reaches this handler (a bug of the server's, worth one):
    # the client's own mistakes are refused above, never here.
    @app.exception_handler(Exception)
    async def failed(request: Request, err: Exception) -> JSONResponse:
        line = str(err).splitlines()[0] if str(err) else type(err).__name__
        return answer(ApiError(500, f"the server failed on this request: {line}", "server_error"))


def route_error(method: str, path: str, err: HTTPException) -> ApiError:
    """Starlette's refusals (FastAPI's `{"detail": ...}`) as one line that says what to send instead."""
    headers = dict(err.headers or {})
    if err.status_code == 404:
        return ApiError(404, f"{method} {path} is not an endpoint of this server; it serves {ENDPOINTS}")
    if err.status_code == 405:
        allowed = headers.get("allow", headers.get("Allow", "another method"))
        return ApiError(405, f"{method} is not allowed on {path}; use {allowed}", headers=headers)
    detail = " ".join(str(err.detail).split())
    if err.status_code == 400:  # FastAPI's "There was an error parsing the body"
        return ApiError(400, f"{detail.rstrip('.')}; send a JSON object in UTF-8", headers=headers)
    return ApiError(err.status_code, detail, headers=headers)


def check_unicode(text: str, param: str) -> str:
    """`text` if it is Unicode text; a 400 naming the first lone surrogate (JSON's "\\ud800" escape
    without its pair decodes to one, and no tokenizer or UTF-8 encoder takes it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ApiError(400, f"{param} holds a lone surrogate ({ascii(text[err.start])} at character {err.start}), "
                            "which is not text; send valid Unicode (a character beyond U+FFFF as a surrogate pair)",
                       param=param) from None  # fmt: skip
    return text


def too_large(prompts: int, n: int, pool: Pool) -> ApiError:
    """The 400 for a request with more choices (prompts × n) than the pool ever holds at once."""
    capacity = pool.capacity
    held = f"the most this server holds at once is {capacity} (--slots={pool.num_slots} + --max-waiting={pool.max_waiting})"
    if prompts == 1 or n > capacity:
        return ApiError(400, f"n={n} choices can never be served: {held}; ask for n <= {capacity}, or raise "
                             "--max-waiting", param="n")  # fmt: skip
    return ApiError(400, f"{prompts} prompts × n={n} = {prompts * n} choices can never be served: {held}; send at "
                         f"most {max(capacity // n, 1)} prompts per request, or raise --max-waiting", param="prompt")  # fmt: skip


class Sampled(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = None  # default: 16 for completions, the rest of the context for chat
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = Field(None, validate_default=True)  # a list after validation
    seed: int | None = None
    user: str | None = None  # accepted, unused
    presence_penalty: float = 0.0  # accepted at 0 only: penalties are not built
    frequency_penalty: float = 0.0

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, body: Any) -> Any:
        """An optional field sent as JSON null takes its default, as OpenAI's API reads it."""
        if not isinstance(body, dict):
            return body
        optional = {name for name, field in cls.model_fields.items() if not field.is_required()} | OPENAI_NULLABLE
        return {key: value for key, value in body.items() if value is not None or key not in optional}

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop: str | list[str] | None) -> list[str]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("give at most 4 stop strings, none empty")
        return stops

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalties(cls, penalty: float) -> float:
        if penalty != 0.0:  # a field validator, so that the error names the field (pydantic's loc)
            raise ValueError("penalties are not supported by this server; leave it at 0 or out")
        return penalty

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(Sampled):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _some_prompt(cls, prompt: Any) -> Any:
        if isinstance(prompt, list) and not prompt:
            raise ValueError("the prompt list is empty; give a string, strings, or token ids")
        return prompt

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        if best_of not in (None, 1, info.data.get("n", 1)):  # n is validated first (Sampled's fields come first)
            raise ValueError("best_of is not supported by this server; leave it out (n gives several choices)")
        return best_of

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> str | None:
        if suffix:
            raise ValueError("suffix (insertion) is not supported by this server; leave it out")
        return suffix


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: the text ones, in order
            return "".join(part.get("text", "") for part in self.content if part.get("type") == "text")
        return self.content or ""


class ChatRequest(Sampled):
    messages: list[Message] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=TOP_LOGPROBS)
    max_completion_tokens: int | None = None

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
