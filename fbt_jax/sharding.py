"""Device mesh and the shardings of the train state and batches.

The mesh has one `data` axis over all devices: parameters and optimizer state are replicated and
the batch is split along its rows. (Parameters already carry logical axis names, so FSDP/tensor
layouts only need rules that map those names onto more mesh axes.)
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DATA_AXIS = "data"


def make_mesh() -> Mesh:
    return Mesh(np.asarray(jax.devices()), (DATA_AXIS,))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(DATA_AXIS))


def global_batch(local_rows: dict[str, np.ndarray], mesh: Mesh, global_batch_size: int) -> dict[str, Any]:
    """Assemble a global batch from this process's rows (every process passes its own slice)."""
    sharding = batch_sharding(mesh)
    return {
        key: jax.make_array_from_process_local_data(sharding, rows, (global_batch_size, *rows.shape[1:]))
        for key, rows in local_rows.items()
    }


def process_rows(global_batch_size: int) -> slice:
    """The rows of the global batch that this process loads."""
    per_process = global_batch_size // jax.process_count()
    start = jax.process_index() * per_process
    return slice(start, start + per_process)
