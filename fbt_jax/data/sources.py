"""The "files -> documents" stage of the data pipeline: the files a corpus spec names (globs, or an
@FILE listing them, for corpora too long for a flag or with commas in their paths) and the documents
in each, read as a stream so that memory stays flat whatever the size of the corpus.

Bad input is one line naming the file and the fix, found before any work where that is cheap
(`check_input`); damaged input is never read as a shorter corpus (a truncated .gz/.zst is an error).
Local and remote (gs://) files differ only in how globs expand (`_expand`) and bytes open (`_open`).
"""

from __future__ import annotations

import codecs
import collections
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

import fsspec
import zstandard

from fbt_jax.data.streams import MAGIC, SUFFIXES, ZstdStream, check_magic
from fbt_jax.errors import ConfigError, describe
from fbt_jax.paths import is_url

_PARQUET_BATCH_ROWS = 256  # documents per parquet batch: bounds the Python objects alive at once
_NO_MATCH = "matches no file; check the path, or give a glob of corpus files, e.g. 'corpus/**/*.jsonl.zst'"


@dataclasses.dataclass(frozen=True)
class InputFile:
    path: str  # absolute local path, or a URL (gs://bucket/...)
    size: int  # bytes


def list_inputs(spec: str, flag: str = "data.path") -> list[InputFile]:
    """The files a corpus spec names, sorted by path, de-duplicated. `spec` is one or more
    comma-separated globs (`**` recursive; a plain path is a glob matching itself), each local or
    gs://, or `@FILE`: a local or gs:// file listing one glob or path per line (blank lines and lines
    starting with # ignored; relative entries are relative to the listing file's directory). Every glob
    must match a file, every file be non-empty and readable; `flag` names the spec's origin in errors."""
    spec = spec.strip()
    globs = [p.strip() for p in spec.split(",") if p.strip()]
    entries = _listing(spec[1:].strip(), flag) if spec.startswith("@") else [(p, f"{flag}={p!r}") for p in globs]
    if not entries:
        raise ConfigError(f"{flag} is empty; give a glob of corpus files, e.g. 'corpus/*.jsonl', or @FILE listing them")
    files = {f.path: f for pattern, label in entries for f in _expand(pattern, label)}
    for file in files.values():
        if file.size == 0:
            raise ConfigError(f"input file {file.path} is empty; delete it or drop it from {flag}")
        if not is_url(file.path) and not os.access(file.path, os.R_OK):
            raise ConfigError(f"input file {file.path} is not readable; fix its permissions or drop it from {flag}")
    return sorted(files.values(), key=lambda f: f.path)


def read_documents(
    file: InputFile | str, text_key: str | tuple[str, ...] = "text", flag: str = "data.path"
) -> Iterator:
    """The documents of one file, as a stream: for .jsonl/.jsonl.gz/.jsonl.zst the `text_key` string
    of each line's JSON object (blank lines skipped); for .parquet the `text_key` column, batch by
    batch of each row group, never the whole table; any other file is one document (UTF-8). Empty
    documents are yielded as they are: the caller decides.

    With several keys (chat records: `messages`; or a prompt and a completion), each document is
    (where, {key: value}): the record's location ("path:line", "path row r") for the errors its
    values may still earn, and its values, of any JSON type; a record lacking a key is an error here."""
    path = file.path if isinstance(file, InputFile) else str(file)
    kind = _kind(path)
    if kind == ".txt" and isinstance(text_key, tuple):
        raise ConfigError(
            f"{path} is a text file, but records with {list(text_key)} are read from .jsonl or .parquet files"
        )
    with _open_checked(path, flag) as raw:
        number, offset = 0, 0  # the line reached and its byte offset (in the decompressed data)
        try:
            if kind == ".parquet":
                yield from _parquet_documents(_parquet_file(raw, path, text_key, flag), path, text_key, flag)
            elif kind == ".txt":
                yield _utf8(raw.read(), path, flag, f"text file {path}", 0)
            else:
                lines = raw  # binary lines, decoded one by one: errors then name the file's byte offset
                if kind in MAGIC:
                    check_magic(raw, path, kind, flag)
                    lines = gzip.GzipFile(fileobj=raw) if kind == ".jsonl.gz" else io.BufferedReader(ZstdStream(raw))
                for number, line in enumerate(lines, start=1):
                    try:
                        text = _json_text(line, f"{path}:{number}", offset, text_key, flag) if line.strip() else None
                    except ConfigError:  # damaged data can decode to garbage before its checksum fails: check that
                        collections.deque(lines if kind in MAGIC else (), maxlen=0)
                        raise
                    if text is not None:
                        yield text
                    offset += len(line)
        except (EOFError, zlib.error, gzip.BadGzipFile, zstandard.ZstdError) as err:
            name = MAGIC[kind][0]
            what = f"damaged: bad {name} data ({describe(err, 120)})"
            if isinstance(err, EOFError):  # gzip's and `ZstdStream`'s: the data stops inside a compressed stream
                what = f"truncated: its {name} data ends mid-stream"
            raise ConfigError(
                f"{path} is {what}, after {number} line(s) (at compressed byte {raw.tell()}); re-download it or drop "
                f"it from {flag}"
            ) from None
        except OSError as err:
            raise _cannot_read(path, err, flag) from None


def check_input(file: InputFile | str, text_key: str | tuple[str, ...] = "text", flag: str = "data.path") -> None:
    """Cheap checks of one file before any work, reading only its start: a .parquet file's schema
    has a string column `text_key`; a .gz/.zst file starts with its format's magic bytes; the first
    record of a .jsonl (compressed or not) holds a `text_key` string; a text file starts as UTF-8.
    What lies further in (a later line, a truncated stream) is found when its unit is prepared."""
    path = file.path if isinstance(file, InputFile) else str(file)
    kind = _kind(path)
    if kind.startswith(".jsonl"):
        documents = read_documents(file, text_key, flag)
        next(documents, None)  # the first line's errors are raised here
        documents.close()
        return
    with _open_checked(path, flag) as raw:
        try:
            if kind == ".parquet":
                _parquet_file(raw, path, text_key, flag)
            elif kind in MAGIC:
                check_magic(raw, path, kind, flag)
            else:
                head = raw.read(TEXT_HEAD_BYTES)
                try:  # incremental: a character cut at the end of what was read is no error
                    codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
                except UnicodeDecodeError:
                    _utf8(head, path, flag, f"text file {path}", 0)  # the message names the first bad byte
        except OSError as err:
            raise _cannot_read(path, err, flag) from None


TEXT_HEAD_BYTES = 1 << 16  # what check_input reads of a text file


def _open(path: str) -> IO[bytes]:
    """The file's bytes: with `_expand`, the only code that tells local files from remote ones."""
    if not is_url(path):
        return open(path, "rb")
    if path.startswith("gs://"):  # through etils.epath (gcsfs underneath), as the rest of the framework
        from etils import epath

        return epath.Path(path).open("rb")
    return fsspec.open(path, "rb").open()  # any other fsspec file system (memory:// in the tests)


def _expand(pattern: str, label: str) -> list[InputFile]:
    """The files one glob matches; `label` names the glob in errors."""
    if is_url(pattern):
        return _expand_remote(fsspec.filesystem(pattern.split("://", 1)[0]), pattern, label)
    pattern = os.path.abspath(os.path.expanduser(pattern))
    if os.path.isfile(pattern):  # a plain path matches itself, even with [ ] or * in its name
        return [InputFile(pattern, os.path.getsize(pattern))]
    files = [InputFile(p, os.path.getsize(p)) for p in glob.glob(pattern, recursive=True) if os.path.isfile(p)]
    if not files:
        if blocked := _unreadable_dir(pattern):  # glob skips what it cannot list, without a word
            raise ConfigError(
                f"{label}: the directory {blocked} cannot be read by this user, so its files cannot be listed; "
                f"fix its permissions (e.g. chmod u+rx {blocked})"
            )
        raise ConfigError(f"{label} {_NO_MATCH}")
    return files


def _expand_remote(fs: Any, pattern: str, label: str) -> list[InputFile]:
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
        raise ConfigError(f"{label} {_NO_MATCH}")
    return files


def _unreadable_dir(pattern: str) -> str | None:
    """The directory on the way to a glob's matches that this user cannot list or enter, if any."""
    parts = pattern.split(os.sep)
    magic = next((i for i, part in enumerate(parts) if glob.has_magic(part)), None)
    depth = len(parts) - 1 if magic is None else magic  # parts[:depth] is the directory glob lists first
    listed = os.sep.join(parts[:depth]) or os.sep
    for directory in (os.sep.join(parts[:i]) or os.sep for i in range(1, depth + 1)):  # from the root down
        if not os.path.isdir(directory):
            return None  # the path does not exist: "matches no file" is the right message
        if not os.access(directory, os.X_OK | (os.R_OK if directory == listed and magic is not None else 0)):
            return directory
    recursive = magic is not None and (magic < len(parts) - 1 or "**" in pattern)  # glob lists below, too
    below = os.walk(listed) if recursive else ()
    subdirectories = (os.path.join(root, name) for root, dirs, _ in below for name in dirs)
    return next((d for d in subdirectories if not os.access(d, os.R_OK | os.X_OK)), None)


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


def _kind(path: str) -> str:
    return next((suffix for suffix in SUFFIXES if path.lower().endswith(suffix)), ".txt")


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


def _json_text(line: bytes, where: str, offset: int, text_key: str | tuple[str, ...], flag: str) -> Any:
    decoded = _utf8(line, where, flag, where, offset)
    if isinstance(text_key, tuple):
        try:
            value = json.loads(decoded)
        except json.JSONDecodeError:
            value = None
        missing = [key for key in text_key if not isinstance(value, dict) or key not in value]
        if missing:
            raise ConfigError(
                f"{where} is not a JSON object with {' and '.join(map(repr, missing))}; write one object per line "
                f"with {', '.join(map(repr, text_key))}, name the fields that hold them, or drop the file from {flag}"
            )
        return where, {key: value[key] for key in text_key}
    try:
        text = json.loads(decoded)[text_key]
    except (json.JSONDecodeError, KeyError, TypeError, IndexError):
        text = None
    if not isinstance(text, str):
        raise ConfigError(
            f"{where} is not a JSON object with a {text_key!r} string; write one "
            f"{json.dumps({text_key: '...'})} object per line, or drop the file from {flag}"
        )
    return text


def _parquet_file(raw: IO[bytes], path: str, text_key: str | tuple[str, ...], flag: str) -> Any:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(raw)  # reads the footer only
    except (pa.ArrowException, OSError) as err:
        raise ConfigError(
            f"{path} is not a Parquet file, or is damaged ({describe(err, 120)}); re-download it or drop it from {flag}"
        ) from None
    schema = parquet.schema_arrow
    if isinstance(text_key, tuple):
        missing = [key for key in text_key if key not in schema.names]
        if missing:
            raise ConfigError(
                f"{path} has no column {missing[0]!r}; its columns are {schema.names}: name the columns that hold "
                f"{', '.join(map(repr, text_key))}, or drop the file from {flag}"
            )
        return parquet
    if text_key not in schema.names:
        raise ConfigError(
            f"{path} has no column {text_key!r}; its columns are {schema.names}: set the text key to the one "
            f"holding the text, or drop the file from {flag}"
        )
    kind = schema.field(text_key).type
    value = kind.value_type if pa.types.is_dictionary(kind) else kind
    if not (pa.types.is_string(value) or pa.types.is_large_string(value) or pa.types.is_string_view(value)):
        raise ConfigError(
            f"{path}: the column {text_key!r} holds {kind}, not strings; set the text key to a string column, "
            f"or drop the file from {flag}"
        )
    return parquet


def _parquet_documents(parquet: Any, path: str, text_key: str | tuple[str, ...], flag: str) -> Iterator:
    import pyarrow as pa

    row = 0
    try:
        keys = list(text_key) if isinstance(text_key, tuple) else [text_key]
        for batch in parquet.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=keys):
            if isinstance(text_key, tuple):
                for values in batch.to_pylist():
                    yield f"{path} row {row}", values
                    row += 1
                continue
            for text in batch.column(0).to_pylist():
                if text is None:
                    where = f"{path} row {row} (from 0): the {text_key!r} column is null"
                    raise ConfigError(f"{where}; drop or fill the null rows, or drop the file from {flag}")
                yield text
                row += 1
    except (pa.ArrowException, OSError) as err:
        damage = f"{path} is damaged: it cannot be read past row {row} ({describe(err, 120)})"
        raise ConfigError(f"{damage}; re-download it or drop it from {flag}") from None
