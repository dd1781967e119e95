"""Tokenizers: byte-level (default, needs no files) or a SentencePiece model given by path.

Every tokenizer appends an end-of-document id to each document, so a model trained on packed text
learns where documents end; `vocab_size` counts every id the tokenizer can emit.
"""

from __future__ import annotations

import os

import numpy as np

from fbt_jax.errors import ConfigError


class ByteTokenizer:
    """UTF-8 bytes 0–255, plus end-of-document 256."""

    name = "byte"
    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> np.ndarray:
        return np.append(np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32), self.eos_id)

    def decode(self, ids: np.ndarray) -> str:
        return bytes(int(i) for i in ids if i < 256).decode("utf-8", errors="replace")


class SentencePieceTokenizer:
    def __init__(self, path: str):
        import sentencepiece

        self.name = os.path.abspath(path)
        self._sp = sentencepiece.SentencePieceProcessor(model_file=path)
        self.eos_id = self._sp.eos_id() if self._sp.eos_id() >= 0 else self._sp.get_piece_size()
        self.vocab_size = max(self._sp.get_piece_size(), self.eos_id + 1)

    def encode(self, text: str) -> np.ndarray:
        return np.array([*self._sp.encode(text), self.eos_id], np.int32)

    def decode(self, ids: np.ndarray) -> str:
        return self._sp.decode([int(i) for i in ids if i != self.eos_id])


def load_tokenizer(spec: str, flag: str = "data.tokenizer") -> ByteTokenizer | SentencePieceTokenizer:
    """`"byte"`, or the path of a SentencePiece `.model` file; `flag` names the setting in errors."""
    if spec == "byte":
        return ByteTokenizer()
    if not os.path.isfile(spec):
        raise ConfigError(
            f"{flag}={spec!r} is neither 'byte' nor an existing SentencePiece model file; give 'byte' or the path of a .model file"
        )
    try:
        return SentencePieceTokenizer(spec)
    except ImportError:
        raise ConfigError(
            f"{flag} names a SentencePiece model but sentencepiece is not installed; pip install sentencepiece"
        ) from None
    except (OSError, RuntimeError) as err:
        raise ConfigError(
            f"{flag}={spec!r} is not a readable SentencePiece model ({' '.join(str(err).split())}); "
            "give 'byte' or the path of a .model file"
        ) from None
