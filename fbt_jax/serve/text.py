"""Text on the server side: prompts to ids and ids to text with the run's tokenizer (as fbt-decode
reads and writes them), stop strings, the text a stream may send so far; chat templates are rendered as
training renders them (`data/chat.py`).

A run trained on a built-in task has no text: its prompts and outputs are space-separated token ids.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from fbt_jax.data.chat import ChatTemplate, chat_template
from fbt_jax.evals import generation

__all__ = ["ChatTemplate", "Codec", "chat_template", "cut_at_stop", "sendable", "stop_check"]  # templates: data/chat.py

REPLACEMENT = "\ufffd"  # what an incomplete UTF-8 sequence decodes to: held back until it completes


class Codec:
    """The run's prompt encoding and decoding (`decode_cli.codec`), and its end-of-document id."""

    def __init__(self, data: Any):
        from fbt_jax.decode_cli import codec

        self.encode, self._render = codec(data)
        self.tokenizer = None if data.source == "task" else data.tokenizer
        self.stop_ids: tuple[int, ...] = () if self.tokenizer is None else (int(self.tokenizer.eos_id),)

    def render(self, ids: Sequence[int]) -> str:
        """The text of generated ids; a stop id at the end is not text."""
        ids = list(ids)
        if ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]
        return self._render(ids)

    def token_text(self, token: int) -> str:
        return self._render([token])

    def info(self) -> dict[str, Any]:
        """vLLM's /tokenizer_info: what lm-evaluation-harness's remote tokenizer reads."""
        eos = bos = None
        tok = self.tokenizer
        if tok is not None and hasattr(tok, "token_string"):
            eos = tok.token_string(tok.eos_id)
            bos = tok.token_string(tok.bos_id) if tok.bos_id is not None else None
        return {"eos_token": eos, "bos_token": bos, "pad_token": None, "chat_template": chat_template(tok),
                "tokenizer_class": type(tok).__name__ if tok is not None else "TokenIds"}  # fmt: skip


def stop_check(codec: Codec, stops: Sequence[str]) -> Callable[[list[int]], bool] | None:
    """A check the device thread runs after each token: the text so far holds a stop string."""
    if not stops:
        return None
    # A stop string that the newest token completes ends within its last len(stop) characters, which
    # the last few tokens hold (a token is at least one character, or part of one): render only those,
    # not the whole text at every step.
    window = 4 * max(len(s) for s in stops) + 8
    return lambda ids: any(stop in codec.render(ids[-window:]) for stop in stops)


def cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """The text before the first stop string (generation's cut), and whether one was found."""
    before = generation.cut_at_stop(text, stops)
    return before, len(before) < len(text)  # stop strings are never empty


def sendable(text: str, stops: Sequence[str], finished: bool) -> str:
    """The part of a growing text that is final: not an incomplete character, and (while the text
    may still grow) nothing that could be the start of a stop string."""
    text, found = cut_at_stop(text, stops)
    if finished or found:
        return text
    text = text.rstrip(REPLACEMENT)
    hold = max((len(s) - 1 for s in stops), default=0)
    for size in range(min(hold, len(text)), 0, -1):  # the longest tail that begins a stop string
        if any(s.startswith(text[-size:]) for s in stops):
            return text[:-size]
    return text
