"""Run-time services of the commands that compile (fbt-train, fbt-eval, fbt-decode, the harness),
none of them part of the math: the persistent compilation cache (a restart loads its compiled
programs instead of compiling them again) and the profiler window's setting (the hook that traces
it is `train.hooks.Profiler`). A room on the ground floor, so that evaluation and validation use it
without reaching up into the training package.

The cache is JAX's own: the key covers the program, the compiler flags, the devices and the JAX
version, so a cached program is the program that would have been compiled, and training resumed
from a warm cache is bitwise the same. Only process 0 writes entries (JAX's rule, to spare shared
file systems and buckets contention), so the other hosts of a run save their compile time only
when the directory is shared: a bucket, or a file system every host mounts.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import jax

from fbt_jax import paths
from fbt_jax.errors import ConfigError

CACHE_SUBDIR = "compilation_cache"
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


def compilation_cache_dir(config: Any, workdir: str = "") -> str:
    """Where a run's compiled programs are kept ("" = nowhere): `train.compilation_cache_dir`, or
    for "auto" $JAX_COMPILATION_CACHE_DIR when set, else `<workdir>/compilation_cache`."""
    value = str(config.train.compilation_cache_dir)
    if value != "auto":
        return value
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return os.environ["JAX_COMPILATION_CACHE_DIR"]
    base = workdir or config.workdir
    return f"{base.rstrip('/')}/{CACHE_SUBDIR}" if paths.is_url(base) else os.path.join(base, CACHE_SUBDIR)


def compilation_cache_flag(config: Any) -> str:
    """What chose the run's compilation cache directory, for a message about it: the config field,
    or $JAX_COMPILATION_CACHE_DIR where "auto" took it from the environment."""
    if str(config.train.compilation_cache_dir) == "auto" and os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return "JAX_COMPILATION_CACHE_DIR"
    return "--config.train.compilation_cache_dir"


def use_compilation_cache(directory: str, flag: str = "--config.train.compilation_cache_dir") -> None:
    """Point JAX's persistent compilation cache at `directory` ("" turns it off), before anything
    is compiled; every program is cached, however quickly it compiled, unless the JAX variables
    that set those thresholds are given."""
    from jax.experimental.compilation_cache import compilation_cache

    if directory and not paths.is_url(directory):
        if os.path.exists(directory) and not os.path.isdir(directory):
            variable = flag.isupper()  # JAX_COMPILATION_CACHE_DIR, not a flag
            fix = "unset it or point it at a directory" if variable else "give a directory, or '' to turn the cache off"
            raise ConfigError(f"{flag}={directory!r} is a file; {fix}")
        paths.check_output_dir(directory, flag)
        os.makedirs(directory, exist_ok=True)
    compilation_cache.reset_cache()  # a second run in one process may name another directory
    jax.config.update("jax_enable_compilation_cache", bool(directory))
    jax.config.update("jax_compilation_cache_dir", directory or None)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    CACHE_HITS.listen()


def use_run_cache(config: Any, run: str, log: Any) -> None:
    """The compilation cache of a trained run, for a command that reads it (fbt-eval, fbt-decode):
    `run` is its workdir or checkpoint directory. A directory this user cannot write (someone
    else's run) turns the cache off for this command, with a line saying so."""
    workdir = run.rstrip("/")
    if os.path.basename(workdir) == "checkpoints":
        workdir = os.path.dirname(workdir)
    directory = compilation_cache_dir(config, workdir)
    try:
        use_compilation_cache(directory, compilation_cache_flag(config))
    except ConfigError as err:
        log(f"compilation cache off for this command: {err}")
        use_compilation_cache("")


class CacheHits:
    """Counts the programs loaded from the persistent cache (JAX reports each as an event), so a
    compile report can say which programs were loaded rather than compiled."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()
        self._listening = False

    def listen(self) -> None:
        if not self._listening:
            jax.monitoring.register_event_listener(self._on_event)
            self._listening = True

    def _on_event(self, event: str, **_: Any) -> None:
        if event == _CACHE_HIT_EVENT:
            with self._lock:
                self.count += 1


CACHE_HITS = CacheHits()


# --- the profiler window -------------------------------------------------------------------------------


def parse_profile_steps(value: str, steps: int) -> tuple[int, int] | None:
    """`train.profile_steps` "START:END" as (START, END), steps counted as the logs count them
    (1 is the first step); None when empty. ConfigError outside 1..train.steps."""
    if not str(value).strip():
        return None
    start, sep, end = str(value).partition(":")
    if not (sep and start.strip().isdigit() and end.strip().isdigit()):
        raise ConfigError(f"train.profile_steps={value!r} is not START:END; give two step numbers, e.g. 10:12")
    window = int(start), int(end)
    if not 1 <= window[0] <= window[1] <= steps:
        raise ConfigError(
            f"train.profile_steps={value!r} is outside the run's steps; give 1 <= START <= END <= train.steps={steps}"
        )
    return window
