"""The training loop: it orders the steps and calls hooks, nothing else.

Each step the loop picks K = schedule.num_passes(step) (a pure function of (seed, step)), feeds
that step's batch to the compiled program for K, and tells every hook. Logging, evaluation,
checkpoints and preemption are hooks (`hooks.py`); a new concern is a new hook, not an edit here.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from fbt_jax import distributed
from fbt_jax.schedule import PassSchedule
from fbt_jax.train.step import TrainState


@dataclasses.dataclass(frozen=True)
class StepEnd:
    """Where the run is after a step."""

    step: int  # steps completed, i.e. the state's step counter
    num_passes: int  # K of the step that just ran
    last: bool  # the run's final step
    stopping: bool  # a stop was requested (SIGTERM, Ctrl-C, preemption): save and leave after it


class Hook:
    """A concern that acts between steps. Subclasses override what they need.

    After every step the loop calls `on_step` (cheap: no device transfer), then `on_interval` of
    the hooks that `want` the step, in list order: an earlier hook sees the step first (the logger
    checks that the loss is finite before the checkpoint hook saves). When one of them
    `reads_metrics`, the loop first fetches the metrics of the steps since the last such step in
    one transfer and averages them (`interval_metrics`, plus tokens/s); the others get `{}`.
    """

    reads_metrics = False  # True: on_interval needs the interval's metrics
    counts_as_training = True  # False: time spent in on_interval is left out of tokens/s (eval)

    def wants(self, end: StepEnd) -> bool:
        return False

    def on_step(self, end: StepEnd) -> None:
        pass

    def on_interval(self, end: StepEnd, record: dict[str, float], state: TrainState) -> None:
        pass

    def close(self, failed: bool) -> None:
        """Called once when the loop ends; `failed` while an error is on its way out."""


def run_steps(
    state: TrainState,
    programs: dict[int, Callable],
    schedule: PassSchedule,
    batches: Iterator[Any],
    start_step: int,
    steps: int,
    tokens_per_step: int,
    hooks: list[Hook],
    stop_requested: Callable[[int], bool],
) -> TrainState:
    """Run steps [start_step, steps) and return the final state. `batches` yields each step's
    global batch in order; `stop_requested(step)` is asked after every step."""
    previous_k = None
    pending: list[tuple[int, dict[str, jax.Array]]] = []  # (K, device metrics) since the last interval
    interval_start = time.perf_counter()
    for step in range(start_step, steps):
        k = schedule.num_passes(step)
        if k != previous_k:
            distributed.check_step_agreement(step, k)  # every process must run the same program
            previous_k = k
        state, metrics = programs[k](state, next(batches))
        pending.append((k, metrics))
        end = StepEnd(step=step + 1, num_passes=k, last=step + 1 == steps, stopping=stop_requested(step + 1))
        for hook in hooks:
            hook.on_step(end)
        acting = [hook for hook in hooks if hook.wants(end)]
        record: dict[str, float] = {}
        if any(hook.reads_metrics for hook in acting):
            record = interval_metrics(jax.device_get(pending))  # one transfer per interval
            record["tokens_per_second"] = len(pending) * tokens_per_step / (time.perf_counter() - interval_start)
            pending = []
            interval_start = time.perf_counter()
        for hook in acting:
            hook_start = time.perf_counter()
            hook.on_interval(end, record, state)
            if not hook.counts_as_training:
                interval_start += time.perf_counter() - hook_start
    return state


def interval_metrics(pending: list[tuple[int, dict[str, Any]]]) -> dict[str, float]:
    """One metrics line for a logging interval of (K, metrics) per step.

    Values are means over the interval's steps; a per-pass loss `loss_pass_k` averages the steps
    that ran at least k passes. `num_passes` and `learning_rate` are those of the last step, and
    `mean_num_passes` is the interval's mean K.
    """
    out: dict[str, float] = {}
    for key in sorted({key for _, metrics in pending for key in metrics}):
        values = [float(metrics[key]) for _, metrics in pending if key in metrics]
        out[key] = values[-1] if key == "learning_rate" else float(np.mean(values))
    out["num_passes"] = pending[-1][0]
    out["mean_num_passes"] = float(np.mean([k for k, _ in pending]))
    return out
