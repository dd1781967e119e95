"""Where a run's wall time went, across every attempt (start, restart after a preemption or a
kill) of the run.

Each attempt accounts its seconds by category, from the moment its process started:

    startup     imports, config, data sources, building the programs' layout (the rest of start-up)
    compile     compiling (or loading from the compilation cache) every program
    restore     restoring the checkpoint it resumes from, or initialising the state
    data_wait   waiting for the next batch (loading and sending it to the devices)
    steps       training steps that move the run forward: the productive time
    recomputed  training steps an earlier attempt had already run (lost with an unsaved state)
    eval        held-out evaluation and the contraction monitor
    checkpoint  blocking on checkpoint saves (the asynchronous part runs beside the steps)
    other       the rest: hooks' bookkeeping, closing down

Step time is measured around the loop (its wall time less the data, evaluation and checkpoint time
inside it); steps recomputed get their share of it pro rata. `goodput.jsonl` in the workdir holds
one line per attempt, rewritten as the attempt goes (at logging steps, at most every few seconds,
at every save and at the end), so an attempt that is killed keeps its time up to its last line;
goodput = Σ steps / Σ wall over all attempts.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax

from fbt_jax.train.loop import Hook, StepEnd
from fbt_jax.train.step import TrainState

CATEGORIES = ("startup", "compile", "restore", "data_wait", "steps", "recomputed", "eval", "checkpoint", "other")
LEDGER_NAME = "goodput.jsonl"
WRITE_EVERY_SECONDS = 5.0


def process_start_time() -> float:
    """When this process started (time.time() scale): from /proc where there is one, so that the
    interpreter's own start-up and the imports count; else when this module was imported."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: start time after boot
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return _IMPORTED


_IMPORTED = time.time()


class Ledger:
    """This attempt's seconds by category, and the record of the run's earlier attempts."""

    def __init__(self, directory: str, start_step: int, started: float | None = None):
        self.path = os.path.join(directory, LEDGER_NAME)
        self.started = process_start_time() if started is None else started
        self.start_step, self.step = start_step, start_step
        self.seconds = dict.fromkeys(CATEGORIES, 0.0)
        self.earlier = read_ledger(self.path)
        # The furthest step an earlier attempt ran: steps up to it are run again by this one.
        self.furthest = max([start_step, *(a["end_step"] for a in self.earlier)])
        self._written = 0.0
        self.loop_started: float | None = None  # perf_counter() when the training loop began

    def add(self, category: str, seconds: float) -> None:
        self.seconds[category] += seconds

    @contextlib.contextmanager
    def timing(self, category: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(category, time.perf_counter() - start)

    def timed(self, call: Callable, category: str) -> Callable:
        """`call`, with the seconds spent in it added to `category`."""

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self.timing(category):
                return call(*args, **kwargs)

        return wrapper

    def batches(self, batches: Iterator[Any]) -> Iterator[Any]:
        """`batches`, with the wait for each one added to data_wait."""
        while True:
            with self.timing("data_wait"):
                batch = next(batches, None)
            if batch is None:
                return
            yield batch

    def start_loop(self) -> None:
        """The loop begins: everything since the process started that no category claimed yet is
        start-up."""
        self.add("startup", time.time() - self.started - sum(self.seconds.values()))
        self.loop_started = time.perf_counter()

    def close_loop(self, loop_seconds: float | None = None) -> None:
        """Account the loop's own time as step time: all but the data, eval and checkpoint seconds
        inside it (`loop_seconds`, by default since `start_loop`), split into new and recomputed
        steps."""
        if loop_seconds is None:
            loop_seconds = time.perf_counter() - self.loop_started if self.loop_started is not None else 0.0
        inside = self.seconds["data_wait"] + self.seconds["eval"] + self.seconds["checkpoint"]
        step_seconds = max(loop_seconds - inside, 0.0)
        ran = self.step - self.start_step
        again = max(min(self.furthest, self.step) - self.start_step, 0)
        self.seconds["recomputed"] = step_seconds * again / ran if ran else 0.0
        self.seconds["steps"] = step_seconds - self.seconds["recomputed"]

    def attempt(self) -> dict[str, Any]:
        """This attempt so far: its wall time, with `other` the part no category claims."""
        wall = time.time() - self.started
        seconds = dict(self.seconds)
        seconds["other"] = max(wall - sum(v for k, v in seconds.items() if k != "other"), 0.0)
        return {
            "attempt": len(self.earlier) + 1,
            "start_step": self.start_step,
            "end_step": self.step,
            "wall_seconds": wall,
            "seconds": seconds,
        }

    def write(self, force: bool = False) -> None:
        """Rewrite the ledger with this attempt's current line (process 0; at most every few seconds
        unless `force`)."""
        if jax.process_index() != 0 or (not force and time.perf_counter() - self._written < WRITE_EVERY_SECONDS):
            return
        lines = [*self.earlier, self.attempt()]
        tmp = f"{self.path}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(line) + "\n" for line in lines)
        os.replace(tmp, self.path)
        self._written = time.perf_counter()

    def summary(self) -> dict[str, Any]:
        """The run over all its attempts, this one included: seconds by category, wall time and
        goodput (productive step seconds / wall seconds)."""
        attempts = [*self.earlier, self.attempt()]
        seconds = {c: sum(a["seconds"].get(c, 0.0) for a in attempts) for c in CATEGORIES}
        wall = sum(a["wall_seconds"] for a in attempts)
        return {
            "attempts": len(attempts),
            "wall_seconds": wall,
            "seconds": seconds,
            "goodput": seconds["steps"] / wall if wall > 0 else 0.0,
            "this_attempt": attempts[-1],
        }


def read_ledger(path: str) -> list[dict[str, Any]]:
    """The attempts a ledger records (none when it does not exist)."""
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


class LedgerWriter(Hook):
    """Keeps the ledger current while the run goes: at logging steps (at most every few seconds),
    at every step that saves a checkpoint, and when the run stops."""

    def __init__(self, ledger: Ledger, when: Callable[[StepEnd], bool], saves: Callable[[StepEnd], bool]):
        self.ledger, self.when, self.saves = ledger, when, saves

    def on_step(self, end: StepEnd) -> None:
        self.ledger.step = end.step

    def wants(self, end: StepEnd) -> bool:
        return self.when(end) or self.saves(end)

    def on_interval(self, end: StepEnd, record: dict[str, float], state: TrainState) -> None:
        self.ledger.close_loop()
        self.ledger.write(force=self.saves(end) or end.last or end.stopping)


class Timed(Hook):
    """Another hook, with the seconds spent in it (acting and closing) added to `category`."""

    def __init__(self, hook: Hook, ledger: Ledger, category: str):
        self.hook, self.ledger, self.category = hook, ledger, category
        self.reads_metrics, self.counts_as_training = hook.reads_metrics, hook.counts_as_training

    def wants(self, end: StepEnd) -> bool:
        return self.hook.wants(end)

    def on_step(self, end: StepEnd) -> None:
        self.hook.on_step(end)

    def on_interval(self, end: StepEnd, record: dict[str, float], state: TrainState) -> None:
        with self.ledger.timing(self.category):
            self.hook.on_interval(end, record, state)

    def close(self, failed: bool) -> None:
        with self.ledger.timing(self.category):
            self.hook.close(failed)


def describe(summary: dict[str, Any]) -> str:
    """The time lines of a run's final report."""
    this = summary["this_attempt"]
    parts = ", ".join(f"{c.replace('_', ' ')} {this['seconds'][c]:.1f}" for c in CATEGORIES)
    return (
        f"wall time {this['wall_seconds']:.1f}s this attempt ({parts}); goodput {100 * summary['goodput']:.1f}% "
        f"over {summary['attempts']} attempt(s), {summary['wall_seconds']:.1f}s in all"
    )


def flat(summary: dict[str, Any]) -> dict[str, float]:
    """A run's time summary as flat scalars (`goodput`, `wall_seconds`, `seconds/<category>`), for
    TensorBoard and other metric sinks."""
    return {
        "goodput": summary["goodput"],
        "attempts": float(summary["attempts"]),
        "wall_seconds": summary["wall_seconds"],
        **{f"seconds/{c}": v for c, v in summary["seconds"].items()},
    }
