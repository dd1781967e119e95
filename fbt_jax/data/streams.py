"""The bytes of compressed corpus files: which format a file claims (its magic bytes), and zstd frames
decompressed as a stream that tells a cut frame from the end (`sources.py` reads documents from them)."""

from __future__ import annotations

import io
from typing import IO, Any

import zstandard

from fbt_jax.errors import ConfigError

SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet")
MAGIC = {".jsonl.gz": ("gzip", b"\x1f\x8b"), ".jsonl.zst": ("zstd", b"\x28\xb5\x2f\xfd")}
ZSTD_OUTPUT = 1 << 18  # about this many decompressed bytes per step (see `ZstdStream`)


def check_magic(raw: IO[bytes], path: str, kind: str, flag: str) -> None:
    name, magic = MAGIC[kind]
    head = raw.read(4)
    raw.seek(0)
    skippable = kind == ".jsonl.zst" and len(head) == 4 and head[0] & 0xF0 == 0x50 and head[1:] == b"\x2a\x4d\x18"
    if not head.startswith(magic) and not skippable:
        raise ConfigError(
            f"{path} is not a {name} file (it starts with {head!r}); re-download it, or rename it to match its "
            f"format ({', '.join(SUFFIXES)}), or drop it from {flag}"
        )


class ZstdStream(io.RawIOBase):
    """Decompressed zstd frames, one after another; EOFError where a frame is cut. zstandard's `stream_reader`
    (0.25) ends a cut frame silently, as if the file were shorter; a `decompressobj` tells (`eof`), but returns
    all the output of its input at once: input goes in steps sized to yield about `ZSTD_OUTPUT` bytes each."""

    def __init__(self, raw: IO[bytes]):
        self._raw, self._frame, self._step, self._input, self._output = raw, None, 256, b"", memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self._output:
            chunk = self._input or self._raw.read(self._step)
            if not chunk:
                if self._frame is not None and not self._frame.eof:
                    raise EOFError("zstd data ended before the end of its frame")
                return 0
            if self._frame is None or self._frame.eof:
                self._frame = zstandard.ZstdDecompressor().decompressobj()
            output = self._frame.decompress(chunk)
            self._input = self._frame.unused_data if self._frame.eof else b""  # the start of the next frame
            ratio = len(output) / len(chunk)  # 0 until a block is complete: then feed twice as much
            self._step = max(256, min(1 << 16, int(ZSTD_OUTPUT / ratio) if ratio else 2 * self._step))
            self._output = memoryview(output)
        size = min(len(buffer), len(self._output))
        buffer[:size], self._output = self._output[:size], self._output[size:]
        return size
