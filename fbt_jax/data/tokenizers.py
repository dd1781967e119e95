"""Tokenizers: byte-level (the default, needs no files), a SentencePiece `.model`, or a Hugging Face tokenizer
(a `tokenizer.json`, or a directory written by transformers' `save_pretrained`).

Every tokenizer ends each document with exactly one end-of-document id, so a model trained on packed text learns
where documents end, and starts it with a beginning-of-document id where the tokenizer itself adds one.
They share one interface: `name` (what the user gave), `identity` (a fingerprint of what decides the ids: file
contents and special-token settings, never the path, so data encoded on one machine is recognised on another),
`vocab_size` (every id it can emit), `eos_id`, `bos_id` (the id `encode` puts first, or None), `encode`,
`encode_batch` (the same ids through the library's own parallel encoder), `encode_prompt` and `decode`.
They pickle as their path and are reloaded in the receiving process, which checks the identity.

tiktoken BPE files are not supported: the split regex that decides their tokens is in code, not in the file.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import numpy as np

from fbt_jax.errors import ConfigError

# End-of-document tokens, most specific first: a bare tokenizer.json does not say which of its special tokens
# ends a document (Llama 3 has both <|end_of_text|> and <|eot_id|>; Qwen both <|endoftext|> and <|im_end|>).
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "<|im_end|>", "<|eot_id|>", "[SEP]")
_PROBE = "Hello world"  # encoded with and without the post-processor, to see what it adds around a text
_sp_threads = -1  # SentencePiece batch-encoding threads; -1: one per core


def limit_encoder_threads(n: int) -> None:
    """Let `encode_batch` use at most `n` threads in this process (worker processes call it so that together
    they do not oversubscribe the cores). Call it before the first encode: the `tokenizers` library sizes its
    thread pool from RAYON_NUM_THREADS once, when the pool starts, so a later call limits only SentencePiece.
    (A process forked after its parent used that pool encodes on one thread, the library's guard against deadlock.)"""
    global _sp_threads
    if n < 1:
        raise ConfigError(f"encoder threads must be at least 1, not {n}; give a positive count")
    os.environ["RAYON_NUM_THREADS"] = str(n)
    _sp_threads = n


def _digest(*parts: bytes) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for part in parts:
        digest.update(part)
    return digest.hexdigest()


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())[:240] or type(err).__name__


class ByteTokenizer:
    """UTF-8 bytes 0–255, plus end-of-document 256; no beginning-of-document id."""

    name = identity = "byte"
    vocab_size = 257
    eos_id = 256
    bos_id = None

    def encode(self, text: str) -> np.ndarray:
        return np.append(np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32), self.eos_id)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        data = [text.encode("utf-8") for text in texts]
        ends = np.cumsum([len(d) for d in data], dtype=np.int64)
        ids = np.insert(np.frombuffer(b"".join(data), np.uint8).astype(np.int32), ends, self.eos_id)
        return np.split(ids, ends + np.arange(1, len(data) + 1))[:-1]  # the last piece is the empty rest

    def encode_prompt(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Any) -> str:
        return bytes(int(i) for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class _Reloaded:
    """Pickles as the arguments it was built from: unpickling rebuilds it from the files, and refuses if they
    changed since, as the two processes would then encode differently."""

    _args: tuple
    name: str
    identity: str

    def __getstate__(self) -> dict[str, Any]:
        return {"args": self._args, "identity": self.identity}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(*state["args"])
        if self.identity != state["identity"]:
            raise ConfigError(
                f"tokenizer {self.name!r} changed on disk since it was loaded; restart so every process reads the same files"
            )


class SentencePieceTokenizer(_Reloaded):
    """A SentencePiece model; its own eos id ends documents (one past its pieces if it has none). No bos, as
    fbt-jax has always encoded SentencePiece data."""

    bos_id = None

    def __init__(self, path: str, name: str | None = None):
        import sentencepiece

        self._args = (os.path.abspath(path), name)  # absolute: a worker may run in another directory
        self.name = name or os.path.abspath(path)
        with open(path, "rb") as f:
            data = f.read()  # read once: the model loaded and the identity are of the same bytes
        self._sp = sentencepiece.SentencePieceProcessor(model_proto=data)
        self.identity = "sentencepiece:" + _digest(data)
        self._pieces = self._sp.get_piece_size()
        self.eos_id = self._sp.eos_id() if self._sp.eos_id() >= 0 else self._pieces
        self.vocab_size = max(self._pieces, self.eos_id + 1)

    def encode(self, text: str) -> np.ndarray:
        return np.array([*self._sp.encode(text), self.eos_id], np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        encoded = self._sp.encode(list(texts), num_threads=_sp_threads)
        return [np.array([*ids, self.eos_id], np.int32) for ids in encoded]

    def encode_prompt(self, text: str) -> list[int]:
        return list(self._sp.encode(text))

    def decode(self, ids: Any) -> str:
        return self._sp.decode([int(i) for i in ids if 0 <= i < self._pieces and i != self.eos_id])


def _special_settings(directory: str, flag: str) -> dict[str, Any]:
    """The settings of a save_pretrained directory that change encoding: tokenizer_config.json's, falling back
    to special_tokens_map.json's. A token is a string or a dict with "content" (both forms are written)."""
    settings: dict[str, Any] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the later file wins
        file = os.path.join(directory, name)
        if not os.path.isfile(file):
            continue
        try:
            with open(file, encoding="utf-8") as f:
                values = json.load(f)
        except (OSError, ValueError) as err:
            raise ConfigError(f"{flag}: {file!r} is not readable JSON ({_one_line(err)}); fix or remove it") from None
        if not isinstance(values, dict):
            raise ConfigError(f"{flag}: {file!r} is not a JSON object; fix or remove it")
        for key in ("bos_token", "eos_token", "add_bos_token", "add_eos_token"):
            value = values.get(key)
            value = value.get("content") if isinstance(value, dict) else value
            if value is not None:
                settings[key] = value
    return settings


class HuggingFaceTokenizer(_Reloaded):
    """A Hugging Face tokenizer: a tokenizer.json file, or a save_pretrained directory holding one.

    Ids are the library's own `encode(text)` (its post-processor's special tokens included, e.g. Llama 3's
    <|begin_of_text|>), then eos unless the post-processor already ended with it. A directory's
    tokenizer_config.json names eos/bos, and its add_bos_token adds or removes the bos as transformers does
    (Llama's fast tokenizers add bos by that setting, not by their tokenizer.json).
    """

    def __init__(self, path: str, flag: str = "data.tokenizer"):
        import tokenizers

        self.name = os.path.abspath(path)
        self._args = (self.name, flag)  # absolute: a worker may run in another directory
        directory = os.path.isdir(path)
        file = os.path.join(path, "tokenizer.json") if directory else path
        try:
            with open(file, "rb") as f:
                raw = f.read()  # read once: the tokenizer loaded and the identity are of the same bytes
            self._tok = tokenizers.Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as err:  # the library raises a bare Exception for JSON it cannot read or rejects
            raise ConfigError(
                f"{flag}: {file!r} is not a valid tokenizer.json ({_one_line(err)}); "
                "give a tokenizer.json saved by tokenizers or transformers"
            ) from None
        # Truncation or padding saved with the tokenizer would cut or pad every document.
        self._tok.no_truncation()
        self._tok.no_padding()
        # What the post-processor puts around a text: encoded with it = head + encoded without it + tail.
        plain, full = self._tok.encode(_PROBE, add_special_tokens=False).ids, self._tok.encode(_PROBE).ids
        start = next((i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain), 0)
        head, tail = full[:start], full[start + len(plain) :]
        settings = _special_settings(path, flag) if directory else {}
        special = {t.content: i for i, t in sorted(self._tok.get_added_tokens_decoder().items()) if t.special}
        self.special_ids = frozenset(special.values())  # what ends a reply in a chat template's render
        # Without a config naming it, eos is the special token the post-processor ends texts with, else a known name.
        ends = [token for token, i in special.items() if tail[-1:] == [i]]
        eos_token = settings.get("eos_token") or next((n for n in [*ends, *EOS_NAMES] if n in special), None)
        if eos_token is None:
            raise ConfigError(
                f"{flag}={path!r} names no end-of-document token (no special token of {file!r} is one of "
                f"{' '.join(EOS_NAMES)}); give a save_pretrained directory whose tokenizer_config.json names eos_token"
            )
        self.eos_id = self._token_id(eos_token, "eos_token", flag)
        self._prepend: list[int] = []  # ids put before the library's, and how many of its first ids are dropped
        self._drop = 0
        if isinstance(settings.get("bos_token"), str) and isinstance(settings.get("add_bos_token"), bool):
            bos = self._token_id(settings["bos_token"], "bos_token", flag)
            if settings["add_bos_token"] and head[:1] != [bos]:
                self._prepend = [bos]
            elif not settings["add_bos_token"] and head[:1] == [bos]:
                self._drop = 1
        head = self._prepend + head[self._drop :]
        self.bos_id: int | None = head[0] if head else None
        self._append = [] if tail[-1:] == [self.eos_id] else [self.eos_id]
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(self._tok.get_vocab_size(with_added_tokens=True), max(vocab.values(), default=-1) + 1)
        # The settings hashed are their effect on the ids, so equal encodings get equal identities.
        effect = json.dumps({"eos": self.eos_id, "prepend": self._prepend, "drop": self._drop, "append": self._append})
        self.identity = "hf:" + _digest(raw, b"\0", effect.encode())

    def _token_id(self, token: str, key: str, flag: str) -> int:
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise ConfigError(
                f"{flag}={self.name!r} names {key} {token!r}, which is not in its vocabulary; "
                f"name a token of its tokenizer.json as {key} in tokenizer_config.json"
            )
        return token_id

    def _ids(self, ids: list[int]) -> np.ndarray:
        return np.array([*self._prepend, *ids[self._drop :], *self._append], np.int32)

    def encode(self, text: str) -> np.ndarray:
        return self._ids(self._tok.encode(text).ids)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        # encode_batch_fast (tokenizers >= 0.20) skips computing character offsets, which are not needed here.
        batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        return [self._ids(encoding.ids) for encoding in batch(list(texts))]

    def encode_prompt(self, text: str) -> list[int]:
        return self.encode(text)[:-1].tolist()  # the last id is always the end-of-document

    def encode_plain(self, text: str) -> list[int]:
        """The text's ids with no special token added (a chat template writes its own)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """`encode_plain`'s ids and each one's character span in `text` (what a chat mask is made from)."""
        encoding = self._tok.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    def decode_all(self, ids: Any) -> str:
        """The text of ids, special tokens written out (what a chat template wrote)."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_string(self, token_id: int) -> str:
        return self._tok.id_to_token(token_id)

    def decode(self, ids: Any) -> str:
        skip = {self.eos_id, self.bos_id}
        return self._tok.decode([int(i) for i in ids if 0 <= i < self.vocab_size and int(i) not in skip])


Tokenizer = ByteTokenizer | SentencePieceTokenizer | HuggingFaceTokenizer


def _sentencepiece(path: str, flag: str, name: str | None = None) -> SentencePieceTokenizer:
    try:
        return SentencePieceTokenizer(path, name)
    except ImportError:
        raise ConfigError(
            f"{flag} names a SentencePiece model but sentencepiece is not installed; pip install sentencepiece"
        ) from None
    except (OSError, RuntimeError) as err:
        raise ConfigError(
            f"{flag}={path!r} is not a readable SentencePiece model ({_one_line(err)}); "
            "give 'byte' or the path of a .model file"
        ) from None


def _hugging_face(path: str, flag: str) -> HuggingFaceTokenizer:
    try:
        return HuggingFaceTokenizer(path, flag)
    except ImportError:
        raise ConfigError(
            f"{flag} names a Hugging Face tokenizer but the tokenizers library is not installed; pip install tokenizers"
        ) from None


def _looks_like_json(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(256).lstrip()[:1] == b"{"
    except OSError:
        return False  # left to the SentencePiece loader, which names the reason


_LOADED: dict[tuple, Tokenizer] = {}


def load_tokenizer(spec: str, flag: str = "data.tokenizer") -> Tokenizer:
    """`"byte"`, a SentencePiece `.model` file, a Hugging Face `tokenizer.json`, or a directory saved by
    transformers' `save_pretrained` (its tokenizer.json, else its SentencePiece tokenizer.model); `flag` names the
    setting in errors. Loaded once per process (again where its files changed)."""
    key = (
        spec,
        *(_stamp(p) for p in (spec, os.path.join(spec, "tokenizer.json"), os.path.join(spec, "tokenizer.model"))),
    )
    if key not in _LOADED:
        _LOADED[key] = _load(spec, flag)
    return _LOADED[key]


def _stamp(path: str) -> tuple[int, int] | None:
    try:
        status = os.stat(path)
    except OSError:
        return None
    return status.st_mtime_ns, status.st_size


def _load(spec: str, flag: str) -> Tokenizer:
    if spec == "byte":
        return ByteTokenizer()
    if spec.endswith(".tiktoken"):
        raise ConfigError(
            f"{flag}={spec!r} is a tiktoken BPE file, which is not supported (its split regex is not in the file); "
            "convert it to a tokenizer.json first (e.g. with transformers) and give that"
        )
    if os.path.isdir(spec):
        if os.path.isfile(os.path.join(spec, "tokenizer.json")):
            return _hugging_face(spec, flag)
        if os.path.isfile(os.path.join(spec, "tokenizer.model")):  # older Llama / Mistral: SentencePiece only
            return _sentencepiece(os.path.join(spec, "tokenizer.model"), flag, name=os.path.abspath(spec))
        raise ConfigError(
            f"{flag}={spec!r} is a directory without tokenizer.json or tokenizer.model; "
            "give a directory saved by save_pretrained, a tokenizer.json or a .model file"
        )
    if not os.path.isfile(spec):
        raise ConfigError(
            f"{flag}={spec!r} is neither 'byte' nor an existing tokenizer (a SentencePiece .model, a tokenizer.json "
            "or a save_pretrained directory); give 'byte' or the path of one"
        )
    if spec.endswith(".json") or (not spec.endswith(".model") and _looks_like_json(spec)):
        return _hugging_face(spec, flag)
    return _sentencepiece(spec, flag)
