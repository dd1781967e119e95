"""Where documents come from: local text files (a glob) or a prepared TFDS dataset, split into
train and validation documents for `records.prepare`.

Text documents go to validation by a hash of their text (`validation_fraction`), so the two splits
never share a document and the split does not depend on file order; a TFDS dataset keeps its own
splits.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from collections.abc import Iterable, Iterator

from fbt_jax.errors import ConfigError, describe


def text_files(pattern: str, flag: str = "data.path") -> list[str]:
    """Files matched by a glob (or a single path); a clear error if none, or one is unreadable/empty.

    `flag` is how the user gave the glob (a config field or a command-line flag), named in errors.
    """
    paths = sorted(p for p in glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(p))
    if not paths:
        raise ConfigError(f"{flag}={pattern!r} matches no file; give a glob of text files, e.g. 'corpus/*.txt'")
    for path in paths:
        if not os.access(path, os.R_OK):
            raise ConfigError(f"text file {path} is not readable; fix its permissions or drop it from {flag}")
        if os.path.getsize(path) == 0:
            raise ConfigError(f"text file {path} is empty; remove it or fix {flag}")
    return paths


def read_documents(paths: list[str], flag: str = "data.path") -> Iterator[str]:
    """`.jsonl` files: one document per line (its "text" field); other files: one document each."""
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                if path.endswith(".jsonl"):
                    for number, line in enumerate(f, start=1):
                        if line.strip():
                            try:
                                text = json.loads(line)["text"]
                            except (json.JSONDecodeError, KeyError, TypeError):
                                text = None
                            if not isinstance(text, str):
                                raise ConfigError(
                                    f"{path}:{number} is not a JSON object with a 'text' string; write one "
                                    '{"text": "..."} object per line, or drop the file from ' + flag
                                )
                            yield text
                else:
                    yield f.read()
        except UnicodeDecodeError as err:
            raise ConfigError(
                f"text file {path} is not UTF-8 text ({err.reason} at byte {err.start}); convert it to UTF-8 "
                f"or drop it from {flag}"
            ) from None
        except OSError as err:
            raise ConfigError(
                f"text file {path} cannot be read ({err.strerror or err}); fix it or drop it from {flag}"
            ) from None


def is_validation(text: str, fraction: float) -> bool:
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < fraction


def text_split_documents(
    pattern: str,
    validation_fraction: float,
    flag: str = "data.path",
    fraction_flag: str = "data.validation_fraction",
) -> tuple[dict[str, Iterable[str]], dict]:
    """The train and validation documents of text files; `flag` and `fraction_flag` name where the
    glob and the fraction came from, in errors."""
    if not 0.0 <= validation_fraction < 1.0:
        raise ConfigError(
            f"{fraction_flag}={validation_fraction} must be in [0, 1); give the share of documents to hold out, e.g. 0.01"
        )
    paths = text_files(pattern, flag)
    documents = {
        "train": (d for d in read_documents(paths, flag) if not is_validation(d, validation_fraction)),
        "validation": (d for d in read_documents(paths, flag) if is_validation(d, validation_fraction)),
    }
    fingerprint = [(p, os.path.getsize(p), int(os.path.getmtime(p))) for p in paths]
    return documents, {"kind": "text", "files": fingerprint, "validation_fraction": validation_fraction}


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
