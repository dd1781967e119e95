"""From `config.data` to the batches of each step: sources, shuffling, per-host rows, prefetch.

Data is step-indexed: the global batch of step s holds global examples s·B … s·B + B − 1, and
example g of a finite source (epoch e = g // N) is record `shuffle_e(g mod N)`, a seeded bijection
(grain's index_shuffle) drawn anew each epoch. A process loads only the rows of each batch that
its devices hold. Restarting at step s therefore needs nothing but s (no iterator state), on any
number of hosts: see docs/data.md for why this design was chosen.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from fbt_jax import paths
from fbt_jax.data import records
from fbt_jax.data.documents import text_files, text_split_documents, tfds_split_documents
from fbt_jax.data.tasks import SyntheticTask, make_task
from fbt_jax.data.tokenizers import load_tokenizer
from fbt_jax.errors import ConfigError

SOURCES = ("task", "text", "tfds")


@dataclasses.dataclass(frozen=True)
class TaskSplit:
    """One split of a synthetic task as a random-access source."""

    task: SyntheticTask
    split: str
    packed = False

    @property
    def vocab_size(self) -> int:
        return self.task.vocab_size

    def __len__(self) -> int:
        return len(self.task)

    def examples(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        return self.task.examples(self.split, indices)


def prepared_dir(config: Any) -> str:
    """Where the packed records of a text/TFDS source live, preparing them on first use."""
    data = config.data
    cache = data.cache_dir or os.path.join(_local_workdir(config), "data_cache")
    if data.source == "text" and paths.is_url(data.path):
        return records.download_dir(data.path, cache)  # prepared by fbt-prepare into a bucket
    if data.source == "text" and os.path.isdir(data.path):
        return data.path  # already prepared by fbt-prepare
    if data.source == "text":
        documents, source = text_split_documents(data.path, data.validation_fraction)
    else:
        documents, source = tfds_split_documents(
            data.tfds_name, data.tfds_data_dir, data.tfds_text_key, data.tfds_train_split, data.tfds_validation_split
        )
    key = json.dumps(
        {
            "source": source,
            "tokenizer": os.path.abspath(data.tokenizer) if data.tokenizer != "byte" else "byte",
            "seq_len": data.seq_len,
        },
        sort_keys=True,
    )
    directory = os.path.join(cache, hashlib.blake2b(key.encode(), digest_size=8).hexdigest())
    if not os.path.exists(os.path.join(directory, "meta.json")):
        records.prepare(documents, data.tokenizer, data.seq_len, directory, source)
    return directory


def _local_workdir(config: Any) -> str:
    from fbt_jax.workdir import local_dir

    return local_dir(config.workdir)


def validate_data(config: Any) -> tuple[int, str]:
    """Cheap checks of `config.data` (no tokenising); returns the vocabulary size and its origin."""
    data = config.data
    if data.source not in SOURCES:
        raise ConfigError(f"data.source={data.source!r} is unknown; use one of {SOURCES}")
    if data.seq_len < 2:
        raise ConfigError(f"data.seq_len={data.seq_len} is too short; use at least 2 tokens")
    if data.source == "task":
        task = make_task(config)
        return task.vocab_size, f"data.task={data.task!r}" + (
            f", data.group={data.group!r}" if data.task == "word_problem" else ""
        )
    if data.source == "text":
        if not data.path:
            raise ConfigError("data.source='text' needs data.path: a glob of text files or an fbt-prepare directory")
        if paths.is_url(data.path):
            return records.read_remote_meta(data.path)["vocab_size"], f"the prepared data in {data.path}"
        if os.path.isdir(data.path):
            meta = records.read_meta(data.path)
            return meta["vocab_size"], f"the prepared data in {data.path}"
        text_files(data.path)
    elif not data.tfds_name:
        raise ConfigError("data.source='tfds' needs data.tfds_name (and data.tfds_data_dir)")
    elif not data.tfds_data_dir:
        raise ConfigError(
            f"the TFDS dataset {data.tfds_name!r} needs data.tfds_data_dir, the directory it was prepared in"
        )
    if not 0.0 <= data.validation_fraction < 1.0:
        raise ConfigError(f"data.validation_fraction={data.validation_fraction} must be in [0, 1)")
    tokenizer = load_tokenizer(data.tokenizer)
    return tokenizer.vocab_size, f"data.tokenizer={data.tokenizer!r}"


def make_source(config: Any, split: str) -> TaskSplit | records.PackedRecords:
    """The random-access example source for `split` ("train" or "validation"), validated."""
    data = config.data
    validate_data(config)
    if data.source == "task":
        return TaskSplit(make_task(config), split)
    source = records.PackedRecords(prepared_dir(config), split)
    if source.seq_len != data.seq_len:
        raise ConfigError(
            f"the prepared data in {source.directory} has seq_len {source.seq_len} but data.seq_len={data.seq_len}; "
            "prepare it again with this length or set data.seq_len to match"
        )
    if len(source) == 0:
        raise ConfigError(
            f"the prepared {split} split in {source.directory} is empty; use more data or a smaller validation fraction"
        )
    return source


@dataclasses.dataclass(frozen=True)
class StepBatches:
    """Maps a step to this process's rows of that step's global batch (picklable for workers)."""

    source: Any
    batch_size: int
    rows: tuple[int, ...]
    seed: int
    shuffle: bool

    def record_indices(self, global_indices: np.ndarray) -> np.ndarray:
        if not isinstance(self.source, records.PackedRecords):
            return global_indices  # synthetic tasks: every index is already a fresh example
        from grain.experimental import index_shuffle

        n = len(self.source)
        epochs, within = np.divmod(global_indices, n)
        if not self.shuffle:
            return within
        return np.array(
            [
                index_shuffle(int(j), max_index=n - 1, seed=_epoch_seed(self.seed, int(e)), rounds=4)
                for e, j in zip(epochs, within)
            ],
            np.int64,
        )

    def __call__(self, step: int) -> dict[str, np.ndarray]:
        global_indices = step * self.batch_size + np.asarray(self.rows, np.int64)
        return self.source.examples(self.record_indices(global_indices))


def _epoch_seed(seed: int, epoch: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"{seed}:{epoch}".encode(), digest_size=4).digest(), "little")


def batch_iterator(batches: StepBatches, start_step: int, num_workers: int = 0, prefetch: int = 2) -> Iterator[dict]:
    """Batches for steps start_step, start_step + 1, … computed ahead by grain.

    With `num_workers` > 0 worker processes build batches in parallel; otherwise a background
    thread keeps `prefetch` batches ready. Either way the batch of step s depends only on s.
    """
    import grain

    steps = grain.MapDataset.range(start_step, 2**62).map(batches)
    # One element is a whole batch, so grain's per-element read threads (16 by default) only add
    # contention (≈ 0.2 ms per batch on 2 cores); parallelism comes from the prefetch below.
    dataset = steps.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
    if num_workers > 0:
        from absl import flags

        if not flags.FLAGS.is_parsed():  # grain's workers read absl flags; library callers never parse any
            flags.FLAGS.mark_as_parsed()
        dataset = dataset.mp_prefetch(
            grain.MultiprocessingOptions(num_workers=num_workers, per_worker_buffer_size=prefetch)
        )
    elif prefetch > 0:
        dataset = grain.experimental.ThreadPrefetchIterDataset(dataset, prefetch_buffer_size=prefetch)
    return iter(dataset)
