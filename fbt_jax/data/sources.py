"""The files of a text corpus and the documents in them, read as a stream: the "files -> documents"
stage of the data pipeline.

A corpus is named by a spec: comma-separated globs (local or gs://), or `@FILE`, a file listing one
glob per line (for corpora too long for a flag, or with commas in their paths). A file's suffix says
how to read it: `.jsonl` (optionally `.gz` / `.zst`) holds one JSON object per line, `.parquet` a
text column, read row group by row group; any other file is one plain-text document. Compressed
files are decompressed as a stream, so memory stays flat whatever the size of the corpus.

Bad input stops the run with one line naming the file and the fix, and a damaged input is never read
as a shorter corpus: a truncated .gz or .zst file is an error, not its first part. Local and remote
files differ only in how a glob is expanded (`_expand`) and a byte stream is opened (`_open`); the
decoders are the same.
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import io
import json
import os
import posixpath
import zlib
from collections.abc import Iterator
from typing import IO, Any

import zstandard

from fbt_jax.errors import ConfigError, describe
from fbt_jax.paths import is_url

SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet")
_MAGIC = {".jsonl.gz": ("gzip", b"\x1f\x8b"), ".jsonl.zst": ("zstd", b"\x28\xb5\x2f\xfd")}
_PARQUET_BATCH_ROWS = 256  # documents per parquet batch: bounds the Python objects alive at once
_ZSTD_OUTPUT = 1 << 18  # about this many decompressed bytes per step (see `_ZstdStream`)


@dataclasses.dataclass(frozen=True)
class InputFile:
    path: str  # absolute local path, or a URL (gs://bucket/...)
    size: int  # bytes


def list_inputs(spec: str, flag: str = "data.path") -> list[InputFile]:
    """The files a corpus spec names, sorted by path, de-duplicated. `spec` is one or more
    comma-separated globs (`**` recursive; a plain path is a glob matching itself), each local or
    gs://, or `@FILE`: a local or gs:// file listing one glob or path per line (blank lines and lines
    starting with # ignored; relative entries are relative to the listing file's directory).

    Every glob must match a file, and every file must be non-empty and readable. `flag` is how the user
    gave the spec (a config field or a command-line flag), named in errors."""
    spec = spec.strip()
    if spec.startswith("@"):
        entries = _listing(spec[1:].strip(), flag)
    else:
        entries = [(p.strip(), f"{flag}={p.strip()!r}") for p in spec.split(",") if p.strip()]
    if not entries:
        raise ConfigError(f"{flag} is empty; give a glob of corpus files, e.g. 'corpus/*.jsonl', or @FILE listing them")
    files = {f.path: f for pattern, label in entries for f in _expand(pattern, label)}
    for file in files.values():
        if file.size == 0:
            raise ConfigError(f"input file {file.path} is empty; delete it or drop it from {flag}")
        if not is_url(file.path) and not os.access(file.path, os.R_OK):
            raise ConfigError(f"input file {file.path} is not readable; fix its permissions or drop it from {flag}")
    return sorted(files.values(), key=lambda f: f.path)


def read_documents(file: InputFile | str, text_key: str = "text", flag: str = "data.path") -> Iterator[str]:
    """The documents of one file, as a stream: for .jsonl/.jsonl.gz/.jsonl.zst the `text_key` string
    of each line's JSON object (blank lines skipped); for .parquet the `text_key` column, batch by
    batch of each row group, never the whole table; any other file is one document (UTF-8). Empty
    documents are yielded as they are: the caller decides."""
    path = file.path if isinstance(file, InputFile) else str(file)
    kind = _kind(path)
    with _open_checked(path, flag) as raw:
        number, offset = 0, 0  # the line reached and its byte offset (in the decompressed data)
        try:
            if kind == ".parquet":
                yield from _parquet_documents(_parquet_file(raw, path, text_key, flag), path, text_key, flag)
            elif kind == ".txt":
                yield _utf8(raw.read(), path, flag, f"text file {path}", 0)
            else:
                lines = raw  # binary lines, decoded one by one: errors then name the file's byte offset
                if kind in _MAGIC:
                    _check_magic(raw, path, kind, flag)
                    gz = kind == ".jsonl.gz"
                    lines = gzip.GzipFile(fileobj=raw) if gz else io.BufferedReader(_ZstdStream(raw), 1 << 16)
                for number, line in enumerate(lines, start=1):
                    if line.strip():
                        yield _json_text(
                            _utf8(line, path, flag, f"{path}:{number}", offset), path, number, text_key, flag
                        )
                    offset += len(line)
        except EOFError:  # gzip's, and `_ZstdStream`'s, for data that stops inside a compressed stream
            raise ConfigError(
                f"{path} is truncated: its {_MAGIC[kind][0]} data ends mid-stream, after {number} line(s) (at "
                f"compressed byte {raw.tell()}); the file is cut short: re-download it or drop it from {flag}"
            ) from None
        except (zlib.error, gzip.BadGzipFile, zstandard.ZstdError) as err:
            raise ConfigError(
                f"{path} is damaged: bad {_MAGIC[kind][0]} data after {number} line(s) (near compressed byte "
                f"{raw.tell()}: {describe(err, 120)}); re-download it or drop it from {flag}"
            ) from None
        except OSError as err:
            raise _cannot_read(path, err, flag) from None


def check_input(file: InputFile | str, text_key: str = "text", flag: str = "data.path") -> None:
    """Cheap checks of one file before any work, without reading it: a .parquet file's schema has a
    string column `text_key`, and a .gz/.zst file starts with its format's magic bytes."""
    path = file.path if isinstance(file, InputFile) else str(file)
    kind = _kind(path)
    if kind in _MAGIC or kind == ".parquet":
        with _open_checked(path, flag) as raw:
            try:
                _parquet_file(raw, path, text_key, flag) if kind == ".parquet" else _check_magic(raw, path, kind, flag)
            except OSError as err:
                raise _cannot_read(path, err, flag) from None


# --- where bytes come from: the only code that tells local files from remote ones ---------------------------


def _filesystem(url: str) -> Any:
    import fsspec

    return fsspec.filesystem(url.split("://", 1)[0])


def _open(path: str) -> IO[bytes]:
    if not is_url(path):
        return open(path, "rb")
    if path.startswith("gs://"):  # through etils.epath (gcsfs underneath), as the rest of the framework
        from etils import epath

        return epath.Path(path).open("rb")
    return _filesystem(path).open(path, "rb")  # any other fsspec file system (memory:// in the tests)


def _expand(pattern: str, label: str) -> list[InputFile]:
    """The files one glob matches; `label` names the glob in errors."""
    hint = "check the path, or give a glob of corpus files, e.g. 'corpus/*.jsonl' or 'corpus/**/*.parquet'"
    if is_url(pattern):
        return _expand_remote(_filesystem(pattern), pattern, label, hint)
    pattern = os.path.abspath(os.path.expanduser(pattern))
    if os.path.isfile(pattern):  # a plain path matches itself, even with [ ] or * in its name
        return [InputFile(pattern, os.path.getsize(pattern))]
    files = [InputFile(p, os.path.getsize(p)) for p in glob.glob(pattern, recursive=True) if os.path.isfile(p)]
    if not files:
        # glob skips a directory it cannot list without a word: say so, not "matches no file"
        blocked = _unreadable_dir(pattern)
        if blocked:
            raise ConfigError(
                f"{label}: the directory {blocked} cannot be read by this user, so its files cannot be listed; "
                f"fix its permissions (e.g. chmod u+rx {blocked})"
            )
        raise ConfigError(f"{label} matches no file; {hint}")
    return files


def _expand_remote(fs: Any, pattern: str, label: str, hint: str) -> list[InputFile]:
    """The files a glob matches on an fsspec file system (gcsfs for gs://), with their sizes."""
    try:
        found = fs.glob(pattern, detail=True)
        if not found and fs.isfile(pattern):  # a plain path matches itself, even with [ ] in its name
            found = {fs.info(pattern)["name"]: fs.info(pattern)}
    except FileNotFoundError:  # some stores say so for a bucket or prefix that does not exist
        found = {}
    except Exception as err:  # the storage clients raise many types (auth, network); one line for all
        raise ConfigError(f"{label} cannot be listed ({describe(err)}); check the URL and your credentials") from None
    files = [
        InputFile(fs.unstrip_protocol(path), int(info["size"]))
        for path, info in found.items()
        if info.get("type") == "file" and not path.endswith("/")  # not a bucket's "directory" placeholder
    ]
    if not files:
        raise ConfigError(f"{label} matches no file; {hint}")
    return files


def _unreadable_dir(pattern: str) -> str | None:
    """The directory on the way to a glob's matches that this user cannot list or enter, if any."""
    parts = pattern.split(os.sep)
    magic = next((i for i, part in enumerate(parts) if glob.has_magic(part)), None)
    listed = os.sep.join(parts[: len(parts) - 1 if magic is None else magic]) or os.sep
    chain = [listed]
    while os.path.dirname(chain[-1]) != chain[-1]:
        chain.append(os.path.dirname(chain[-1]))
    for directory in reversed(chain):
        if not os.path.isdir(directory):
            return None  # the path does not exist: "matches no file" is the right message
        if not os.access(directory, os.X_OK | (os.R_OK if directory == listed and magic is not None else 0)):
            return directory
    if magic is not None and magic < len(parts) - 1:  # wildcards in directories: glob lists those below too
        for root, dirs, _ in os.walk(listed):
            for name in dirs:
                if not os.access(os.path.join(root, name), os.R_OK | os.X_OK):
                    return os.path.join(root, name)
    return None


def _listing(location: str, flag: str) -> list[tuple[str, str]]:
    """The (glob, label for errors) entries of an @FILE listing."""
    if not is_url(location):
        location = os.path.abspath(os.path.expanduser(location))
    label = f"{flag}='@{location}'"
    try:
        with _open(location) as f:
            text = f.read().decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{label}: the listing file does not exist; give a file listing one glob per line") from None
    except Exception as err:  # OSError, UnicodeDecodeError, a storage client's own types
        raise ConfigError(f"{label}: the listing file cannot be read ({describe(err)}); fix or replace it") from None
    base = posixpath.dirname(location) if is_url(location) else os.path.dirname(location)
    entries = []
    for number, line in enumerate(text.splitlines(), start=1):
        entry = line.strip()
        if entry and not entry.startswith("#"):
            absolute = is_url(entry) or os.path.isabs(os.path.expanduser(entry))
            pattern = entry if absolute else (posixpath if is_url(base) else os.path).join(base, entry)
            entries.append((pattern, f"{label} line {number} ({entry!r})"))
    if not entries:
        raise ConfigError(f"{label}: the listing file lists no file; write one glob or path per line (# for comments)")
    return entries


# --- decoders: from a binary stream to documents -------------------------------------------------------------


def _kind(path: str) -> str:
    name = path.lower()
    return next((suffix for suffix in SUFFIXES if name.endswith(suffix)), ".txt")


def _open_checked(path: str, flag: str) -> IO[bytes]:
    try:
        return _open(path)
    except OSError as err:
        raise _cannot_read(path, err, flag) from None


def _cannot_read(path: str, err: OSError, flag: str) -> ConfigError:
    return ConfigError(f"input file {path} cannot be read ({describe(err)}); fix it or drop it from {flag}")


def _utf8(data: bytes, path: str, flag: str, where: str, offset: int) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        compressed = path.endswith((".gz", ".zst")) and " (a compressed file must be .jsonl.gz or .jsonl.zst)"
        raise ConfigError(
            f"{where} is not UTF-8 text ({err.reason} at byte {offset + err.start}){compressed or ''}; "
            f"convert it to UTF-8 or drop it from {flag}"
        ) from None


def _json_text(line: str, path: str, number: int, text_key: str, flag: str) -> str:
    try:
        text = json.loads(line)[text_key]
    except (json.JSONDecodeError, KeyError, TypeError, IndexError):
        text = None
    if not isinstance(text, str):
        raise ConfigError(
            f"{path}:{number} is not a JSON object with a {text_key!r} string; write one "
            f"{json.dumps({text_key: '...'})} object per line, or drop the file from {flag}"
        )
    return text


def _check_magic(raw: IO[bytes], path: str, kind: str, flag: str) -> None:
    name, magic = _MAGIC[kind]
    head = raw.read(4)
    raw.seek(0)
    skippable = kind == ".jsonl.zst" and len(head) == 4 and head[0] & 0xF0 == 0x50 and head[1:] == b"\x2a\x4d\x18"
    if not head.startswith(magic) and not skippable:
        raise ConfigError(
            f"{path} is not a {name} file (it starts with {head!r}); re-download it, or rename it to match its "
            f"format ({', '.join(SUFFIXES)}), or drop it from {flag}"
        )


class _ZstdStream(io.RawIOBase):
    """The decompressed bytes of a zstd stream of one or more frames, an error where they are cut.

    zstandard's `stream_reader` (0.25) ends a truncated frame silently, as if the file were shorter,
    so frames are decompressed with `decompressobj`, whose `eof` tells a complete frame from a cut one.
    It returns all the output of what it is fed: input goes in small steps, sized from the ratio seen
    so far, so that one step yields about `_ZSTD_OUTPUT` bytes and memory stays flat."""

    def __init__(self, raw: IO[bytes]):
        self._raw, self._frame, self._step = raw, None, 256  # grows once the ratio is known
        self._input, self._output = b"", memoryview(b"")

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
            self._step = max(256, min(1 << 16, int(_ZSTD_OUTPUT / ratio) if ratio else 2 * self._step))
            self._output = memoryview(output)
        size = min(len(buffer), len(self._output))
        buffer[:size], self._output = self._output[:size], self._output[size:]
        return size


def _parquet_file(raw: IO[bytes], path: str, text_key: str, flag: str) -> Any:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(raw)  # reads the footer only
    except (pa.ArrowException, OSError) as err:
        raise ConfigError(
            f"{path} is not a Parquet file, or is damaged ({describe(err, 120)}); re-download it or drop it from {flag}"
        ) from None
    schema = parquet.schema_arrow
    if text_key not in schema.names:
        raise ConfigError(
            f"{path} has no column {text_key!r}; its columns are {schema.names}: name the text column "
            f"(data.text_key) or drop the file from {flag}"
        )
    kind = schema.field(text_key).type
    value = kind.value_type if pa.types.is_dictionary(kind) else kind
    if not (pa.types.is_string(value) or pa.types.is_large_string(value) or pa.types.is_string_view(value)):
        raise ConfigError(
            f"{path}: the column {text_key!r} holds {kind}, not strings; name a text column (data.text_key) "
            f"or drop the file from {flag}"
        )
    return parquet


def _parquet_documents(parquet: Any, path: str, text_key: str, flag: str) -> Iterator[str]:
    import pyarrow as pa

    row = 0
    try:
        for batch in parquet.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=[text_key]):
            for text in batch.column(0).to_pylist():
                if text is None:
                    raise ConfigError(
                        f"{path} row {row} (from 0): the {text_key!r} column is null; drop or fill the null rows, "
                        f"or drop the file from {flag}"
                    )
                yield text
                row += 1
    except (pa.ArrowException, OSError) as err:
        raise ConfigError(
            f"{path} is damaged: it cannot be read past row {row} ({describe(err, 120)}); re-download it or drop it "
            f"from {flag}"
        ) from None
