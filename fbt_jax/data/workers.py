"""The process pool that tokenises a preparation's units in parallel.

Workers are spawned (the tokenizer's threads do not survive a fork), share the cores between
them, and die with their parent, so a killed preparation leaves nothing writing behind it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from multiprocessing.pool import Pool


def _worker_init(threads: int) -> None:
    """A worker process: its share of the cores for the tokenizer's own threads; it dies with its parent."""
    from fbt_jax.data.tokenizers import limit_encoder_threads

    limit_encoder_threads(threads)
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (Linux)
    except (OSError, AttributeError):
        pass  # not Linux: workers end when their queue closes instead


@contextlib.contextmanager
def sigterm_held() -> Iterator[None]:
    """Hold a SIGTERM that arrives inside the block and deliver it after it (main thread only).

    Masking the signal is not enough: another thread (tqdm's monitor, the tokenizer's) takes it
    and Python still runs the handler in the main thread, in the middle of the block."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        if held:
            os.kill(os.getpid(), signal.SIGTERM)  # now handled as the process asked


def start_pool(processes: int, workers: int) -> Pool:
    """`processes` spawned workers, each with its share of this host's cores among `workers`.

    A stop that came while a worker was starting left it without its start-up data (a
    traceback from the child after the one-line error): the stop waits until all have started."""
    import multiprocessing

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    context = multiprocessing.get_context("spawn")
    with sigterm_held():
        return context.Pool(processes, _worker_init, (max(1, cores // workers),))
