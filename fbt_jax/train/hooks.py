"""The training loop's hooks: metrics and progress, checkpoints, evaluation, the profiler window;
and preemption.

Each is one concern behind the small `loop.Hook` interface. `Trainer` lists them in the order
they must see a step: the logger (which refuses a non-finite loss), then the checkpoint hook
(so nothing diverged is ever saved), then evaluation.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from fbt_jax import checkpoint, contraction, run_services, workdir
from fbt_jax import progress as shown_progress
from fbt_jax.errors import Preempted
from fbt_jax.metrics import MetricsWriter
from fbt_jax.train.loop import Hook, StepEnd
from fbt_jax.train.step import TrainState


class MetricsLogger(Hook):
    """Writes each interval's metrics (metrics.jsonl, TensorBoard), drives the progress bar, and
    stops the run when the loss or the gradient norm is not finite.

    Logs every `log_every` steps, at the end, and at every step `also_at` names (the checkpoint
    steps: a save is preceded by this finiteness check, so a diverged state is never saved).
    """

    reads_metrics = True

    def __init__(
        self,
        writer: MetricsWriter,
        log_every: int,
        steps: int,
        start_step: int,
        progress: bool,
        saved_steps: Callable[[], list[int]],
        also_at: Callable[[StepEnd], bool] = lambda end: False,
    ):
        self.writer, self.log_every, self.saved_steps, self.also_at = writer, log_every, saved_steps, also_at
        self.bar = shown_progress.bar(steps, progress and jax.process_index() == 0, initial=start_step, unit="step")
        self.shown = ""
        self.contraction = ""  # the monitor's last reading, shown until the next one

    def wants(self, end: StepEnd) -> bool:
        return end.step % self.log_every == 0 or end.last or end.stopping or self.also_at(end)

    def on_step(self, end: StepEnd) -> None:
        self.bar.update(1)
        self.bar.set_postfix_str(f"K={end.num_passes}{self.shown}", refresh=False)

    def on_interval(self, end: StepEnd, record: dict[str, float], state: TrainState) -> None:
        self.writer.write(end.step, record)
        self.shown = f", loss={record['loss']:.3f}, tok/s={record['tokens_per_second']:,.0f}"
        if "mfu" in record:
            self.shown += f", MFU={100 * record['mfu']:.1f}%"
        if "contraction_rate" in record:
            self.contraction = f", contraction ×{record['contraction_rate']:.2f}" + (
                "" if record["contracting"] else " (NOT)"
            )
        self.shown += self.contraction
        if not (np.isfinite(record["loss"]) and np.isfinite(record["grad_norm"])):
            saved = self.saved_steps()
            raise FloatingPointError(
                f"loss {record['loss']}, gradient norm {record['grad_norm']} at step {end.step} (K={end.num_passes}); "
                f"nothing after step {saved[-1] if saved else 0} was saved. Lower optimizer.learning_rate "
                f"or set optimizer.grad_clip_norm, and rerun with --config.checkpoint.allow_resume_changes=True "
                f"(metrics in {self.writer.paths['train']})"
            )

    def close(self, failed: bool) -> None:
        shown_progress.close(self.bar, failed)


class Throughput(Hook):
    """Adds model FLOP/s and MFU to each logged interval (before the logger writes it).

    model_flops_per_second = Σ_steps train_step_flops(K) / interval seconds, with K each step's
    pass count (`flops.train_step_flops`: all K passes and the fusion, 3 × forward);
    mfu = model_flops_per_second / (peak FLOP/s per device × devices). `when` is the logger's
    `wants`, so both act on the same steps.
    """

    reads_metrics = True

    def __init__(
        self,
        flops_per_step: Callable[[int], float],
        tokens_per_step: int,
        peak_flops: float,
        when: Callable[[StepEnd], bool],
    ):
        self.flops_per_step, self.tokens_per_step, self.peak_flops = flops_per_step, tokens_per_step, peak_flops
        self.when = when
        self.flops, self.steps = 0.0, 0

    def wants(self, end: StepEnd) -> bool:
        return self.when(end)

    def on_step(self, end: StepEnd) -> None:
        self.flops += self.flops_per_step(end.num_passes)
        self.steps += 1

    def on_interval(self, end: StepEnd, record: dict[str, float], state: TrainState) -> None:
        # The interval's seconds, from the loop's own timing: steps × tokens per step / tokens per second.
        seconds = self.steps * self.tokens_per_step / record["tokens_per_second"]
        record["model_flops_per_second"] = self.flops / seconds
        if self.peak_flops > 0:
            record["mfu"] = record["model_flops_per_second"] / self.peak_flops
        self.flops, self.steps = 0.0, 0


class CheckpointSaver(Hook):
    """Saves every `checkpoint.every_steps`, at the last step, at the steps `also_at` names (those an
    evaluation that may fail acts on) and when a stop is requested (then leaves with `Preempted`); a
    failed asynchronous save surfaces at the next logging step."""

    def __init__(
        self,
        checkpointer: checkpoint.Checkpointer,
        config: Any,
        run_dir: workdir.RunDirectory,
        log: Any,
        also_at: Callable[[StepEnd], bool] | None = None,
    ):
        self.checkpointer, self.config, self.run_dir, self.log = checkpointer, config, run_dir, log
        self.also_at = also_at or (lambda end: False)

    def saves(self, end: StepEnd) -> bool:
        return self.checkpointer.due(end.step) or end.last or end.stopping or self.also_at(end)

    def wants(self, end: StepEnd) -> bool:
        return self.saves(end) or end.step % self.config.train.log_every == 0

    def on_interval(self, end: StepEnd, record: dict[str, float], state: TrainState) -> None:
        self.checkpointer.check_for_errors()
        if not self.saves(end):
            return
        self.checkpointer.save(end.step, state, self.config, force=True)
        self.run_dir.sync()
        if end.stopping:
            self.checkpointer.wait()
            raise Preempted(
                f"stopped at step {end.step} on request; saved {self.checkpointer.directory}/{end.step}; "
                "run the same command again to resume"
            )

    def settle(self) -> None:
        """Wait for the save in flight to land, so that no checkpoint thread starts or ends during
        what comes next (the profiler's stop); CheckpointError if it failed, as the next step's
        check would raise."""
        self.checkpointer.wait()

    def close(self, failed: bool) -> None:
        finish(self.checkpointer.wait, failed, self.log)  # a save in flight must land before exit
        self.checkpointer.close()


def trained_feedback(feedback_from: int | None, end: StepEnd) -> bool:
    """Whether the steps run so far include one that trained a feedback pass (K ≥ 2), given the
    first such step of the schedule (`PassSchedule.first_feedback_step`)."""
    return feedback_from is not None and end.step > feedback_from


class Evaluator(Hook):
    """Held-out evaluation every `eval.every_steps` and at the last step (not counted in tokens/s)."""

    counts_as_training = False

    def __init__(
        self,
        evaluate: Callable[[TrainState], dict[str, float]],
        writer: MetricsWriter,
        every_steps: int,
        log: Callable[[str], None],
        feedback_from: int | None,
    ):
        self.evaluate, self.writer, self.every_steps, self.log = evaluate, writer, every_steps, log
        self.feedback_from = feedback_from  # the first step that trains a feedback pass (None: none)
        self.results: dict[str, float] = {}

    def wants(self, end: StepEnd) -> bool:
        return end.last or bool(self.every_steps and end.step % self.every_steps == 0)

    def on_interval(self, end: StepEnd, record: dict[str, float], state: TrainState) -> None:
        if self.wants(end):
            self.results = self.evaluate(state)
            self.writer.write(end.step, self.results, stream="eval")
            warning = contraction.warning(self.results, end.step, trained_feedback(self.feedback_from, end))
            if warning:
                self.log(warning)


class ContractionMonitor(Hook):
    """Every `every_steps` and at the last step, adds the contraction monitor's metrics (measured
    on one fixed held-out batch) to the step's record, before the logger writes it to
    metrics.jsonl, TensorBoard and the progress bar; logs a warning when the map does not contract."""

    reads_metrics = True
    counts_as_training = False

    def __init__(
        self,
        measure: Callable[[TrainState], dict[str, float]],
        every_steps: int,
        log: Callable[[str], None],
        feedback_from: int | None,
    ):
        self.measure, self.every_steps, self.log = measure, every_steps, log
        self.feedback_from = feedback_from  # the first step that trains a feedback pass (None: none)

    def measures(self, end: StepEnd) -> bool:
        """Whether this step is measured (the logger writes at these steps too)."""
        return end.last or end.step % self.every_steps == 0

    def wants(self, end: StepEnd) -> bool:
        return self.measures(end)

    def on_interval(self, end: StepEnd, record: dict[str, float], state: TrainState) -> None:
        record |= self.measure(state)
        warning = contraction.warning(record, end.step, trained_feedback(self.feedback_from, end))
        if warning:
            self.log(warning)


class PreemptionWatcher:
    """Turns SIGTERM or SIGINT (single process) or JAX's preemption sync point (multi-host: every
    process stops at the same step) into a request to save and stop after the current step.

    A second SIGINT interrupts at once (KeyboardInterrupt), for when the save is not wanted.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, checkpointer: checkpoint.Checkpointer | None) -> None:
        self.checkpointer = checkpointer
        self.requested = False
        self._previous: dict[int, Any] = {}
        # With several processes JAX's preemption notifier owns SIGTERM (and makes every process
        # stop at the same step); a Python handler here would swallow it.
        if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._on_signal) for s in self.SIGNALS}

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.requested = True
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            print("\nstopping after this step and saving a checkpoint (Ctrl-C again to stop at once)", file=sys.stderr)

    def should_stop(self, step: int) -> bool:
        """Whether to save and stop after `step` (never without a checkpointer to save with)."""
        if self.checkpointer is None:
            return False
        if jax.process_count() > 1:
            return self.checkpointer.manager.reached_preemption(step)
        return self.requested

    def close(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)


def finish(cleanup: Callable[[], Any], failed: bool, log: Any) -> None:
    """Run a clean-up step; while another error is on its way out, report its failure instead of
    letting it replace that error."""
    try:
        cleanup()
    except Exception as err:
        if not failed:
            raise
        log(f"warning: {' '.join(str(err).split())}")


class Profiler(Hook):
    """Traces steps START..END with `jax.profiler` into `directory` (TensorBoard's profile plugin
    reads it; `perfetto_trace.json.gz` opens in ui.perfetto.dev). The trace starts once step
    START-1 has been dispatched and stops when step END's results are ready.

    The trace stops with no thread of the run starting or ending: `settle` first waits for what a
    step leaves running (the checkpointer's asynchronous save, whose threads end when it lands).
    jax's Python tracer (`trace_python`, off unless asked for) hooks every Python thread, and
    stopping it while threads come and go crashed runs (SIGSEGV in `stop_trace`, issue #58); the
    device and runtime events (each step's `PjitFunction`, its kernels) need no Python tracer.
    """

    def __init__(
        self,
        window: tuple[int, int],
        directory: str,
        start_step: int,
        log: Any,
        trace_python: bool = False,
        saver: CheckpointSaver | None = None,
    ):
        self.first, self.last = window
        self.directory, self.log, self.saver = directory, log, saver
        self.options = jax.profiler.ProfileOptions()
        self.options.python_tracer_level = 1 if trace_python else 0
        self.tracing = False
        if start_step >= self.last:
            log(f"profile: steps {self.first}–{self.last} ran before this run resumed at step {start_step}; not traced")
        elif start_step >= self.first - 1:
            self._start(start_step + 1)

    @classmethod
    def for_run(
        cls, train: Any, directory: str, start_step: int, log: Any, saver: CheckpointSaver | None
    ) -> Profiler | None:
        """The profiler of a run whose `train.profile_steps` names a window (`config.train`), else None."""
        window = run_services.parse_profile_steps(train.profile_steps, train.steps)
        return cls(window, directory, start_step, log, train.profile_python, saver) if window else None

    def _start(self, step: int) -> None:
        os.makedirs(self.directory, exist_ok=True)
        jax.profiler.start_trace(self.directory, create_perfetto_trace=True, profiler_options=self.options)
        self.tracing = True
        self.log(f"profile: tracing steps {step}–{self.last} into {self.directory}")

    def on_step(self, end: StepEnd) -> None:
        if end.step == self.first - 1 and not self.tracing:
            self._start(self.first)

    def wants(self, end: StepEnd) -> bool:
        return self.tracing and end.step == self.last

    def on_interval(self, end: StepEnd, record: dict[str, float], state: TrainState) -> None:
        jax.block_until_ready(state)
        self._stop()

    def _stop(self) -> None:
        if self.saver:
            self.saver.settle()
        jax.profiler.stop_trace()
        self.tracing = False
        self.log(f"profile: trace written to {self.directory} (tensorboard --logdir {self.directory}, or Perfetto)")

    def close(self, failed: bool) -> None:
        if self.tracing:  # the run stopped inside the window: keep what was traced
            finish(self._stop, failed, self.log)
