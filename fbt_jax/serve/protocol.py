"""The OpenAI request bodies the server takes (`/v1/completions`, `/v1/chat/completions`), checked
by pydantic, and the one-line error a client gets for a bad one (HTTP 400, OpenAI's error shape)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from fbt_jax.serve.engine import TOP_LOGPROBS

MAX_CHOICES = 16  # n: choices per prompt


class ApiError(Exception):
    """An error answered as {"error": {...}} with its HTTP status (400 for the client's mistakes)."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 headers: dict[str, str] | None = None):  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.headers = status, message, kind, param, headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


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
        return f"the request has no {'.'.join(where)!r}; it is required", field
    if first.get("type") == "extra_forbidden":
        return f"{'.'.join(where)!r} is not a field this server takes; remove it", field
    if not where:
        return f"the request body must be a JSON object ({first['msg']})", None
    value = first.get("input")
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    message = first["msg"].removeprefix("Value error, ")
    return f"{'.'.join(where)}={shown}: {message}", field


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

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop: str | list[str] | None) -> list[str]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("give at most 4 stop strings, none empty")
        return stops

    @model_validator(mode="after")
    def _no_penalties(self) -> Sampled:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0.0:
                raise ValueError(f"{name} is not supported by this server; leave it at 0")
        return self

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

    @model_validator(mode="after")
    def _unsupported(self) -> CompletionRequest:
        if self.best_of not in (None, 1, self.n):
            raise ValueError("best_of is not supported by this server; leave it out (n gives several choices)")
        if self.suffix:
            raise ValueError("suffix (insertion) is not supported by this server; leave it out")
        return self


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
