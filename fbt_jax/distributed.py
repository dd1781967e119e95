"""Multi-process (multi-host) set-up and the cross-process agreement checks.

Every process runs the same Python loop and must launch the same compiled program at every step;
if two processes drew different pass counts K they would wait for each other in mismatched
collectives forever. K is a pure function of (seed, schedule, step), so one start-up check that
all processes hold the same K sequence proves agreement for the whole run; a cheap re-check at
every K change guards against anything that slipped past (e.g. mixed library versions).
"""

from __future__ import annotations

import hashlib
import os

import jax
import ml_collections
import numpy as np
from jax.experimental import multihost_utils

from fbt_jax.errors import ProcessMismatchError
from fbt_jax.schedule import PassSchedule


def _cluster_detected() -> bool:
    """A multi-process launch that jax.distributed.initialize() can configure by itself."""
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        return True
    hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    return "," in hosts or "MEGASCALE_COORDINATOR_ADDRESS" in os.environ


def initialize(dist: ml_collections.ConfigDict) -> bool:
    """Start jax.distributed when the launch is multi-process; returns whether it did.

    Explicit coordinator/process fields win (local launches, custom clusters); in `auto` mode a
    SLURM job with several tasks or a multi-host TPU slice is detected from its environment.
    """
    if dist.mode == "never":
        return False
    if dist.coordinator_address:
        jax.distributed.initialize(
            coordinator_address=dist.coordinator_address,
            num_processes=dist.num_processes,
            process_id=dist.process_id,
        )
        return True
    if dist.mode == "always" or _cluster_detected():
        jax.distributed.initialize()
        return True
    return False


def schedule_fingerprint(schedule: PassSchedule, start_step: int, end_step: int) -> int:
    """A 63-bit digest of the K drawn at every step in [start_step, end_step)."""
    ks = np.array([schedule.num_passes(s) for s in range(start_step, end_step)], np.int8)
    return int.from_bytes(hashlib.blake2b(ks.tobytes(), digest_size=8).digest(), "little") >> 1


def _gather(values: list[int]) -> np.ndarray:
    return np.asarray(multihost_utils.process_allgather(np.asarray(values, np.int64)))


def check_schedule_agreement(schedule: PassSchedule, start_step: int, end_step: int) -> None:
    """Fail on every process, with the same message, if processes would draw different Ks."""
    if jax.process_count() == 1:
        return
    gathered = _gather([schedule_fingerprint(schedule, start_step, end_step), schedule.seed])
    if len({int(x) for x in gathered[:, 0]}) > 1:
        detail = ", ".join(f"process {i}: seed {int(s)} fingerprint {int(f):x}" for i, (f, s) in enumerate(gathered))
        raise ProcessMismatchError(
            f"processes would draw different pass counts K ({detail}); every process must run with the same "
            "seed and passes.schedule"
        )


def check_step_agreement(step: int, num_passes: int) -> None:
    """All processes are at `step` and about to run the program for K = `num_passes`."""
    if jax.process_count() == 1:
        return
    gathered = _gather([step, num_passes])
    if np.any(gathered != gathered[0]):
        detail = ", ".join(f"process {i}: step {int(s)} K={int(k)}" for i, (s, k) in enumerate(gathered))
        raise ProcessMismatchError(f"processes disagree on the step or pass count ({detail}); stopping to avoid a hang")
