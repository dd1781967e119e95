"""Chat and prompt–completion records as documents to pack: token ids with the tokens trained, and where
feedback starts (docs/post-training.md).

A record is rendered (`chat.py`) into ids and a `trained` flag per token: 1 on what the model writes
(each reply and its end-of-turn), 0 on what it reads. Packed, `trained` is both the loss weight of a
token as a target and the fuse flag of it as an input: soft decoding reads a prompt plainly and fuses
from the reply's first token on, and so does training (docs/method.md §8).

Multi-turn conversations (`turns`):
- "split" (the default): reply i is trained in its own segment, the conversation up to it, in which every
  earlier turn is read plainly: what a served chat completion computes for that reply, where the client
  sends the earlier replies back as text. The context is packed once per reply.
- "joint": one segment, every reply trained and fused. Cheaper, but a later reply then reads the earlier
  replies' fused states, which serving never computes.
Over-long documents (`overlong`, longer than seq_len + 1 tokens, never split across records, which would
lose the prompt): "drop" them (the default), or "truncate" them to their first seq_len + 1 tokens (a cut
reply then teaches no end); either way they are counted in the preparation's report.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from fbt_jax.data.chat import ChatTemplate, Conversation, chat_template, show
from fbt_jax.errors import ConfigError

FORMATS = ("text", "chat", "prompt-completion")
TURNS = ("split", "joint")
OVERLONG = ("drop", "truncate")


def settings(
    format: str,
    tokenizer: Any,
    template_path: str | None = None,
    keys: tuple[str, ...] = (),
    turns: str = "split",
    overlong: str = "drop",
    flags: str = "--",
) -> dict[str, Any] | None:
    """What a preparation of chat or prompt–completion records fixes in its plan (None for text): the
    fields read, the template's text (or None: prompt and completion are then concatenated as text), the
    rules. Every choice is checked here, before any work."""
    if format not in FORMATS:
        raise ConfigError(f"{_flag(flags, 'format')}={format!r} is not one of {', '.join(FORMATS)}")
    if format == "text":
        return None
    for name, value, choices in (("turns", turns, TURNS), ("overlong", overlong, OVERLONG)):
        if value not in choices:
            raise ConfigError(f"{_flag(flags, name)}={value!r} is not one of {', '.join(choices)}")
    keys = tuple(keys) or (("messages",) if format == "chat" else ("prompt", "completion"))
    if len(keys) != (1 if format == "chat" else 2):
        wanted = "one field (messages)" if format == "chat" else "two fields (prompt,completion)"
        raise ConfigError(f"{_flag(flags, 'fields')}={','.join(keys)!r}: {format} records are read from {wanted}")
    template = chat_template(tokenizer, template_path)
    if template is not None:
        ChatTemplate(template, tokenizer)  # a template that does not compile, or a tokenizer it cannot use: now
    elif format == "chat":
        raise ConfigError(
            f"{_flag(flags, 'format')}=chat needs a chat template, and the tokenizer {getattr(tokenizer, 'name', tokenizer)!r} has none "
            f"(no chat_template.jinja, no chat_template in tokenizer_config.json); give one with {_flag(flags, 'chat_template')}=PATH"
        )
    return {"format": format, "keys": list(keys), "template": template, "turns": turns, "overlong": overlong}


def _flag(prefix: str, name: str) -> str:
    """A setting's name as the user wrote it: `--chat-template` (fbt-prepare) or `data.chat_template`."""
    return f"--{name.replace('_', '-')}" if prefix == "--" else f"{prefix}{name}"


@dataclasses.dataclass
class Counts:
    """What a preparation met, for its report."""

    conversations: int = 0
    replies: int = 0
    dropped: int = 0  # over-long documents left out (overlong=drop), or truncated ones with no trained token left
    truncated: int = 0


class ConversationEncoder:
    """Renders the records of one preparation (`settings`) into documents (2, n): ids and trained flags."""

    def __init__(self, chat: dict[str, Any], tokenizer: Any, seq_len: int):
        self.chat, self.tokenizer, self.length = chat, tokenizer, seq_len + 1
        self.template = ChatTemplate(chat["template"], tokenizer) if chat["template"] is not None else None
        self.counts = Counts()

    def render(self, where: str, values: dict[str, Any]) -> Conversation:
        """The whole record rendered: ids, trained flags, replies (what `fbt-prepare --show` prints)."""
        if self.chat["format"] == "chat":
            return self.template.conversation(values[self.chat["keys"][0]], where)
        prompt, completion = (values[key] for key in self.chat["keys"])
        for key, value in zip(self.chat["keys"], (prompt, completion)):
            if not isinstance(value, str):
                raise ConfigError(f"{where}: {key!r} is {type(value).__name__}, not a string; give its text")
        if self.template is not None:
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
            return self.template.conversation(messages, where)
        # No template: the prompt as fbt-decode reads one, then the completion's own ids and the end of document.
        encode_plain = getattr(self.tokenizer, "encode_plain", self.tokenizer.encode_prompt)
        head, reply = self.tokenizer.encode_prompt(prompt), [*encode_plain(completion), self.tokenizer.eos_id]
        trained = np.concatenate([np.zeros(len(head), np.int32), np.ones(len(reply), np.int32)])
        return Conversation(np.asarray([*head, *reply], np.int32), trained, ((len(head), len(head) + len(reply)),))

    def documents(self, where: str, values: dict[str, Any]) -> list[np.ndarray]:
        """The documents to pack for one record, each (2, n): ids and trained flags."""
        conversation = self.render(where, values)
        self.counts.conversations += 1
        self.counts.replies += len(conversation.replies)
        rows = np.stack([conversation.ids, conversation.trained])
        if self.chat["turns"] == "joint":
            pieces = [rows]
        else:  # reply i alone trained, in the conversation up to its end
            pieces = []
            for start, end in conversation.replies:
                piece = rows[:, :end].copy()
                piece[1, :start] = 0
                pieces.append(piece)
        return [doc for piece in pieces if (doc := self._fitted(piece)) is not None]

    def encode_batch(self, records: list[tuple[str, dict[str, Any]]]) -> list[np.ndarray]:
        """The documents of records (where, values), in order: what a preparation packs."""
        return [doc for where, values in records for doc in self.documents(where, values)]

    def _fitted(self, doc: np.ndarray) -> np.ndarray | None:
        if doc.shape[1] <= self.length:
            return doc
        if self.chat["overlong"] == "truncate" and doc[1, : self.length].any():
            self.counts.truncated += 1
            return doc[:, : self.length]
        self.counts.dropped += 1
        return None

    def show(self, where: str, values: dict[str, Any]) -> tuple[dict[str, list[int]], str]:
        """For `--show`: {"ids", "loss_weights"} (the weight of the loss on predicting ids[i]) and a readable view."""
        conversation = self.render(where, values)
        line = {"ids": conversation.ids.tolist(), "loss_weights": conversation.trained.tolist()}
        return line, show(self.tokenizer, conversation)
