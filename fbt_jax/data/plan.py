"""`config.data` resolved once: the source, its datasets and their metadata, the tokenizer, the
splits, the cache, as one immutable `DataPlan` that everything downstream takes (the loader, the
dry run, validation, fbt-eval, fbt-decode, the harness) instead of reading the config piecemeal.

`plan_data` makes every check that needs no tokenising (one-line errors) and reads each prepared
dataset's meta.json and the tokenizer at most once per process (`read_meta_once`,
`tokenizers.load_tokenizer`'s cache). A run on prepared data uses the tokenizer its data was
prepared with: the plan names it (`tokenizer`), and validation writes it into the run's config so
that the run's record says which tokenizer decodes it.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

from fbt_jax import paths
from fbt_jax.data import records
from fbt_jax.data.mixture import check_compatible, parse_mixture
from fbt_jax.data.tasks import SyntheticTask, make_task
from fbt_jax.data.tokenizers import Tokenizer, load_tokenizer
from fbt_jax.errors import ConfigError

SOURCES = ("task", "text", "tfds", "mixture")


@dataclasses.dataclass(frozen=True)
class Dataset:
    """One dataset of the plan: a text corpus or prepared directory (`data.path`), or one part of a
    mixture, with its weight; `meta` is its meta.json where it is prepared already."""

    name: str
    path: str
    weight: float = 1.0
    meta: tuple[tuple[str, Any], ...] | None = None  # meta.json's items (a tuple keeps the plan immutable)

    @property
    def prepared(self) -> bool:
        return self.meta is not None


@dataclasses.dataclass(frozen=True)
class DataPlan:
    """What `config.data` means, resolved and checked: see the module docstring."""

    source: str  # task | text | tfds | mixture
    seq_len: int
    seed: int
    tokenizer_spec: str  # for prepared data: the tokenizer it was prepared with
    task: SyntheticTask | None = None  # source = task
    datasets: tuple[Dataset, ...] = ()  # text: one; mixture: its parts; task and tfds: none
    text_key: str = "text"
    chat: tuple[tuple[str, Any], ...] | None = None  # chat files (conversations.settings), as items: immutable
    validation_fraction: float = 0.01
    tfds: tuple[str, str, str, tuple[str, str]] = ("", "", "text", ("train", "validation"))  # name, dir, key, splits
    cache_dir: str = ""  # where text/TFDS sources are prepared on first use
    shuffle: bool = True
    num_workers: int = 0
    prefetch: int = 2
    vocab_size: int = 0
    vocab_origin: str = ""  # what the vocabulary size comes from, for messages

    @property
    def packed(self) -> bool:
        """Text, TFDS and mixture records are packed (segment ids, positions); task examples are not."""
        return self.source != "task"

    @functools.cached_property
    def tokenizer(self) -> Tokenizer:
        """The run's tokenizer, loaded on first use (built-in tasks have none)."""
        if self.source == "task":
            raise ConfigError(f"the built-in task {self.task.task!r} has no text tokenizer; use a run trained on text")
        return load_tokenizer(self.tokenizer_spec)


def plan_data(config: Any, read_data: bool = True) -> DataPlan:
    """The data plan of a run config. `read_data=False` is for a trained run's record (fbt-eval,
    fbt-decode, the harness): its tokenizer is already the one its data was prepared with, and its
    data need not be reachable from here, so nothing of the data is read."""
    data = config.data
    if data.source not in SOURCES:
        raise ConfigError(f"data.source={data.source!r} is unknown; use one of {SOURCES}")
    if data.seq_len < 2:
        raise ConfigError(f"data.seq_len={data.seq_len} is too short; use at least 2 tokens")
    common = dict(
        source=data.source,
        seq_len=int(data.seq_len),
        seed=int(config.seed),
        tokenizer_spec=data.tokenizer,
        text_key=data.text_key,
        validation_fraction=data.validation_fraction,
        tfds=(
            data.tfds_name,
            data.tfds_data_dir,
            data.tfds_text_key,
            (data.tfds_train_split, data.tfds_validation_split),
        ),
        cache_dir=data.cache_dir or os.path.join(_local_workdir(config), "data_cache"),
        shuffle=bool(data.shuffle),
        num_workers=int(data.num_workers),
        prefetch=int(data.prefetch),
    )
    if data.source == "task":
        task = make_task(config)
        origin = f"data.task={data.task!r}" + (f", data.group={data.group!r}" if data.task == "word_problem" else "")
        return DataPlan(**common, task=task, vocab_size=task.vocab_size, vocab_origin=origin)
    if not read_data:
        datasets = tuple(Dataset(n, p, w) for n, p, w in named_paths(data))
        return DataPlan(**common, datasets=datasets)
    if data.source == "mixture":
        if not data.mixture:
            raise ConfigError(
                "data.source='mixture' needs data.mixture, e.g. 'web=prepared/web:0.7,code=prepared/code:0.3'"
            )
        datasets = []
        for name, path, weight in parse_mixture(data.mixture):
            meta = read_meta_once(path)
            if meta is None:
                raise ConfigError(
                    f"data.mixture: {name}={path} is not a prepared dataset; run fbt-prepare --output={path} first"
                )
            datasets.append(Dataset(name, path, weight, tuple(sorted(meta.items()))))
        metas = [dict(d.meta) for d in datasets]
        check_compatible([d.name for d in datasets], metas)
        tokenizer = _adopted_tokenizer(data.tokenizer, metas[0], "data.mixture")
        vocab = max(m["vocab_size"] for m in metas)
        common.update(tokenizer_spec=tokenizer)
        return DataPlan(
            **common, datasets=tuple(datasets), vocab_size=vocab, vocab_origin="the prepared data of data.mixture"
        )
    if data.source == "text":
        if not data.path:
            raise ConfigError("data.source='text' needs data.path: a glob of text files or an fbt-prepare directory")
        meta = read_meta_once(data.path)
        if meta is not None:
            common.update(tokenizer_spec=_adopted_tokenizer(data.tokenizer, meta, data.path))
            dataset = Dataset(os.path.basename(data.path.rstrip("/")), data.path, 1.0, tuple(sorted(meta.items())))
            origin = f"the prepared data in {data.path}"
            return DataPlan(**common, datasets=(dataset,), vocab_size=meta["vocab_size"], vocab_origin=origin)
        from fbt_jax.data.sources import list_inputs

        list_inputs(data.path)
        chat = chat_settings(data)
        common.update(chat=tuple(sorted(chat.items())) if chat else None)
    elif not data.tfds_name:
        raise ConfigError("data.source='tfds' needs data.tfds_name (and data.tfds_data_dir)")
    elif not data.tfds_data_dir:
        raise ConfigError(
            f"the TFDS dataset {data.tfds_name!r} needs data.tfds_data_dir, the directory it was prepared in"
        )
    if not 0.0 <= data.validation_fraction < 1.0:
        raise ConfigError(f"data.validation_fraction={data.validation_fraction} must be in [0, 1)")
    plan = DataPlan(
        **common,
        datasets=tuple(Dataset(n, p, w) for n, p, w in named_paths(data)),
        vocab_origin=f"data.tokenizer={data.tokenizer!r}",
    )
    return dataclasses.replace(plan, vocab_size=plan.tokenizer.vocab_size)


def chat_settings(data: Any) -> dict[str, Any] | None:
    """data.format's settings for files of chat or prompt–completion records (None for text)."""
    from fbt_jax.data.conversations import settings

    if data.format == "text":
        return None
    fields = tuple(f.strip() for f in data.fields.split(",") if f.strip())
    template = paths.resolve(data.chat_template, "data.chat_template") if data.chat_template else None
    return settings(data.format, load_tokenizer(data.tokenizer), template, fields, data.turns, data.overlong, "data.")


def named_paths(data: Any) -> list[tuple[str, str, float]]:
    if data.source == "mixture":
        return parse_mixture(data.mixture) if data.mixture else []
    if data.source == "text":
        return [(os.path.basename(str(data.path).rstrip("/")), data.path, 1.0)]
    return []


def _adopted_tokenizer(spec: str, meta: dict[str, Any], where: str) -> str:
    """The tokenizer a run on prepared data uses: the default (byte) takes the dataset's; another
    must be the very tokenizer the data was prepared with."""
    prepared_with = meta.get("tokenizer", "byte")
    if spec in (prepared_with, "byte"):
        return prepared_with
    identity = meta.get("tokenizer_identity")
    if identity is None or load_tokenizer(spec).identity != identity:
        raise ConfigError(
            f"data.tokenizer={spec!r} is not the tokenizer {where} was prepared with ({prepared_with}); "
            "leave data.tokenizer unset or give that tokenizer"
        )
    return spec


_METAS: dict[tuple[str, int], dict[str, Any] | None] = {}


def read_meta_once(path: str) -> dict[str, Any] | None:
    """meta.json of a prepared dataset at `path` (local or gs://), None where `path` is no directory;
    read once per process (a local one again if its meta.json changed)."""
    if paths.is_url(path):
        key = (path, 0)
        if key not in _METAS:
            _METAS[key] = records.read_remote_meta(path)
        return _METAS[key]
    if not os.path.isdir(path):
        return None
    try:
        key = (os.path.abspath(path), os.stat(os.path.join(path, "meta.json")).st_mtime_ns)
    except OSError:
        return records.read_meta(path)  # names what is wrong (permissions, not prepared)
    if key not in _METAS:
        _METAS[key] = records.read_meta(path)
    return _METAS[key]


def _local_workdir(config: Any) -> str:
    from fbt_jax.workdir import local_dir

    return local_dir(config.workdir)


def run_chat_template(config: Any, tokenizer: Any, log: Any = print) -> str | None:
    """The template a run was tuned with: the one its chat data was prepared with (meta.json's `chat`, which
    `--chat-template` may have set), else its tokenizer's own (a base model's: usually None). Data no longer
    reachable from here falls back to the tokenizer's, said in `log`."""
    from fbt_jax.data.chat import chat_template

    if config.data.get("chat_template") and config.data.get("format", "text") != "text":  # chat files read directly
        return chat_template(tokenizer, config.data.chat_template)
    for _, path, _ in named_paths(config.data):
        try:
            meta = read_meta_once(path) if path else None
        except ConfigError:
            meta = None
            log(f"the run's data {path} cannot be read here: using its tokenizer's own chat template")
        template = ((meta or {}).get("chat") or {}).get("template")
        if template is not None:
            return template
    return chat_template(tokenizer)
