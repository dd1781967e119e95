"""A weighted mixture of prepared datasets, as one random-access source.

`data.mixture = "web=prepared/web:0.7,code=prepared/code:0.2,math=gs://b/math:0.1"` (names are
optional; a dataset's directory name is its default name). Which dataset global example g comes
from is a seeded function of g alone: the examples are cut into blocks of M (the smallest M that
makes every weight × M a whole number, at most MAX_BLOCK), each block holds exactly round(w · M)
examples of each dataset, at places drawn by a seeded bijection of the block. So the mix is exact
in every block and within M examples in any window, and resuming at any step on any number of
hosts needs nothing but the step. Each dataset's own examples are read in its own seeded epoch
order (`records.epoch_order`), so a small dataset repeats and a large one is never exhausted early.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from fbt_jax.data import records
from fbt_jax.errors import ConfigError

MAX_BLOCK = 1000


def parse_mixture(spec: str, flag: str = "data.mixture") -> list[tuple[str, str, float]]:
    """(name, path, weight) of each dataset of `[name=]path:weight,...` (paths as given: the
    command line resolves them, `config.resolve_config_paths`)."""
    components = []
    for part in (p.strip() for p in spec.split(",")):
        name, has_name, rest = part.partition("=")
        if not has_name:
            name, rest = "", part
        path, colon, weight_text = rest.rpartition(":")
        try:
            weight = float(weight_text) if colon and path and not weight_text.startswith("//") else None
        except ValueError:
            weight = None
        if weight is None:
            raise ConfigError(
                f"{flag}: {part!r} is not [name=]path:weight; write e.g. 'web=prepared/web:0.7,code=prepared/code:0.3'"
            )
        if not math.isfinite(weight) or weight < 0:
            raise ConfigError(f"{flag}: the weight of {part!r} is {weight_text}; weights must be >= 0 (and finite)")
        components.append((name or os.path.basename(path.rstrip("/")), path, weight))
    names = [name for name, _, _ in components]
    if len(set(names)) != len(names):
        raise ConfigError(f"{flag} names a dataset twice ({names}); give each one a distinct name=")
    if sum(weight for _, _, weight in components) <= 0:
        raise ConfigError(f"{flag}: the weights sum to 0; give at least one dataset a positive weight")
    return components


def block_counts(weights: Sequence[float]) -> list[int]:
    """Examples of each dataset per block: exact where some M ≤ MAX_BLOCK makes them whole,
    else the largest-remainder rounding of the weights over MAX_BLOCK."""
    total = sum(weights)
    shares = [w / total for w in weights]
    for block in range(1, MAX_BLOCK + 1):
        counts = [s * block for s in shares]
        if all(abs(c - round(c)) < 1e-9 for c in counts):
            return [round(c) for c in counts]
    counts = [math.floor(s * MAX_BLOCK) for s in shares]
    by_remainder = sorted(range(len(shares)), key=lambda i: (-(shares[i] * MAX_BLOCK - counts[i]), i))
    for i in by_remainder[: MAX_BLOCK - sum(counts)]:
        counts[i] += 1
    return counts


def _seed(*parts: Any) -> int:
    return int.from_bytes(hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=4).digest(), "little")


class Mixture:
    """The examples of several sources, dataset i for a share weights[i] of the global indices."""

    packed = True

    def __init__(self, names: list[str], sources: list[Any], weights: list[float], seed: int):
        self.names, self.sources, self.weights = names, sources, weights
        self.counts = block_counts(weights)
        self.block = sum(self.counts)
        self.starts = np.cumsum([0, *self.counts])
        self.seed = seed
        self.vocab_size = max(s.vocab_size for s in sources)
        self.seq_len = sources[0].seq_len
        # With chat data in the mix, every batch carries a fuse mask: -1 on pretraining rows (their
        # fuse-from is drawn as without chat data, feedback.data_fuse), so every step has one program.
        self.chat = any(getattr(s, "chat", False) for s in sources)

    def __len__(self) -> int:
        return sum(len(s) for s, c in zip(self.sources, self.counts) if c)

    def assign(self, global_indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(dataset, index among that dataset's examples) of each global example index."""
        from grain.experimental import index_shuffle

        blocks, within = np.divmod(np.asarray(global_indices, np.int64), self.block)
        if self.block > 1:
            within = np.array(
                [
                    index_shuffle(int(j), max_index=self.block - 1, seed=_seed(self.seed, "block", int(b)), rounds=4)
                    for b, j in zip(blocks, within)
                ],
                np.int64,
            )
        dataset = np.searchsorted(self.starts, within, side="right") - 1
        counts = np.asarray(self.counts, np.int64)
        return dataset, blocks * counts[dataset] + within - self.starts[dataset]

    def examples(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """Examples by global index, each dataset's read in order (evaluation, probes)."""
        return self.examples_at(indices, self.seed, shuffle=False)

    def examples_at(self, global_indices: np.ndarray, seed: int, shuffle: bool) -> dict[str, np.ndarray]:
        """The examples of global indices, each dataset read in its own epoch order."""
        dataset, index = self.assign(global_indices)
        parts = {}
        for i, source in enumerate(self.sources):
            rows = np.flatnonzero(dataset == i)
            if len(rows):
                parts[i] = (
                    rows,
                    source.examples(records.epoch_order(index[rows], len(source), _seed(seed, i), shuffle)),
                )
        first = next(iter(parts.values()))[1]
        out = {key: np.empty((len(dataset), *v.shape[1:]), v.dtype) for key, v in first.items()}
        if self.chat:
            out["fuse"] = np.full(first["inputs"].shape[1:], -1, np.int32)[None].repeat(len(dataset), 0)
        for rows, examples in parts.values():
            for key, value in examples.items():
                out[key][rows] = value
        return out


def check_compatible(names: list[str], metas: list[dict[str, Any]], flag: str = "data.mixture") -> None:
    """One tokenizer and one seq_len across the datasets of a mixture."""
    for key in ("seq_len", "tokenizer_identity"):
        # Data of the first format records no identity: its tokenizer's name stands in.
        values = {name: meta.get(key) or meta.get("tokenizer") for name, meta in zip(names, metas)}
        if len(set(values.values())) > 1:
            raise ConfigError(
                f"{flag}: the datasets differ in {key} ({values}); prepare them with the same tokenizer and --seq-len"
            )
