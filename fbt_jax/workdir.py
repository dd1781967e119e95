"""A run's working directory: one live run at a time, its logs, and the record of its config.

The workdir holds the logs (metrics.jsonl, eval.jsonl, TensorBoard events, config.json,
summary.json) and, by default, the checkpoints. It is a local path or a `gs://` URL. Logs are
appended to, which object stores cannot do, so for a URL they are written to a local mirror
(`~/.cache/fbt-jax/workdirs/...`, or under $FBT_JAX_CACHE) and copied to the bucket whenever a
checkpoint is saved and when the run ends; checkpoints go to the bucket directly.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from typing import Any

import jax
import ml_collections

from fbt_jax import paths
from fbt_jax.errors import ConfigError, WorkdirBusy

LOG_NAMES = (
    "metrics.jsonl",
    "eval.jsonl",
    "summary.json",
    "config.json",
    "goodput.jsonl",
    "tensorboard",
    "wandb_run_id",
)
LOCK_NAME = ".fbt-train.lock"

# Config fields that never change the trained numbers: how a run is logged, evaluated, saved
# and laid out on devices.
NEUTRAL_PREFIXES = (
    "train.log_every",
    "train.peak_flops_per_device",
    "train.compilation_cache_dir",
    "train.profile_steps",
    "train.profile_python",
    "metrics.",
    "train.stop_at_step",
    "eval.",
    "checkpoint.",
    "mesh.",
    "sharding.",
    "distributed.",
    "data.num_workers",
    "data.prefetch",
    "data.cache_dir",
    "model.remat",
    "model.loss_chunk_size",
    "model.attention_impl",
)
# Config fields that may change when a run resumes, with a note: the neutral ones, the length of
# the run and the optimizer. Any other change (the data and its order, the pass schedule and
# objective, the seed, the batch) needs --config.checkpoint.allow_resume_changes=True, and model
# changes are refused outright.
RESUME_FREE_PREFIXES = ("train.steps", "train.microbatches", "optimizer.", *NEUTRAL_PREFIXES)
RESUME_IGNORED = ("workdir", "init_from", "fork_from", "dry_run", "dry_run_devices", "dry_run_hbm_gib", "dry_run_chip")
RESUME_IGNORED += ("dry_run_topology", "dry_run_num_slices")
# Config fields in which a fork may differ from its trunk: the neutral ones, and the pass schedule
# as long as it draws the same K at every step before the fork (checked where the fork restores).
FORK_FREE_PREFIXES = ("passes.schedule", *NEUTRAL_PREFIXES)


class RunDirectory:
    """The workdir of one run, locked for this process while the run lives."""

    def __init__(self, workdir: str):
        self.workdir = workdir
        self.is_url = paths.is_url(workdir)
        self.local = _local_mirror(workdir) if self.is_url else workdir
        self._lock_file: Any = None
        if jax.process_index() == 0:
            try:
                os.makedirs(self.local, exist_ok=True)
                if self.is_url:
                    self._download_logs()
            except OSError as err:
                raise ConfigError(
                    f"workdir={workdir!r} cannot be created ({err.strerror or err}); choose a writable directory"
                ) from None
            if not os.access(self.local, os.W_OK):
                raise ConfigError(f"workdir={workdir!r} is not writable; fix its permissions or choose another")

    def path(self, name: str) -> str:
        """Where to write the log file `name` (local, also for a URL workdir)."""
        return os.path.join(self.local, name)

    def lock(self) -> None:
        """Hold the workdir for this run; ConfigError (WorkdirBusy) if another live run holds it.

        An OS file lock, released by the kernel when the process ends however it ends, so a lock
        left by a killed run is never in the way ("stale" locks cannot exist on a local disk).
        """
        if jax.process_index() != 0:
            return
        path = self.path(LOCK_NAME)
        handle = open(path, "a+", encoding="utf-8")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            handle.close()
            raise WorkdirBusy(
                f"workdir {self.workdir} is in use by a live fbt-train ({holder}); wait for it to end, stop it, "
                "or choose another --config.workdir"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on host {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}")
        handle.flush()
        self._lock_file = handle

    def unlock(self) -> None:
        if self._lock_file is not None:
            self._lock_file.close()  # closing releases the lock
            self._lock_file = None

    def set_aside_previous_outputs(self, log: Any) -> None:
        """A run starting at step 0 never appends to (or deletes) an earlier run's logs."""
        if jax.process_index() != 0:
            return
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for name in LOG_NAMES:
            if os.path.exists(self.path(name)):
                os.rename(self.path(name), self.path(f"previous-{stamp}-{name}"))
                log(f"kept earlier run's {name} as previous-{stamp}-{name}")

    def write_config(self, config: ml_collections.ConfigDict, resumed_step: int) -> None:
        """config.json is this run's config; on a resume with changes the old one is kept beside."""
        if jax.process_index() != 0:
            return
        text = config.to_json_best_effort(indent=2)
        path = self.path("config.json")
        if resumed_step and os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                if f.read() != text:
                    os.rename(
                        path, self.path(f"config.before-step-{resumed_step}-{time.strftime('%Y%m%d-%H%M%S')}.json")
                    )
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)

    def sync(self) -> None:
        """Copy the logs to the bucket (URL workdirs only)."""
        if not self.is_url or jax.process_index() != 0:
            return
        from etils import epath

        remote = epath.Path(self.workdir)
        for root, _, files in os.walk(self.local):
            for name in files:
                if name == LOCK_NAME:
                    continue
                source = os.path.join(root, name)
                target = remote / os.path.relpath(source, self.local)
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(epath.Path(source).read_bytes())

    def _download_logs(self) -> None:
        """The logs a run on another host left in the bucket, into this host's mirror (one listing
        per directory: Cloud Storage paths do not glob recursively)."""
        from etils import epath

        pending = [epath.Path(self.workdir) / name for name in LOG_NAMES]
        while pending:
            source = pending.pop()
            if source.is_dir():
                pending += list(source.iterdir())
            elif source.exists():
                target = os.path.join(self.local, os.path.relpath(str(source), self.workdir))
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with open(target, "wb") as f:
                    f.write(source.read_bytes())


def local_dir(workdir: str) -> str:
    """Where this host writes a workdir's local files (itself, or the mirror of a URL)."""
    return _local_mirror(workdir) if paths.is_url(workdir) else workdir


def _local_mirror(url: str) -> str:
    base = os.environ.get("FBT_JAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "fbt-jax")
    scheme, rest = url.split("://", 1)
    return os.path.join(base, "workdirs", scheme, rest)


def resume_changes(saved: dict[str, Any], config: ml_collections.ConfigDict) -> tuple[list[str], list[str]]:
    """(changes allowed on resume, changes that need the explicit flag), one line each."""
    old, new = _flatten(saved), _flatten(json.loads(config.to_json_best_effort()))
    free, guarded = [], []
    for key in sorted(set(old) | set(new)):
        if key in RESUME_IGNORED or key not in old or old.get(key) == new.get(key):
            continue  # fields added since the checkpoint was written take their defaults
        line = f"{key}: {old.get(key)!r} -> {new.get(key)!r}"
        (free if key.startswith(RESUME_FREE_PREFIXES) else guarded).append(line)
    return free, guarded


def trajectory_fields(record: dict[str, Any]) -> dict[str, Any]:
    """The fields of a (JSON) config that decide the trained numbers up to a fork step: all but
    outputs, logging, evaluation and layout (FORK_FREE_PREFIXES, RESUME_IGNORED)."""
    return {
        key: value
        for key, value in _flatten(record).items()
        if key not in RESUME_IGNORED and not key.startswith(FORK_FREE_PREFIXES)
    }


def fork_changes(trunk: dict[str, Any], config: Any) -> list[str]:
    """The changes from a trunk's recorded config to this run's that a fork does not allow."""
    old, new = trajectory_fields(trunk), trajectory_fields(json.loads(config.to_json_best_effort()))
    return [f"{key}: {old[key]!r} -> {new.get(key)!r}" for key in sorted(old) if old[key] != new.get(key)]


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out |= _flatten(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = list(value) if isinstance(value, tuple) else value
    return out


def write_process_info(local_workdir: str, train_rows: list[int]) -> None:
    """Each process records where it runs and which rows of every batch it loads."""
    directory = os.path.join(local_workdir, "processes")
    os.makedirs(directory, exist_ok=True)
    info = {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "hostname": socket.gethostname(),
        "local_devices": [str(d) for d in jax.local_devices()],
        "train_rows": train_rows,
    }
    with open(os.path.join(directory, f"process_{jax.process_index()}.json"), "w", encoding="utf-8") as f:
        json.dump(info, f, indent=2)
