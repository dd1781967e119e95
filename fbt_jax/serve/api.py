"""The HTTP side of fbt-serve: an OpenAI-compatible API (FastAPI) in front of the decode pool.

    GET  /v1/models               one id per decoding mode: NAME (standard), NAME:soft, NAME:fused
    GET  /v1/models/{id}          one of them (404 model_not_found for any other id)
    POST /v1/completions          prompts as text or token ids; streaming, logprobs, echo, n, stop
    POST /v1/chat/completions     where the run's tokenizer carries a chat template
    GET  /health, GET /metrics    liveness; Prometheus' text format
    GET  /tokenizer_info, POST /tokenize, POST /detokenize   vLLM's tokenizer endpoints (what
                                  lm-evaluation-harness's local-completions reads)

Handlers are async and only check requests, queue them (`Pool.submit`) and read their events: the
device work is the pool's thread. Every error, raised here or not, is answered in OpenAI's shape
(`protocol.install_error_handlers`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import secrets
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from fbt_jax.decode import MODES
from fbt_jax.serve import protocol, responses
from fbt_jax.serve.pool import Draining, Pool, QueueFull, TooLarge
from fbt_jax.serve.pool import Request as PoolRequest
from fbt_jax.serve.protocol import ApiError
from fbt_jax.serve.text import ChatTemplate, Codec, stop_check

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for completions
# How often a non-streamed request asks whether its client is still there: a client gone frees its
# slots within this (and the decode trip in flight), whether or not tokens keep coming.
DISCONNECT_CHECK_S = 0.1


@dataclasses.dataclass
class Served:
    """A loaded run behind the API, and its decode pool."""

    name: str
    pool: Pool
    codec: Codec
    vocab_size: int
    chat: ChatTemplate | None = None
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    @property
    def context_len(self) -> int:
        return self.pool.context_len

    def model_ids(self) -> list[str]:
        return [self.name if mode == "standard" else f"{self.name}:{mode}" for mode in MODES]

    def mode(self, model: str) -> str:
        """The decoding mode a model id names; 404 model_not_found (as OpenAI answers) for another id."""
        ids = self.model_ids()
        if model not in ids:
            raise ApiError(404, f"model {model!r} is not served here; use one of {', '.join(ids)}", param="model",
                           code="model_not_found")  # fmt: skip
        return MODES[ids.index(model)]

    def model_card(self, model: str) -> dict[str, Any]:
        return {"id": model, "object": "model", "created": self.created, "owned_by": "fbt-jax",
                "max_model_len": self.context_len}  # fmt: skip


def create_app(served: Served) -> FastAPI:
    """The API over a compiled pool; its thread starts with the app and stops after the last request."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        thread = threading.Thread(target=served.pool.run, name="fbt-serve-device", daemon=True)
        thread.start()
        yield
        served.pool.drain()
        served.pool.stop()
        thread.join(timeout=60)

    app = FastAPI(title="fbt-serve", lifespan=lifespan)
    protocol.install_error_handlers(app, served.pool.metrics)

    @app.get("/health")
    async def health() -> Response:
        if served.pool.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(served.pool.metrics.exposition(), media_type=served.pool.metrics.content_type)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [served.model_card(i) for i in served.model_ids()]}

    @app.get("/v1/models/{model}")
    async def model(model: str) -> dict[str, Any]:
        served.mode(model)  # 404 model_not_found for an id not served here
        return served.model_card(model)

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        return {**served.codec.info(), "model_max_length": served.context_len}

    @app.post("/tokenize")
    async def tokenize(body: dict[str, Any]) -> dict[str, Any]:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise ApiError(400, "/tokenize needs a string 'prompt'", param="prompt")
        tokens = _encode(served, prompt, "prompt")
        return {"tokens": tokens, "count": len(tokens), "max_model_len": served.context_len}

    @app.post("/detokenize")
    async def detokenize(body: dict[str, Any]) -> dict[str, Any]:
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise ApiError(400, "/detokenize needs 'tokens', a list of token ids", param="tokens")
        _check_ids(served, tokens, "tokens")
        return {"prompt": served.codec.render(tokens)}

    @app.post("/v1/completions")
    async def completions(body: protocol.CompletionRequest, request: Request) -> Response:
        mode = served.mode(body.model)
        prompts = _prompts(served, body.prompt)
        max_tokens = COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        _check_lengths(served, prompts, max_tokens, body.echo)
        texts = [served.codec.render(p) if body.echo else "" for p in prompts]
        return await _answer(served, request, body, mode, prompts, max_tokens, texts, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: protocol.ChatRequest, request: Request) -> Response:
        mode = served.mode(body.model)
        if served.chat is None:
            raise ApiError(400, f"{served.name} has no chat template (a base model's tokenizer carries none); "
                                "use /v1/completions", param="messages")  # fmt: skip
        texts = [protocol.check_unicode(m.text(), "messages") for m in body.messages]
        try:
            prompt = served.chat.encode([{"role": m.role, "content": t} for m, t in zip(body.messages, texts)])
        except Exception as err:  # the template's own raise_exception, or a template error
            raise ApiError(400, f"the chat template rejects these messages: {err}", param="messages") from None
        prompt = _check_ids(served, prompt, "messages")
        limit = body.token_limit()
        max_tokens = served.context_len - len(prompt) if limit is None else limit
        _check_lengths(served, [prompt], max_tokens, echo=False)
        return await _answer(served, request, body, mode, [prompt], max_tokens, [""], chat=True)

    return app


def _encode(served: Served, text: str, param: str) -> list[int]:
    from fbt_jax.errors import ConfigError

    protocol.check_unicode(text, param)  # a tokenizer given a lone surrogate raises as if the server failed
    try:
        return [int(i) for i in served.codec.encode(text)]
    except ConfigError as err:
        raise ApiError(400, str(err), param=param) from None


def _check_ids(served: Served, ids: list[int], param: str) -> list[int]:
    bad = [t for t in ids if not 0 <= t < served.vocab_size]
    if bad:
        raise ApiError(400, f"token id {bad[0]} is outside the vocabulary [0, {served.vocab_size})", param=param)
    return ids


def _prompts(served: Served, prompt: Any) -> list[list[int]]:
    if isinstance(prompt, str):
        prompts = [_encode(served, prompt, "prompt")]
    elif all(isinstance(p, str) for p in prompt):
        prompts = [_encode(served, p, "prompt") for p in prompt]
    elif all(isinstance(p, int) for p in prompt):
        prompts = [list(prompt)]
    else:
        prompts = [list(p) for p in prompt]
    for ids in prompts:
        if not ids:
            raise ApiError(400, "a prompt is empty; every prompt needs at least one token", param="prompt")
        _check_ids(served, ids, "prompt")
    return prompts


def _check_lengths(served: Served, prompts: list[list[int]], max_tokens: int, echo: bool) -> None:
    context = served.context_len
    longest = max(len(p) for p in prompts)
    if max_tokens < 0 or (max_tokens == 0 and not echo):
        raise ApiError(400, f"max_tokens={max_tokens} must be at least 1 (0 only with echo, to score the prompt)",
                       param="max_tokens")  # fmt: skip
    if longest > context:
        raise ApiError(400, f"a prompt of {longest} tokens does not fit the context of {context} tokens; shorten it",
                       param="prompt")  # fmt: skip
    if longest + max_tokens > context:
        raise ApiError(400, f"a prompt of {longest} tokens + max_tokens={max_tokens} exceeds the context of {context} "
                            f"tokens; ask for at most {context - longest} tokens", param="max_tokens")  # fmt: skip


async def _answer(served: Served, request: Request, body: Any, mode: str, prompts: list[list[int]], max_tokens: int,
                  prompt_texts: list[str], chat: bool) -> Response:  # fmt: skip
    """Queue every (prompt, choice), then answer at once (stream) or when all have finished."""
    arrived, loop, events = time.perf_counter(), asyncio.get_running_loop(), asyncio.Queue()
    seed = body.seed if body.seed is not None else secrets.randbelow(2**31)
    stops = stop_check(served.codec, body.stop)
    score_prompt = bool(getattr(body, "echo", False) and getattr(body, "logprobs", None) is not None)
    queued, results = [], []
    for p, prompt in enumerate(prompts):
        for choice in range(body.n):
            index = p * body.n + choice
            queued.append(PoolRequest(
                prompt, mode, max_tokens, lambda e, i=index: loop.call_soon_threadsafe(events.put_nowait, (i, e)),
                temperature=body.temperature, top_p=body.top_p, seed=seed % 2**31, choice=choice,
                stop_ids=served.codec.stop_ids, stop_check=stops, score_prompt=score_prompt))  # fmt: skip
            results.append(responses.Result(prompt))
    try:
        served.pool.submit(queued)
    except TooLarge:
        raise protocol.too_large(len(prompts), body.n, served.pool) from None
    except QueueFull as err:
        raise ApiError(
            429, f"the server is busy: {err}; retry shortly", "rate_limit_error", headers={"Retry-After": "1"}
        ) from None
    except Draining:
        raise ApiError(503, "the server is shutting down; send the request to another one", "server_error",
                       headers={"Retry-After": "5"}) from None  # fmt: skip
    ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    head = {"id": ident, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": body.model}  # fmt: skip
    if body.stream:
        chunks = _stream(served, body, queued, results, events, head, prompt_texts, prompts, chat, arrived)
        return StreamingResponse(chunks, media_type="text/event-stream")
    try:
        check_at = time.perf_counter() + DISCONNECT_CHECK_S
        while not all(r.finished for r in results):
            try:
                index, event = await asyncio.wait_for(events.get(), timeout=DISCONNECT_CHECK_S)
                results[index].add(event)
            except TimeoutError:
                pass
            if time.perf_counter() >= check_at:  # on a clock, not on a quiet queue: tokens may never pause
                check_at = time.perf_counter() + DISCONNECT_CHECK_S
                if await request.is_disconnected():
                    return Response(status_code=499)
    finally:
        for q in queued:
            q.cancelled = True  # a client gone mid-request frees its slots; finished ones are unaffected
    failed = next((r.error for r in results if r.error), None)
    if failed:
        raise ApiError(500, f"this request failed: {failed}", "server_error")
    served.pool.metrics.answered(time.perf_counter() - arrived)
    n = body.n
    if chat:
        choices = [responses.chat_choice(i, r, served.codec, body) for i, r in enumerate(results)]
    else:
        choices = [responses.completion_choice(i, r, served.codec, body, prompt_texts[i // n])
                   for i, r in enumerate(results)]  # fmt: skip
    return JSONResponse({**head, "choices": choices, "usage": responses.usage(prompts, results)})


async def _stream(served: Served, body: Any, queued: list[PoolRequest], results: list[responses.Result],
                  events: asyncio.Queue, head: dict[str, Any], prompt_texts: list[str], prompts: list[list[int]],
                  chat: bool, arrived: float) -> AsyncIterator[str]:  # fmt: skip
    """Server-sent events in OpenAI's chunk format, ending with `data: [DONE]`; a client that goes
    away cancels the request (the generator is closed), which frees its slots."""
    head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
    try:
        while not all(r.finished for r in results):
            index, event = await events.get()
            result = results[index]
            result.add(event)
            if result.error:
                yield f"data: {json.dumps(ApiError(500, f'this request failed: {result.error}', 'server_error').body())}\n\n"
                continue
            choice = responses.stream_delta(index, result, served.codec, body, chat, prompt_texts[index // body.n])
            if choice is not None:
                yield f"data: {json.dumps({**head, 'choices': [choice]})}\n\n"
        if any(r.error for r in results):
            served.pool.metrics.error(500)  # counted here: the stream's status went out before it failed (200)
        else:
            served.pool.metrics.answered(time.perf_counter() - arrived)
        if body.include_usage():
            yield f"data: {json.dumps({**head, 'choices': [], 'usage': responses.usage(prompts, results)})}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        for q in queued:
            q.cancelled = True
