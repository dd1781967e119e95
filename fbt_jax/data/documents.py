"""What a preparation reads: the plan of a text corpus (its files, cut into units) or of a
prepared TFDS dataset, and the rule that sends a document to train or validation.

Text documents go to validation by a hash of their text (`validation_fraction`), so the two splits
never share a document and the split depends neither on file order nor on how many shards or
workers prepare the corpus; a TFDS dataset keeps its own splits.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

from fbt_jax.data import records
from fbt_jax.data.shards import group_units
from fbt_jax.errors import ConfigError, describe


def is_validation(text: str, fraction: float) -> bool:
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < fraction


def _tokenizer_settings(tokenizer_spec: str, flag: str) -> dict[str, Any]:
    from fbt_jax.data.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_spec, flag)
    return {
        "tokenizer": tokenizer.name,
        "tokenizer_identity": tokenizer.identity,
        "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id,
        "bos_id": tokenizer.bos_id,
    }


def text_plan(
    spec: str,
    tokenizer: str,
    seq_len: int,
    validation_fraction: float,
    text_key: str = "text",
    flag: str = "data.path",
    fraction_flag: str = "data.validation_fraction",
    tokenizer_flag: str = "data.tokenizer",
    chat: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The plan of preparing the text files `spec` names (see `sources.list_inputs`): every check
    that needs no full read is made here, before any work. `chat`: chat or prompt–completion records
    (`conversations.settings`) rather than texts."""
    from fbt_jax.data.sources import check_input, list_inputs

    if not 0.0 <= validation_fraction < 1.0:
        raise ConfigError(
            f"{fraction_flag}={validation_fraction} must be in [0, 1); give the share of documents to hold out, e.g. 0.01"
        )
    settings = _tokenizer_settings(tokenizer, tokenizer_flag)
    files = list_inputs(spec, flag)
    for file in files:
        check_input(file, tuple(chat["keys"]) if chat else text_key, flag)
    inputs = [[f.path, f.size] for f in files]
    return {
        **({"chat": chat} if chat else {}),
        "format_version": records.FORMAT_VERSION,
        **settings,
        "seq_len": seq_len,
        "validation_fraction": validation_fraction,
        "text_key": text_key,
        "flag": flag,
        "source": {"kind": "text", "spec": spec, "files": len(files), "bytes": sum(f.size for f in files)},
        "inputs": inputs,
        "units": group_units([size for _, size in inputs]),
    }


def tfds_plan(
    name: str, data_dir: str, text_key: str, splits: tuple[str, str], tokenizer: str, seq_len: int, tokenizer_flag: str
) -> dict[str, Any]:
    """The plan of preparing a TFDS dataset's two splits (one unit)."""
    tfds_split_documents(name, data_dir, text_key, *splits)  # checks that it exists and has the feature
    source = {"kind": "tfds", "name": name, "data_dir": str(data_dir), "splits": list(splits)}
    return {
        "format_version": records.FORMAT_VERSION,
        **_tokenizer_settings(tokenizer, tokenizer_flag),
        "seq_len": seq_len,
        "validation_fraction": None,
        "text_key": text_key,
        "flag": "--tfds-name",
        "source": source,
        "tfds": source,
        "inputs": [],
        "units": [[]],
    }


def tfds_split_documents(
    name: str, data_dir: str | None, text_key: str, train_split: str, validation_split: str
) -> tuple[dict[str, Iterable[str]], dict]:
    if not data_dir:
        raise ConfigError(f"the TFDS dataset {name!r} needs its data_dir (data.tfds_data_dir / --tfds-data-dir)")
    import tensorflow_datasets as tfds

    try:
        builder = tfds.builder(name, data_dir=data_dir)
        info = builder.info
        splits = {
            s: builder.as_data_source(split=sp) for s, sp in (("train", train_split), ("validation", validation_split))
        }
    except Exception as err:  # tfds raises many types for "not found"; report them as one line
        raise ConfigError(f"TFDS dataset {name!r} is not prepared in {data_dir} ({describe(err, 300)})") from None
    if text_key not in info.features:
        raise ConfigError(f"TFDS dataset {name!r} has no feature {text_key!r}; its features are {list(info.features)}")

    def texts(source):
        for i in range(len(source)):
            value = source[i][text_key]
            yield value.decode("utf-8") if isinstance(value, bytes) else str(value)

    documents = {split: texts(source) for split, source in splits.items()}
    return documents, {
        "kind": "tfds",
        "name": name,
        "data_dir": str(data_dir),
        "version": str(info.version),
        "splits": [train_split, validation_split],
    }
