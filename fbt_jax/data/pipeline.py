"""From the data plan (`plan.py`) to the batches of each step: sources, shuffling, per-host rows, prefetch.

Data is step-indexed: the global batch of step s holds global examples s·B … s·B + B − 1, and
example g of a finite source (epoch e = g // N) is record `shuffle_e(g mod N)`, a seeded bijection
(grain's index_shuffle) drawn anew each epoch. A process loads only the rows of each batch that
its devices hold. Restarting at step s therefore needs nothing but s (no iterator state), on any
number of hosts: see docs/data.md for why this design was chosen.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from fbt_jax import paths
from fbt_jax.data import records
from fbt_jax.data.documents import text_plan, tfds_plan
from fbt_jax.data.mixture import Mixture
from fbt_jax.data.plan import DataPlan, Dataset
from fbt_jax.data.preparation import SETTINGS, prepare_shard
from fbt_jax.data.tasks import SyntheticTask
from fbt_jax.errors import ConfigError


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


def prepared_dir(plan: DataPlan, dataset: Dataset) -> str:
    """Where the packed records of a dataset of a text/TFDS source live, preparing them on first
    use (resumably, into the plan's cache directory)."""
    if paths.is_url(dataset.path):
        return records.download_dir(dataset.path, plan.cache_dir)  # prepared by fbt-prepare into a bucket
    if dataset.prepared:
        return dataset.path  # prepared by fbt-prepare
    preparation = _preparation(plan)
    key = json.dumps(
        {k: preparation[k] for k in (*SETTINGS, "chat", "inputs", "source") if k in preparation}, sort_keys=True
    )
    directory = os.path.join(plan.cache_dir, hashlib.blake2b(key.encode(), digest_size=8).hexdigest())
    if not os.path.exists(os.path.join(directory, "meta.json")):
        # Processes of one run on one host share the cache: one prepares, the others wait and read it
        # (two preparations of one directory clear each other's staging).
        os.makedirs(plan.cache_dir, exist_ok=True)
        with open(f"{directory}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not os.path.exists(os.path.join(directory, "meta.json")):
                prepare_shard(preparation, directory, log=lambda *_: None)
    return directory


def _preparation(plan: DataPlan) -> dict[str, Any]:
    """The preparation of an unprepared text corpus or a TFDS dataset (see `documents`)."""
    if plan.source == "text":
        path = plan.datasets[0].path
        chat = dict(plan.chat) if plan.chat else None
        return text_plan(path, plan.tokenizer_spec, plan.seq_len, plan.validation_fraction, plan.text_key, chat=chat)
    name, data_dir, text_key, splits = plan.tfds
    return tfds_plan(name, data_dir, text_key, splits, plan.tokenizer_spec, plan.seq_len, "data.tokenizer")


def make_source(plan: DataPlan, split: str, readers: str = "") -> TaskSplit | records.PackedRecords | Mixture:
    """The random-access example source for `split` ("train" or "validation"); `readers` says what
    reads a validation split and the setting that turns it off (`validation_readers`), for the
    error that an empty one gets."""
    if plan.source == "task":
        return TaskSplit(plan.task, split)
    if plan.source == "mixture":
        sources = [_records(plan, split, dataset, readers) for dataset in plan.datasets]
        return Mixture([d.name for d in plan.datasets], sources, [d.weight for d in plan.datasets], plan.seed)
    return _records(plan, split, plan.datasets[0] if plan.datasets else Dataset(plan.tfds[0], ""), readers)


def _records(plan: DataPlan, split: str, dataset: Dataset, readers: str = "") -> records.PackedRecords:
    source = records.PackedRecords(prepared_dir(plan, dataset), split)
    if source.seq_len != plan.seq_len:
        raise ConfigError(
            f"the prepared data in {source.directory} has seq_len {source.seq_len} but data.seq_len={plan.seq_len}; "
            "prepare it again with this length or set data.seq_len to match"
        )
    if len(source) == 0 and split == "train":
        raise ConfigError(
            f"the prepared train split in {source.directory} is empty; use more data or a smaller validation fraction"
        )
    if len(source) == 0:
        raise ConfigError(
            f"the prepared validation split in {source.directory} is empty, and {readers or 'this command'} reads it; "
            "prepare the data again with fbt-prepare --validation-fraction above 0"
            + (", or turn off what reads it" if readers else "")
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
        return records.epoch_order(global_indices, len(self.source), self.seed, self.shuffle)

    def __call__(self, step: int) -> dict[str, np.ndarray]:
        global_indices = step * self.batch_size + np.asarray(self.rows, np.int64)
        if isinstance(self.source, Mixture):
            return self.source.examples_at(global_indices, self.seed, self.shuffle)
        return self.source.examples(self.record_indices(global_indices))


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
