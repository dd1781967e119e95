"""`init_from`: what a new phase may change of the model it starts from.

A run with `init_from` takes another run's parameters and nothing else (a fresh optimizer, its own
schedule, data and sequence length): instruction tuning, a long-context extension. Its model must be
the same network, except for

- the rotary settings (`ROTARY_FIELDS`): a long-context extension raises `rope_theta` or adds a
  linear / llama3 scaling; the angles change, not the weights;
- `sliding_window`: which keys a query reads, not what it computes with them;
- a larger `vocab_size`: tokens a chat template needs (its turn markers), added to the tokenizer
  (`fbt-train-tokenizer --from`). The new rows of the embedding (and of an untied readout) start at
  the mean of the old rows; the old rows are kept bitwise. With the mean, every new token starts
  with the average logit, so the distribution over the old tokens moves by at most
  log(1 + n_new / V_old) nats of KL (Hewitt, "Initializing new word embeddings for pretrained
  language models", 2021), where random rows can take any mass; the tuning data then teaches them.

Anything else (width, depth, heads, a smaller vocabulary, dtypes, the fusion) is another network:
refused in one line, before any parameter is read.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections
import numpy as np

from fbt_jax.checkpoint import model_differences
from fbt_jax.errors import ConfigError

ROTARY_FIELDS = (
    "rope_theta",
    "rope_scaling",
    "rope_scaling_factor",
    "rope_low_freq_factor",
    "rope_high_freq_factor",
    "rope_original_max_positions",
)
MAY_CHANGE = (*ROTARY_FIELDS, "sliding_window")
VOCAB_TABLES = ("embedding_VD", "readout_VD")  # the parameters with a row per token


@dataclasses.dataclass(frozen=True)
class Changes:
    """What this run changes of the model it starts from."""

    changed: tuple[str, ...]  # "model.rope_theta: 10000.0 → 500000.0", ...
    saved_vocab_size: int
    vocab_size: int

    @property
    def new_tokens(self) -> int:
        return self.vocab_size - self.saved_vocab_size


def changes(saved_model: dict[str, Any], config: ml_collections.ConfigDict, where: str) -> Changes:
    """The changes `config.model` makes to the model recorded at `where` (a checkpoint's meta
    'model'); ConfigError naming every other difference."""
    saved, current, differ = model_differences(saved_model, config)
    refused = [k for k in differ if k not in (*MAY_CHANGE, "vocab_size")]
    if current["vocab_size"] < saved["vocab_size"]:
        refused.append("vocab_size")
    if refused:
        said = "; ".join(f"model.{k}: checkpoint {saved.get(k)!r}, config {current.get(k)!r}" for k in refused)
        raise ConfigError(
            f"--config.init_from: the checkpoint {where} was written by a different model ({said}); init_from may change "
            f"only {', '.join(MAY_CHANGE)} and grow vocab_size: set the other model fields to that run's values"
        )
    described = tuple(f"model.{k}: {saved[k]!r} → {current[k]!r}" for k in differ)
    return Changes(described, int(saved["vocab_size"]), int(current["vocab_size"]))


def extend_rows(table_VD: np.ndarray, vocab_size: int) -> np.ndarray:
    """`table_VD` with rows appended up to `vocab_size`, each the mean of the existing rows
    (computed in float64, stored in the table's dtype); the existing rows unchanged."""
    old = table_VD.shape[0]
    if vocab_size <= old:
        return table_VD
    mean_D = table_VD.astype(np.float64).mean(axis=0).astype(table_VD.dtype)
    return np.concatenate([table_VD, np.broadcast_to(mean_D, (vocab_size - old, table_VD.shape[1]))])


def is_vocab_table(path: tuple) -> bool:
    """Whether a parameter path (a jax key path, which may end in the variable's `.value`, or an nnx
    flat path) names a table with a row per token."""
    names = [getattr(key, "key", getattr(key, "name", key)) for key in path]
    return bool(names) and names[-1 if names[-1] != "value" else -2] in VOCAB_TABLES
