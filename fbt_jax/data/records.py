"""Prepared text: tokenise a corpus once, pack it, write fixed-length records (ArrayRecord).

`fbt-prepare` (and the trainer, on first use of a text or TFDS source) writes a directory:

    meta.json                   tokenizer, vocab size, seq_len, record and token counts
    train.array_record          packed records, one per example (see packing.py)
    validation.array_record

Training then reads records by index (random access), so the batch of any step can be rebuilt
from the step number alone. A prepared directory can live in a bucket: it is uploaded after
preparing, and copied once per host before training (`upload_dir`, `download_dir`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from typing import Any

import numpy as np

from fbt_jax.data.packing import pack_documents, record_to_example, records_to_examples
from fbt_jax.data.tokenizers import load_tokenizer
from fbt_jax.errors import ConfigError, describe

FORMAT_VERSION = 1
SPLIT_NAMES = ("train", "validation")


def write_records(path: str, records: Iterable[np.ndarray]) -> int:
    from array_record.python.array_record_module import ArrayRecordWriter

    writer = ArrayRecordWriter(path, "group_size:1")
    count = 0
    try:
        for record in records:
            writer.write(record.astype(np.int32).tobytes())
            count += 1
    finally:
        writer.close()
    return count


def prepare(
    documents: dict[str, Iterable[str]],
    tokenizer_spec: str,
    seq_len: int,
    out_dir: str,
    source: dict[str, Any],
    progress: bool = False,
) -> dict[str, Any]:
    """Tokenise and pack each split's documents into `out_dir` (written atomically)."""
    tokenizer = load_tokenizer(tokenizer_spec)
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp_dir = tempfile.mkdtemp(prefix=".prepare-", dir=parent)
    try:
        return _prepare_into(tmp_dir, documents, tokenizer, seq_len, out_dir, source, progress)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)  # gone after the rename, or after a failure


def _prepare_into(
    tmp_dir: str, documents: dict, tokenizer: Any, seq_len: int, out_dir: str, source: dict, progress: bool
) -> dict[str, Any]:
    stats = {"documents": {}, "tokens": {}, "records": {}}
    from tqdm import tqdm

    for split, docs in documents.items():
        counts = {"documents": 0, "tokens": 0}

        def tokenised(docs=docs, counts=counts, split=split):
            for text in tqdm(docs, desc=f"prepare {split}", unit="doc", disable=not progress):
                ids = tokenizer.encode(text)
                counts["documents"] += 1
                counts["tokens"] += len(ids)
                yield ids

        stats["records"][split] = write_records(
            os.path.join(tmp_dir, f"{split}.array_record"), pack_documents(tokenised(), seq_len)
        )
        stats["documents"][split], stats["tokens"][split] = counts["documents"], counts["tokens"]
    if stats["tokens"].get("train", 0) < seq_len + 1:
        raise ConfigError(
            f"the training data has {stats['tokens'].get('train', 0)} tokens, fewer than one sequence of "
            f"seq_len+1 = {seq_len + 1}; use more text or a shorter sequence length (data.seq_len, fbt-prepare --seq-len)"
        )
    files = {}
    for split in documents:
        name = f"{split}.array_record"
        path = os.path.join(tmp_dir, name)
        files[name] = {"bytes": os.path.getsize(path), "blake2b": file_digest(path)}
    meta = {
        "format_version": FORMAT_VERSION,
        "tokenizer": tokenizer.name,
        "vocab_size": tokenizer.vocab_size,
        "seq_len": seq_len,
        "source": source,
        **stats,
        "files": files,  # size and checksum of each records file, checked when it is opened
    }
    with open(os.path.join(tmp_dir, "meta.json"), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2)
    try:
        os.rename(tmp_dir, out_dir)  # atomic: readers see all of it or none
    except OSError:
        if not os.path.exists(os.path.join(out_dir, "meta.json")):
            raise
        # Another process prepared the same (deterministic) data first; theirs is kept.
    return meta


def file_digest(path: str) -> str:
    """blake2b of a file's bytes (about 1 GB/s)."""
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def read_meta(directory: str) -> dict[str, Any]:
    path = os.path.join(directory, "meta.json")
    if not os.path.isfile(path):
        raise ConfigError(
            f"{directory} holds no prepared data (no meta.json); run fbt-prepare or point data.path at text files"
        )
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
        if not isinstance(meta, dict) or not all(isinstance(meta.get(k), int) for k in ("vocab_size", "seq_len")):
            raise ValueError("vocab_size or seq_len missing")
    except (OSError, ValueError) as err:  # ValueError covers JSON and UTF-8 decoding errors
        raise ConfigError(f"{path} cannot be read ({describe(err)}); prepare the data again with fbt-prepare") from None
    if meta.get("format_version") != FORMAT_VERSION:
        raise ConfigError(
            f"{directory} was prepared in format {meta.get('format_version')}, expected {FORMAT_VERSION}; prepare it again"
        )
    return meta


class PackedRecords:
    """Random-access examples from a prepared split (picklable, for data-loader workers)."""

    packed = True

    def __init__(self, directory: str, split: str, verify: bool = True):
        from grain.sources import ArrayRecordDataSource

        self.directory, self.split = directory, split
        self.meta = read_meta(directory)
        self.seq_len = self.meta["seq_len"]
        self.vocab_size = self.meta["vocab_size"]
        self.path = path = os.path.join(directory, f"{split}.array_record")
        expected = self.meta.get("records", {}).get(split)
        if verify:
            check_file(path, self.meta.get("files", {}).get(f"{split}.array_record"))
        try:
            self._records = ArrayRecordDataSource(path)
            count = len(self._records)
            # A cheap integrity check (reading every record would cost an epoch): the count that
            # fbt-prepare recorded, and the first and last records, whole and of the right size.
            for index in {0, count - 1} if count else ():
                if len(self._records[index]) != 2 * (self.seq_len + 1) * 4:
                    raise ValueError(f"record {index} has {len(self._records[index])} bytes")
        except Exception as err:  # the reader raises assorted types for unreadable or corrupt files
            raise ConfigError(
                f"the prepared records {path} cannot be read ({describe(err)}); prepare the data again with fbt-prepare"
            ) from None
        if expected is not None and count != expected:
            raise ConfigError(
                f"the prepared records {path} hold {count} records, but fbt-prepare wrote {expected}; "
                "the file is incomplete or replaced: prepare the data again"
            )

    def __len__(self) -> int:
        return len(self._records)

    def _read(self, indices: list[int]) -> list[bytes]:
        """The raw records at `indices`; damage found while reading (in a file too large to be
        checked whole when opened) is one line, not the reader's traceback."""
        try:
            raw = self._records.__getitems__(indices)
            size = 2 * (self.seq_len + 1) * 4
            bad = next((i for i, r in zip(indices, raw) if len(r) != size), None)
            if bad is not None:
                raise ValueError(f"record {bad} has {len(raw[indices.index(bad)])} bytes, not {size}")
        except Exception as err:
            raise ConfigError(
                f"the prepared records {self.path} are damaged ({describe(err)}); prepare the data again with fbt-prepare"
            ) from None
        return raw

    def _record(self, index: int) -> np.ndarray:
        """(2, seq_len + 1): token ids and segment ids."""
        return np.frombuffer(self._read([int(index)])[0], np.int32).reshape(2, self.seq_len + 1)

    def example(self, index: int) -> dict[str, np.ndarray]:
        return record_to_example(self._record(index))

    def examples(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """A batch of examples, each key (len(indices), T), read in one batched lookup."""
        raw = self._read([int(i) for i in indices])
        stacked = np.frombuffer(b"".join(raw), np.int32).reshape(len(raw), 2, self.seq_len + 1)
        return records_to_examples(stacked)

    def __getstate__(self) -> dict[str, Any]:
        return {"directory": self.directory, "split": self.split}

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A data-loader worker: the file was checked when the parent opened it.
        self.__init__(state["directory"], state["split"], verify=False)


# Records files up to this size are checked whole against the checksum fbt-prepare recorded each
# time they are opened (about 0.5 s per GiB); larger ones by size only, and damage found while
# reading them is reported then.
VERIFY_MAX_BYTES = 1 << 30


def check_file(path: str, recorded: dict[str, Any] | None) -> None:
    """ConfigError if a records file differs from what fbt-prepare wrote (size, then checksum).

    Data prepared before checksums were recorded (no entry in meta.json) is not checked here.
    """
    if not recorded:
        return
    try:
        size = os.path.getsize(path)
    except OSError as err:
        raise ConfigError(
            f"the prepared records {path} cannot be read ({err.strerror or err}); prepare the data again with fbt-prepare"
        ) from None
    if size != recorded.get("bytes", size):
        raise ConfigError(
            f"the prepared records {path} hold {size} bytes, but fbt-prepare wrote {recorded['bytes']}; the file is "
            "truncated or replaced: prepare the data again with fbt-prepare"
        )
    if "blake2b" in recorded and size <= VERIFY_MAX_BYTES:
        try:
            digest = file_digest(path)
        except OSError as err:
            raise ConfigError(
                f"the prepared records {path} cannot be read ({err.strerror or err}); prepare the data again with fbt-prepare"
            ) from None
        if digest != recorded["blake2b"]:
            raise ConfigError(
                f"the prepared records {path} are damaged (their checksum differs from the one fbt-prepare recorded); "
                "prepare the data again with fbt-prepare"
            )


def upload_dir(local: str, url: str) -> None:
    """Copy a prepared directory to a bucket, meta.json last: readers take its presence as complete."""
    from etils import epath

    target = epath.Path(url)
    target.mkdir(parents=True, exist_ok=True)
    names = sorted(os.listdir(local), key=lambda n: n == "meta.json")
    for name in names:
        (target / name).write_bytes(open(os.path.join(local, name), "rb").read())


def read_remote_meta(url: str) -> dict[str, Any]:
    from etils import epath

    try:
        return json.loads((epath.Path(url) / "meta.json").read_text())
    except FileNotFoundError:
        raise ConfigError(
            f"{url} holds no prepared data (no meta.json); run fbt-prepare --output={url} first"
        ) from None
    except Exception as err:
        raise ConfigError(f"{url}/meta.json cannot be read ({describe(err)})") from None


def download_dir(url: str, cache_dir: str) -> str:
    """A local copy of a prepared directory in a bucket (records are read through the local file
    system), made once per host under `cache_dir`; returns its path."""
    from etils import epath

    local = os.path.join(cache_dir, "downloaded", hashlib.blake2b(url.encode(), digest_size=8).hexdigest())
    if os.path.exists(os.path.join(local, "meta.json")):
        return local
    source = epath.Path(url)
    if not (source / "meta.json").exists():
        raise ConfigError(f"{url} holds no prepared data (no meta.json); run fbt-prepare --output={url} first")
    os.makedirs(os.path.dirname(local), exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".download-", dir=os.path.dirname(local))
    try:
        for entry in sorted(source.iterdir(), key=lambda p: p.name == "meta.json"):
            with open(os.path.join(staging, entry.name), "wb") as f:
                f.write(entry.read_bytes())
        os.rename(staging, local)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return local
