"""One choice's answer in OpenAI's shapes: what the device thread sent for it (`Result`), turned into a
completion choice, a chat choice, or the chunks of a stream."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from fbt_jax.serve.pool import Event, Scores
from fbt_jax.serve.text import Codec, cut_at_stop, sendable


@dataclasses.dataclass
class Result:
    """A choice's events gathered: prompt scores (echo), generated tokens and their scores, the end."""

    prompt: list[int]
    prompt_scores: Scores | None = None
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top: list[tuple[np.ndarray, np.ndarray]] = dataclasses.field(default_factory=list)
    reason: str | None = None
    error: str | None = None
    sent_text: int = 0  # a stream: characters of the generated text sent so far
    sent_tokens: int = 0  # a stream: tokens whose log-probabilities were sent
    # A stream: its first chunk went out (the echoed prompt, a chat's role). Not inferred from the two
    # counts above: an echo's first chunk (the prompt's scores) can leave both at 0.
    sent_head: bool = False
    sent_offset: int = 0  # a stream: text_offset of the next log-probability sent (continues the last chunk's)

    def add(self, event: Event) -> None:
        if event.kind == "prompt":
            self.prompt_scores = event.scores
        elif event.kind == "token":
            self.tokens.append(event.token)
            self.logprobs.append(float(event.scores.logprobs[0]))
            self.top.append((event.scores.top_ids[0], event.scores.top_logprobs[0]))
        elif event.kind == "done":
            self.reason = event.reason
        else:
            self.error = event.reason

    @property
    def finished(self) -> bool:
        return self.reason is not None or self.error is not None

    def text(self, codec: Codec, stops: list[str]) -> tuple[str, str | None]:
        """The generated text (cut before a stop string) and the finish reason."""
        text, found = cut_at_stop(codec.render(self.tokens), stops)
        return text, ("stop" if found else self.reason)


def _top(codec: Codec, ids: np.ndarray, logprobs: np.ndarray, k: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for i, lp in zip(ids[:k], logprobs[:k]):
        out.setdefault(codec.token_text(int(i)), float(lp))  # tokens with one text: the likelier one
    return out


def completion_logprobs(
    codec: Codec, result: Result, k: int, echo: bool, tokens_from: int = 0, offset: int = 0
) -> dict[str, Any]:
    """OpenAI's completion logprobs: each token's text, log-probability, top-k alternatives and
    offset in the choice's text. With echo the prompt's tokens come first (the first one has none).
    A stream's chunk starts at generated token `tokens_from`, whose offset is `offset`."""
    tokens, token_logprobs, top, offsets = [], [], [], []

    def add(token: int, logprob: float | None, alternatives: dict[str, float] | None) -> None:
        nonlocal offset
        text = codec.token_text(token)
        tokens.append(text), token_logprobs.append(logprob), top.append(alternatives), offsets.append(offset)
        offset += len(text)

    if echo and result.prompt_scores is not None:
        s = result.prompt_scores
        for t, token in enumerate(result.prompt):
            if t == 0:
                add(token, None, None)
            else:
                add(token, float(s.logprobs[t]), _top(codec, s.top_ids[t], s.top_logprobs[t], k))
    for t in range(tokens_from, len(result.tokens)):
        add(result.tokens[t], result.logprobs[t], _top(codec, *result.top[t], k))
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def offset_after(logprobs: dict[str, Any], offset: int) -> int:
    """The text_offset that follows a chunk's log-probabilities (`offset` if it has none)."""
    if not logprobs["tokens"]:
        return offset
    return logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])


def completion_choice(index: int, result: Result, codec: Codec, body: Any, prompt_text: str) -> dict[str, Any]:
    text, reason = result.text(codec, body.stop)
    logprobs = None
    if body.logprobs is not None:
        logprobs = completion_logprobs(codec, result, body.logprobs, body.echo)
    return {"index": index, "text": (prompt_text if body.echo else "") + text, "logprobs": logprobs,
            "finish_reason": reason}  # fmt: skip


def chat_logprobs(codec: Codec, result: Result, k: int, tokens_from: int = 0) -> dict[str, Any]:
    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = codec.token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = []
    for t in range(tokens_from, len(result.tokens)):
        ids, lps = result.top[t]
        content.append({**entry(result.tokens[t], result.logprobs[t]),
                        "top_logprobs": [entry(int(i), float(lp)) for i, lp in zip(ids[:k], lps[:k])]})  # fmt: skip
    return {"content": content}


def chat_choice(index: int, result: Result, codec: Codec, body: Any) -> dict[str, Any]:
    text, reason = result.text(codec, body.stop)
    logprobs = chat_logprobs(codec, result, body.top_logprobs or 0) if body.logprobs else None
    return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
            "finish_reason": reason}  # fmt: skip


def stream_delta(index: int, result: Result, codec: Codec, body: Any, chat: bool, prompt_text: str) -> dict | None:
    """The next chunk's choice for a stream: the text that became final since the last chunk (with
    its tokens' log-probabilities), and the finish reason once the choice ended; None if nothing new."""
    full = codec.render(result.tokens)
    text, found = cut_at_stop(full, body.stop)
    done = result.finished or found
    final = sendable(full, body.stop, done)
    new_text = final[result.sent_text :]
    first = not result.sent_head
    reason = ("stop" if found else result.reason) if result.finished else None
    if not new_text and reason is None and not (first and body_echo(body) and not chat):
        return None
    since, result.sent_text, result.sent_tokens = result.sent_tokens, len(final), len(result.tokens)
    result.sent_head = True
    if chat:
        delta = {"content": new_text} if not first else {"role": "assistant", "content": new_text}
        logprobs = chat_logprobs(codec, result, body.top_logprobs or 0, since) if body.logprobs else None
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
    echo = first and body.echo
    logprobs = None
    if body.logprobs is not None:
        logprobs = completion_logprobs(codec, result, body.logprobs, echo, since, result.sent_offset)
        result.sent_offset = offset_after(logprobs, result.sent_offset)
    return {"index": index, "text": (prompt_text if echo else "") + new_text, "logprobs": logprobs,
            "finish_reason": reason}  # fmt: skip


def body_echo(body: Any) -> bool:
    return bool(getattr(body, "echo", False))


def usage(prompts: list[list[int]], results: list[Result]) -> dict[str, int]:
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(len(r.tokens) for r in results)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}  # fmt: skip
