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
from fbt_jax.data.documents import text_plan, tfds_plan
from fbt_jax.data.mixture import Mixture, check_compatible, parse_mixture
from fbt_jax.data.preparation import SETTINGS, prepare_shard
from fbt_jax.data.tasks import SyntheticTask, make_task
from fbt_jax.data.tokenizers import load_tokenizer
from fbt_jax.errors import ConfigError

SOURCES = ("task", "text", "tfds", "mixture")


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


def prepared_dir(config: Any, path: str | None = None) -> str:
    """Where the packed records of a text/TFDS source live (`path`: one dataset of a mixture),
    preparing them on first use (resumably, into data.cache_dir)."""
    data = config.data
    path = data.path if path is None else path
    cache = data.cache_dir or os.path.join(_local_workdir(config), "data_cache")
    if data.source in ("text", "mixture") and paths.is_url(path):
        return records.download_dir(path, cache)  # prepared by fbt-prepare into a bucket
    if data.source in ("text", "mixture") and os.path.isdir(path):
        return path  # already prepared by fbt-prepare
    plan = _plan(config)
    key = json.dumps({k: plan[k] for k in (*SETTINGS, "inputs", "source")}, sort_keys=True)
    directory = os.path.join(cache, hashlib.blake2b(key.encode(), digest_size=8).hexdigest())
    if not os.path.exists(os.path.join(directory, "meta.json")):
        prepare_shard(plan, directory, log=lambda *_: None)
    return directory


def _plan(config: Any) -> dict[str, Any]:
    data = config.data
    if data.source == "text":
        return text_plan(data.path, data.tokenizer, data.seq_len, data.validation_fraction, data.text_key)
    splits = (data.tfds_train_split, data.tfds_validation_split)
    return tfds_plan(
        data.tfds_name, data.tfds_data_dir, data.tfds_text_key, splits, data.tokenizer, data.seq_len, "data.tokenizer"
    )


def _local_workdir(config: Any) -> str:
    from fbt_jax.workdir import local_dir

    return local_dir(config.workdir)


def prepared_meta(path: str) -> dict[str, Any] | None:
    """meta.json of a prepared dataset at `path` (local or gs://), None where `path` is no directory."""
    if paths.is_url(path):
        return records.read_remote_meta(path)
    if os.path.isdir(path):
        return records.read_meta(path)
    return None


def _adopt_tokenizer(config: Any, meta: dict[str, Any], where: str) -> None:
    """A run on prepared data uses the tokenizer it was prepared with (decoding needs it): the
    default data.tokenizer takes the dataset's; another one must be the same tokenizer."""
    data = config.data
    prepared_with = meta.get("tokenizer", "byte")
    if data.tokenizer == prepared_with:
        return
    if data.tokenizer == "byte":
        data.tokenizer = prepared_with
        return
    identity = meta.get("tokenizer_identity")
    if identity is None or load_tokenizer(data.tokenizer).identity != identity:
        raise ConfigError(
            f"data.tokenizer={data.tokenizer!r} is not the tokenizer {where} was prepared with ({prepared_with}); "
            "leave data.tokenizer unset or give that tokenizer"
        )


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
    if data.source == "mixture":
        if not data.mixture:
            raise ConfigError(
                "data.source='mixture' needs data.mixture, e.g. 'web=prepared/web:0.7,code=prepared/code:0.3'"
            )
        components = parse_mixture(data.mixture)
        metas = []
        for name, path, _ in components:
            meta = prepared_meta(path)
            if meta is None:
                raise ConfigError(
                    f"data.mixture: {name}={path} is not a prepared dataset; run fbt-prepare --output={path} first"
                )
            metas.append(meta)
        check_compatible([c[0] for c in components], metas)
        _adopt_tokenizer(config, metas[0], "data.mixture")
        return max(m["vocab_size"] for m in metas), "the prepared data of data.mixture"
    if data.source == "text":
        if not data.path:
            raise ConfigError("data.source='text' needs data.path: a glob of text files or an fbt-prepare directory")
        meta = prepared_meta(data.path)
        if meta is not None:
            _adopt_tokenizer(config, meta, data.path)
            return meta["vocab_size"], f"the prepared data in {data.path}"
        from fbt_jax.data.sources import list_inputs

        list_inputs(data.path)
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


def make_source(config: Any, split: str) -> TaskSplit | records.PackedRecords | Mixture:
    """The random-access example source for `split` ("train" or "validation"), validated."""
    data = config.data
    validate_data(config)
    if data.source == "task":
        return TaskSplit(make_task(config), split)
    if data.source == "mixture":
        components = parse_mixture(data.mixture)
        sources = [_records(config, split, path) for _, path, _ in components]
        return Mixture([c[0] for c in components], sources, [c[2] for c in components], config.seed)
    return _records(config, split)


def _records(config: Any, split: str, path: str | None = None) -> records.PackedRecords:
    data = config.data
    source = records.PackedRecords(prepared_dir(config, path), split)
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
