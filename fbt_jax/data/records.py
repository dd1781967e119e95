"""Prepared text on disk: the dataset format, and random access to its records (ArrayRecord).

`fbt-prepare` (and the trainer, on first use of a text or TFDS source) writes a directory
(`preparation.py` writes it, one unit of input files at a time, on any number of machines):

    prepare.json                      the plan: inputs, tokenizer identity, seq_len, split fraction
    00000.train.array_record          packed records of unit 0 (see packing.py), …
    00000.validation.array_record
    progress/00000.json               unit 0 is complete: its files, sizes, checksums and counts
    meta.json                         the manifest, written last: a dataset exists once it does

meta.json names every records file of each split in order, with its size, checksum, records,
documents and tokens, beside the tokenizer (name, identity, vocabulary, end/beginning-of-document
ids), seq_len and per-split totals; chat data (format 3) also its `chat` settings and `record_rows`. Training reads a split's files as one random-access set of
records, so the batch of any step can be rebuilt from the step number alone. Directories written
by the first format (one `<split>.array_record` each) are still read.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from typing import Any

import numpy as np

from fbt_jax import permissions
from fbt_jax.data.packing import record_to_example, records_to_examples
from fbt_jax.errors import ConfigError, describe

FORMAT_VERSION = 2
CHAT_FORMAT_VERSION = 3  # records with a third row, each token's trained flag (packing.py); older code refuses it
READABLE_VERSIONS = (1, 2, 3)
SPLIT_NAMES = ("train", "validation")


def write_records(path: str, records: Iterable[np.ndarray]) -> int:
    """Write records to an ArrayRecord file; returns how many."""
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


def file_digest(path: str) -> str:
    """blake2b of a file's bytes (about 1 GB/s)."""
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def split_files(meta: dict[str, Any], split: str) -> list[tuple[str, dict[str, Any] | None]]:
    """The records files of `split`, in order, with what fbt-prepare recorded of each."""
    if meta.get("format_version") == 1:
        name = f"{split}.array_record"
        return [(name, meta.get("files", {}).get(name))]
    return [(name, entry) for name, entry in meta["files"].items() if entry["split"] == split]


def _unreadable(directory: str) -> str | None:
    """The first directory on the way to `directory` that the user may not read, if any."""
    path = os.path.abspath(directory)
    parts = []
    while True:
        parts.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    for path in reversed(parts):
        if os.path.isdir(path) and not os.access(path, os.R_OK | os.X_OK):
            return path
    return None


def read_meta(directory: str) -> dict[str, Any]:
    path = os.path.join(directory, "meta.json")
    if not os.path.isfile(path):
        locked = _unreadable(directory)
        if locked is not None:
            raise ConfigError(
                f"the prepared data in {directory} cannot be read: permission denied on {locked}; "
                "fix its permissions (chmod) or use a copy you can read"
            )
        if os.path.isfile(os.path.join(directory, "prepare.json")):
            raise ConfigError(
                f"{directory} holds an unfinished preparation (no meta.json yet); run the same fbt-prepare "
                "command again (every --shard-index) to finish it"
            )
        raise ConfigError(
            f"{directory} holds no prepared data (no meta.json); run fbt-prepare or point data.path at text files"
        )
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
        if not isinstance(meta, dict) or not all(isinstance(meta.get(k), int) for k in ("vocab_size", "seq_len")):
            raise ValueError("vocab_size or seq_len missing")
    except PermissionError:
        raise ConfigError(
            f"{path} cannot be read: permission denied; fix its permissions (chmod) or use a copy you can read"
        ) from None
    except (OSError, ValueError) as err:  # ValueError covers JSON and UTF-8 decoding errors
        raise ConfigError(f"{path} cannot be read ({describe(err)}); prepare the data again with fbt-prepare") from None
    if meta.get("format_version") not in READABLE_VERSIONS:
        raise ConfigError(
            f"{directory} was prepared in format {meta.get('format_version')}, expected {FORMAT_VERSION}; prepare it again"
        )
    return meta


class RecordFiles:
    """Random access to the records of several ArrayRecord files as one sequence (in order): a
    batch reads each file's records with one call to that file's reader, in this thread (grain's
    data source starts a thread pool per batch, which costs more than the reads at our sizes)."""

    def __init__(self, paths: list[str]):
        from array_record.python.array_record_module import ArrayRecordReader

        # readahead off: reads are random; a small buffer, as grain's own source uses.
        self._readers = [ArrayRecordReader(p, "readahead_buffer_size:0", file_reader_buffer_size=32768) for p in paths]
        self.starts = np.cumsum([0] + [r.num_records() for r in self._readers])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, index: int) -> bytes:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: list[int]) -> list[bytes]:
        keys = np.asarray(indices, np.int64)
        if len(keys) and (keys.min() < 0 or keys.max() >= len(self)):
            raise IndexError(f"record index out of range [0, {len(self)})")
        files = np.searchsorted(self.starts, keys, side="right") - 1
        out: list[bytes] = [b""] * len(keys)
        for f in np.unique(files):
            rows = np.flatnonzero(files == f)
            for row, record in zip(rows, self._readers[f].read((keys[rows] - self.starts[f]).tolist())):
                out[row] = record
        return out


class PackedRecords:
    """Random-access examples from a prepared split: all its records files as one set, in the
    order meta.json lists them (picklable, for data-loader workers)."""

    packed = True

    def __init__(self, directory: str, split: str, verify: bool = True):
        self.directory, self.split = directory, split
        self.meta = read_meta(directory)
        self.seq_len = self.meta["seq_len"]
        self.vocab_size = self.meta["vocab_size"]
        self.rows = int(self.meta.get("record_rows", 2))  # 3: chat records (token ids, segment ids, trained)
        self.chat = self.rows == 3  # its examples carry a fuse mask
        files = split_files(self.meta, split)
        self.paths = [os.path.join(directory, name) for name, _ in files]
        self.path = self.paths[0] if len(self.paths) == 1 else os.path.join(directory, f"*.{split}.array_record")
        if verify:
            total = sum((entry or {}).get("bytes", 0) for _, entry in files)
            for path, (_, entry) in zip(self.paths, files):
                check_file(path, entry, checksum=total <= VERIFY_MAX_BYTES)
        expected = self.meta.get("records", {}).get(split)
        count = 0
        if not self.paths:  # a split with no records at all (nothing held out)
            self._records = None
        else:
            try:
                self._records = RecordFiles(self.paths)
                count = len(self._records)
                # A cheap integrity check (reading every record would cost an epoch): the count that
                # fbt-prepare recorded, and the first and last records of each file, whole and of the right size.
                starts = self._records.starts  # where each file's records begin, as its reader counts them
                probe = sorted({int(i) for s, e in zip(starts[:-1], starts[1:]) if e > s for i in (s, e - 1)})
                for index, record in zip(probe, self._records.__getitems__(probe)):
                    if len(record) != self.rows * (self.seq_len + 1) * 4:
                        raise ValueError(f"record {index} has {len(record)} bytes")
            except Exception as err:  # the reader raises assorted types for unreadable or corrupt files
                raise ConfigError(
                    f"the prepared records {self.path} cannot be read ({describe(err)}); prepare the data again with fbt-prepare"
                ) from None
        if expected is not None and count != expected:
            raise ConfigError(
                f"the prepared records {self.path} hold {count} records, but fbt-prepare wrote {expected}; "
                "a file is incomplete or replaced: prepare the data again"
            )
        self._count = count

    def __len__(self) -> int:
        return self._count

    def _read(self, indices: list[int]) -> list[bytes]:
        """The raw records at `indices`; damage found while reading (in a file too large to be
        checked whole when opened) is one line, not the reader's traceback."""
        try:
            raw = self._records.__getitems__(indices)
            size = self.rows * (self.seq_len + 1) * 4
            bad = next((i for i, r in zip(indices, raw) if len(r) != size), None)
            if bad is not None:
                raise ValueError(f"record {bad} has {len(raw[indices.index(bad)])} bytes, not {size}")
        except Exception as err:
            raise ConfigError(
                f"the prepared records {self.path} are damaged ({describe(err)}); prepare the data again with fbt-prepare"
            ) from None
        return raw

    def _record(self, index: int) -> np.ndarray:
        """(rows, seq_len + 1): token ids, segment ids (and trained flags)."""
        return np.frombuffer(self._read([int(index)])[0], np.int32).reshape(self.rows, self.seq_len + 1)

    def example(self, index: int) -> dict[str, np.ndarray]:
        return record_to_example(self._record(index))

    def examples(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """A batch of examples, each key (len(indices), T), read in one batched lookup."""
        raw = self._read([int(i) for i in indices])
        stacked = np.frombuffer(b"".join(raw), np.int32).reshape(len(raw), self.rows, self.seq_len + 1)
        return records_to_examples(stacked)

    def __getstate__(self) -> dict[str, Any]:
        return {"directory": self.directory, "split": self.split}

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A data-loader worker: the files were checked when the parent opened them.
        self.__init__(state["directory"], state["split"], verify=False)


# Datasets up to this size are checked whole against the checksums fbt-prepare recorded each time
# they are opened (about 0.5 s per GiB); larger ones by size only, and damage found while reading
# them is reported then.
VERIFY_MAX_BYTES = 1 << 30


def check_file(path: str, recorded: dict[str, Any] | None, checksum: bool = True) -> None:
    """ConfigError if a records file differs from what fbt-prepare wrote (size, then checksum).

    Data prepared before checksums were recorded (no entry in meta.json) is not checked here.
    """
    if not recorded:
        return
    try:
        size = os.path.getsize(path)
    except OSError as err:
        missing = isinstance(err, FileNotFoundError) or err.errno == errno.ENOENT
        raise ConfigError(
            f"the prepared records {path} "
            + ("are missing (meta.json lists them)" if missing else f"cannot be read ({err.strerror or err})")
            + "; prepare the data again with fbt-prepare"
        ) from None
    if size != recorded.get("bytes", size):
        raise ConfigError(
            f"the prepared records {path} hold {size} bytes, but fbt-prepare wrote {recorded['bytes']}; the file is "
            "truncated or replaced: prepare the data again with fbt-prepare"
        )
    if checksum and "blake2b" in recorded and size <= VERIFY_MAX_BYTES:
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


def epoch_order(global_indices: np.ndarray, n: int, seed: int, shuffle: bool) -> np.ndarray:
    """Record of each global example index over a set of `n` records: epoch e = g // n reads
    `shuffle_e(g mod n)`, a seeded bijection (grain's index_shuffle) drawn anew each epoch."""
    epochs, within = np.divmod(np.asarray(global_indices, np.int64), n)
    if not shuffle:
        return within
    from grain.experimental import index_shuffle

    return np.array(
        [
            index_shuffle(int(j), max_index=n - 1, seed=_epoch_seed(seed, int(e)), rounds=4)
            for e, j in zip(epochs, within)
        ],
        np.int64,
    )


def _epoch_seed(seed: int, epoch: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"{seed}:{epoch}".encode(), digest_size=4).digest(), "little")


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
    """A local copy of a prepared dataset in a bucket (records are read through the local file
    system), made once per host under `cache_dir`: the files meta.json lists, then meta.json;
    returns its path."""
    from etils import epath

    local = os.path.join(cache_dir, "downloaded", hashlib.blake2b(url.encode(), digest_size=8).hexdigest())
    if os.path.exists(os.path.join(local, "meta.json")):
        return local
    meta = read_remote_meta(url)
    names = [name for split in SPLIT_NAMES for name, _ in split_files(meta, split)]
    os.makedirs(os.path.dirname(local), exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".download-", dir=os.path.dirname(local))
    try:
        for name in names:
            with (epath.Path(url) / name).open("rb") as src, open(os.path.join(staging, name), "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 24)
        with open(os.path.join(staging, "meta.json"), "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=2)
        permissions.give_umask_modes(staging)  # mkdtemp's 0700: other users of this host share the cache
        os.rename(staging, local)
    except FileNotFoundError as err:
        raise ConfigError(
            f"the prepared data in {url} lists a file that is missing ({describe(err)}); prepare the data again"
        ) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return local
