"""Chat templates: a conversation rendered into token ids, with the tokens the model is trained to write.

A Hugging Face tokenizer directory may carry a chat template (chat_template.jinja, or tokenizer_config.json's
`chat_template`): a Jinja program that writes a conversation as text. It is rendered here as transformers
renders it (a sandboxed environment with the same settings, names and special tokens), and the text is
encoded without special tokens added (the template writes them), so training, `fbt-serve` and
transformers' `apply_chat_template(..., tokenize=True)` read the same ids.

Which tokens are trained (docs/post-training.md, "Masks"):
- A template with `{% generation %}` blocks marks what the assistant writes: a token is trained where its
  characters overlap a block, exactly transformers' `return_assistant_tokens_mask`.
- A template without them (most stock templates: Llama 3, Qwen3, Gemma 3; transformers then gives an
  all-zero mask) uses the prefix difference: reply i is what rendering the conversation up to and including
  it adds to the render up to its prompt with the generation prompt (the turn header is not trained), up to
  and including its last special token (the end-of-turn; a newline the template writes after it is not
  the model's to write). Both renders must be exact token prefixes of the whole; else one line says to
  give a template with generation blocks.
A conversation in which nothing is trained is refused, never trained on silently.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import json
import os
import re
from typing import Any

import numpy as np

from fbt_jax.errors import ConfigError

ROLES = ("system", "user", "assistant")
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
# The named special tokens transformers hands a template (its special_tokens_map), where the tokenizer sets them.
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# A special token as chat templates write one (ChatML's <|im_start|>, Llama 3's <|eot_id|>): a template writing
# one the tokenizer lacks would train and serve it as a few ordinary tokens, and no generation would stop at it.
MARKER = re.compile(r"<\|[A-Za-z0-9_.-]+\|>")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # one message's reasoning, by its three names
# While a render records its generation blocks: (the blocks written so far, the spans found). A context
# variable, so that threads rendering with one template at once (fbt-serve) each record their own.
_RECORDING: contextvars.ContextVar = contextvars.ContextVar("chat_generation_spans", default=None)
NO_TAGS_FIX = (
    "give a template whose assistant turns are {% generation %} blocks (--chat-template or data.chat_template)"
)


def tokenizer_config(tokenizer: Any) -> tuple[str | None, dict[str, Any]]:
    """(the directory a Hugging Face tokenizer was saved in, its tokenizer_config.json or {})."""
    name = getattr(tokenizer, "name", None)
    if not isinstance(name, str) or not os.path.exists(name):
        return None, {}
    directory = name if os.path.isdir(name) else os.path.dirname(name)
    config = os.path.join(directory, "tokenizer_config.json")
    if not os.path.isfile(config):
        return directory, {}
    with open(config, encoding="utf-8") as f:
        values = json.load(f)
    return directory, values if isinstance(values, dict) else {}


def chat_template(tokenizer: Any, path: str | None = None) -> str | None:
    """The template at `path` if given, else the one saved with a Hugging Face tokenizer directory
    (chat_template.jinja, or tokenizer_config.json's `chat_template`), else None: base models have none."""
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                return f.read()
        except OSError as err:
            raise ConfigError(
                f"the chat template {path!r} cannot be read ({err.strerror}); give a Jinja file"
            ) from None
    directory, config = tokenizer_config(tokenizer)
    if directory and os.path.isfile(os.path.join(directory, "chat_template.jinja")):
        with open(os.path.join(directory, "chat_template.jinja"), encoding="utf-8") as f:
            return f.read()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) else None


def _special(config: dict[str, Any], key: str) -> str | None:
    value = config.get(key)
    value = value.get("content") if isinstance(value, dict) else value
    return value if isinstance(value, str) else None


@dataclasses.dataclass(frozen=True)
class Conversation:
    """A rendered conversation: its ids, which of them the model is trained to write (1) or reads (0),
    and each reply's token range [start, end) (what a prompt ending just before `start` is answered with)."""

    ids: np.ndarray  # int32 (n,)
    trained: np.ndarray  # int32 (n,), 0 or 1
    replies: tuple[tuple[int, int], ...]


def _environment() -> Any:
    """A sandboxed Jinja environment as transformers makes one, with a `{% generation %}` block that records
    where in the output its text lands."""
    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlocks(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller: Any) -> str:
            text = caller()
            if (recording := _RECORDING.get()) is not None:  # the blocks written so far end where this one starts
                written, spans = recording
                start = sum(len(block) for block in written)
                spans.append((start, start + len(text)))
            return text

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:  # fmt: skip
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlocks, "jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: __import__("datetime").datetime.now().strftime(fmt)
    return env


def _normalized(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """As transformers hands messages to a template: keys whose value is None dropped, reasoning under each name."""
    out = []
    for message in messages:
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def check_messages(messages: Any, where: str) -> list[dict[str, Any]]:
    """The messages of one record, or one line naming the record and the fix."""
    if not isinstance(messages, list) or not messages:
        raise ConfigError(f"{where}: 'messages' is not a non-empty list; write [{{'role': ..., 'content': ...}}, ...]")
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ROLES:
            raise ConfigError(
                f"{where}: message {i} has role {role!r}; the roles are {', '.join(ROLES)}: map or drop the others"
            )
        if not isinstance(message.get("content"), str):
            raise ConfigError(f"{where}: message {i} ({role}) has no 'content' string; give its text as 'content'")
    if not any(m["role"] == "assistant" for m in messages):
        raise ConfigError(f"{where}: the conversation has no assistant message, so nothing would be trained; drop it")
    return messages


class ChatTemplate:
    """A tokenizer's chat template: rendered as transformers renders it, encoded without special tokens added."""

    def __init__(self, source: str, tokenizer: Any):
        if not hasattr(tokenizer, "encode_offsets"):
            raise ConfigError(
                f"a chat template needs a Hugging Face tokenizer, not {type(tokenizer).__name__}; "
                "set data.tokenizer to a tokenizer.json or a save_pretrained directory"
            )
        self.source, self.tokenizer = source, tokenizer
        self.env = _environment()
        self.template = self.env.from_string(source)
        self.tagged = bool(GENERATION_TAG.search(source))
        _, config = tokenizer_config(tokenizer)
        fallback = {
            "bos_token": tokenizer.token_string(tokenizer.bos_id) if tokenizer.bos_id is not None else None,
            "eos_token": tokenizer.token_string(tokenizer.eos_id),
        }
        named = {key: _special(config, key) or fallback.get(key) for key in SPECIAL_NAMES}
        self.specials = {key: value for key, value in named.items() if value is not None}
        missing = sorted({m for m in MARKER.findall(source) if len(tokenizer.encode_plain(m)) != 1})
        if missing:
            raise ConfigError(
                f"the chat template writes {', '.join(missing)}, which the tokenizer has no token for; add them "
                f"(fbt-train-tokenizer --from=TOKENIZER --add-special-tokens='{','.join(missing)}' --output=DIR), "
                "train with data.tokenizer=DIR and a model.vocab_size that holds them (init_from grows the model: "
                "docs/post-training.md)"
            )

    @functools.cached_property
    def end_of_turn_ids(self) -> tuple[int, ...]:
        """The special token that ends a reply (a generation stops there), from a probe conversation's render:
        () where the template ends replies with no special token."""
        probe = [{"role": "user", "content": "ping"}, {"role": "assistant", "content": "pong"}]
        try:
            conversation = self.conversation(probe)
        except ConfigError:
            return ()
        last = int(conversation.ids[conversation.replies[-1][1] - 1])
        return (last,) if last in self.tokenizer.special_ids else ()

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> tuple[str, list]:
        """The text of a conversation and the character spans of its `{% generation %}` blocks."""
        written, spans = [], []
        token = _RECORDING.set((written, spans))
        try:
            # As transformers calls a template: tools and documents given as None (stock templates test
            # `tools is not none`), the named special tokens, the generation prompt's flag.
            args = {**self.specials, "messages": _normalized(messages), "tools": None, "documents": None,
                    "add_generation_prompt": add_generation_prompt}  # fmt: skip
            for block in self.template.generate(**args):
                written.append(block)
            return "".join(written), spans
        finally:
            _RECORDING.reset(token)

    def encode(self, messages: list[dict[str, Any]]) -> list[int]:
        """The ids of a prompt: the conversation so far and the header of the reply to write (serving)."""
        return self.tokenizer.encode_plain(self.render(messages, add_generation_prompt=True)[0])

    def conversation(self, messages: Any, where: str = "the conversation") -> Conversation:
        """The ids of a whole conversation and the tokens trained (see the module's docstring)."""
        messages = check_messages(messages, where)
        try:
            text, spans = self.render(messages)
        except Exception as err:  # the template's own raise_exception, or any error of its code
            raise ConfigError(
                f"{where}: the chat template fails on it ({type(err).__name__}: {err}); fix the record or the template"
            ) from None
        ids, offsets = self.tokenizer.encode_offsets(text)
        if self.tagged:
            trained = _overlapping(offsets, spans)
            replies = _runs(trained)
        else:
            trained, replies = self._prefix_difference(messages, text, ids, where)
        if not trained.any():
            fix = "drop it, or " + NO_TAGS_FIX if self.tagged else "drop it"
            raise ConfigError(f"{where}: the chat template marks no token of it as the assistant's to write; {fix}")
        return Conversation(np.asarray(ids, np.int32), trained, tuple(replies))

    def _prefix_difference(self, messages: list, text: str, ids: list[int], where: str) -> tuple[np.ndarray, list]:
        trained, replies = np.zeros(len(ids), np.int32), []
        special = self.tokenizer.special_ids
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = self.render(messages[:i], add_generation_prompt=True)[0]
            upto = self.render(messages[: i + 1])[0]
            if not (text.startswith(upto) and upto.startswith(prompt)):
                raise ConfigError(
                    f"{where}: the chat template does not render the conversation up to reply {i} as a prefix of the "
                    f"whole, so the reply cannot be told apart; {NO_TAGS_FIX}"
                )
            prompt_ids, upto_ids = self.tokenizer.encode_plain(prompt), self.tokenizer.encode_plain(upto)
            start, end = len(prompt_ids), len(upto_ids)
            if prompt_ids != ids[:start] or upto_ids != ids[:end]:
                raise ConfigError(
                    f"{where}: the ids of the conversation up to reply {i} are not a prefix of the whole's "
                    f"(a token crosses the boundary); {NO_TAGS_FIX}"
                )
            last = max((j for j in range(start, end) if ids[j] in special), default=end - 1)
            trained[start : last + 1] = 1
            replies.append((start, last + 1))
        return trained, replies


def _overlapping(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    """1 on each token whose characters overlap a span (spans and tokens both in order): transformers' rule."""
    mask, span = np.zeros(len(offsets), np.int32), 0
    for i, (start, end) in enumerate(offsets):
        while span < len(spans) and start >= spans[span][1]:
            span += 1
        if span == len(spans):
            break
        if end > spans[span][0]:
            mask[i] = 1
    return mask


def _runs(trained: np.ndarray) -> list[tuple[int, int]]:
    """The [start, end) ranges of consecutive trained tokens."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], trained, [0]])))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2])]


def show(tokenizer: Any, conversation: Conversation) -> str:
    """A readable view: the text, with what is trained between ⟦ and ⟧."""
    pieces, edges = [], [0, *sorted({i for r in conversation.replies for i in r}), len(conversation.ids)]
    for a, b in zip(edges[:-1], edges[1:]):
        if b > a:
            text = getattr(tokenizer, "decode_all", tokenizer.decode)(conversation.ids[a:b])
            pieces.append(f"⟦{text}⟧" if conversation.trained[a] else text)
    return "".join(pieces)
