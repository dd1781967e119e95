"""How a preparation is cut up: input files into units, units onto shards (machines), and which
shard this process is.

A *unit* is a run of consecutive input files (in sorted order) and the smallest piece of work: it
is prepared whole into its own records files, and a preparation resumes unit by unit. Units depend
only on the list of input files and their sizes, never on how many shards or workers prepare them,
so any split of the work produces the same dataset, file for file. Shards get units by size
(largest first, to the least loaded shard), so machines finish at about the same time.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

from fbt_jax.errors import ConfigError

# A corpus is cut into about this many units (more where files are large), so that a few machines
# with a few workers each have work to share; no unit is much larger than UNIT_MAX_BYTES.
TARGET_UNITS = 64
UNIT_MAX_BYTES = 256 << 20


def group_units(sizes: Sequence[int]) -> list[list[int]]:
    """File indices of each unit: consecutive files, each unit holding at least `target` bytes
    (the corpus size / TARGET_UNITS, at most UNIT_MAX_BYTES), one file at least."""
    target = min(UNIT_MAX_BYTES, max(1, math.ceil(sum(sizes) / TARGET_UNITS)))
    units: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for index, size in enumerate(sizes):
        current.append(index)
        filled += size
        if filled >= target:
            units.append(current)
            current, filled = [], 0
    if current:
        units.append(current)
    return units


def assign_units(unit_sizes: Sequence[int], num_shards: int) -> list[list[int]]:
    """The units of each shard, balanced by bytes: largest unit first, to the least loaded shard
    (ties: the lower index); each shard's units in increasing order."""
    loads = [0] * num_shards
    shards: list[list[int]] = [[] for _ in range(num_shards)]
    for unit in sorted(range(len(unit_sizes)), key=lambda u: (-unit_sizes[u], u)):
        shard = min(range(num_shards), key=lambda s: (loads[s], s))
        shards[shard].append(unit)
        loads[shard] += unit_sizes[unit]
    return [sorted(units) for units in shards]


def _env_int(name: str) -> int | None:
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"the environment variable {name}={value!r} is not an integer; unset it or fix it") from None


def shard_from_env(num_shards: int | None, shard_index: int | None) -> tuple[int, int, str]:
    """(num_shards, shard_index, where they came from): the flags when given, else a SLURM array
    task (SLURM_ARRAY_TASK_ID − SLURM_ARRAY_TASK_MIN of SLURM_ARRAY_TASK_COUNT), else a TPU VM
    worker (TPU_WORKER_ID of the hosts in TPU_WORKER_HOSTNAMES), else shard 0 of 1."""
    origin = "--num-shards/--shard-index"
    env_count, env_index = None, None
    if _env_int("SLURM_ARRAY_TASK_ID") is not None:
        env_index = _env_int("SLURM_ARRAY_TASK_ID") - (_env_int("SLURM_ARRAY_TASK_MIN") or 0)
        env_count = _env_int("SLURM_ARRAY_TASK_COUNT")
        origin = "SLURM_ARRAY_TASK_ID/SLURM_ARRAY_TASK_COUNT"
    elif _env_int("TPU_WORKER_ID") is not None:
        env_index = _env_int("TPU_WORKER_ID")
        hosts = [h for h in os.environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
        env_count = len(hosts) or None
        origin = "TPU_WORKER_ID/TPU_WORKER_HOSTNAMES"
    count = num_shards if num_shards is not None else (env_count or 1)
    index = shard_index if shard_index is not None else (env_index or 0)
    if num_shards is not None or shard_index is not None:
        origin = "--num-shards/--shard-index" if env_count is None or num_shards is not None else origin
    if count < 1:
        raise ConfigError(f"--num-shards={count} must be at least 1 (from {origin})")
    if not 0 <= index < count:
        raise ConfigError(
            f"shard index {index} is outside the {count} shard(s) (from {origin}); use an index in 0..{count - 1}"
        )
    return count, index, origin
