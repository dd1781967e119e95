"""lm-evaluation-harness tasks during training (off unless `eval.harness_tasks` names some): every
`eval.harness_every_steps` and at the last step, the current parameters are evaluated in each of
`eval.harness_modes` through the `fbt` backend (`evals/harness.py`), and each task's metrics are
written to eval.jsonl as `harness/<task>/<metric>/<mode>` (TensorBoard and W&B get them under
`eval/`), with `harness/seconds`, the time the evaluation took.

An evaluation never costs what training made: the step it evaluates is checkpointed first (the
checkpoint hook saves at these steps too, and the save is waited for), and its metrics line is
written. What would fail later is refused when the run starts, before anything compiles (`check`:
the tasks, their data, context room for their generations, modes the schedule trains). An
evaluation that still fails (a data file removed meanwhile) ends the run with `EvaluationFailed`
(exit 7, one line), and a SIGTERM during one stops it after the current batch (exit 75). Either
way the same command run again resumes at that checkpoint, evaluates it, and trains on (after the
last step: evaluates only). Soft and fused need a trained fusion: before the first feedback pass of
the schedule they are skipped, with a line saying so once.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from flax import nnx

from fbt_jax.data.plan import DataPlan
from fbt_jax.errors import ConfigError, EvaluationFailed, Preempted, describe
from fbt_jax.evals.harness_tasks import HarnessSettings
from fbt_jax.metrics import read_log
from fbt_jax.train.loop import Hook, StepEnd
from fbt_jax.train.step import TrainState

DONE_KEY = "harness/seconds"  # in every record the hook writes: the evaluation at that step is done


@dataclasses.dataclass(frozen=True)
class Checked:
    """The hook's settings and the harness's task manager, once the tasks passed `check`."""

    settings: HarnessSettings
    manager: Any
    every_steps: int  # eval.harness_every_steps (0: the last step only)
    data: DataPlan  # the run's data plan: its context length and tokenizer


def check(config: Any, data: DataPlan) -> Checked | None:
    """What the harness would refuse about this run's tasks, refused now (None where it is off)."""
    import jax

    from fbt_jax.evals import harness_tasks, runner

    settings = harness_tasks.settings_from_config(config)
    if settings is None:
        return None
    if jax.process_count() > 1:
        raise ConfigError("--config.eval.harness_tasks runs in one process; evaluate the checkpoints with fbt-eval")
    manager, tasks = harness_tasks.load_tasks(settings)
    harness_tasks.check_tasks(tasks, data.seq_len, "data.seq_len")
    last = int(config.train.stop_at_step or config.train.steps)
    try:
        runner.check_modes(config, last, settings.modes)
    except ConfigError:
        raise ConfigError(
            f"--config.eval.harness_modes={','.join(settings.modes)} asks for soft or fused, but passes.schedule "
            f"draws no feedback pass (K >= 2) by step {last}, so the fusion never trains; use "
            "--config.eval.harness_modes=standard, or a schedule with feedback passes"
        ) from None
    return Checked(settings, manager, int(config.eval.harness_every_steps), data)


def measures(checked: Checked, end: StepEnd) -> bool:
    """Whether the hook evaluates after this step (the checkpoint hook saves it first)."""
    return end.last or bool(checked.every_steps and end.step % checked.every_steps == 0)


class HarnessEvaluator(Hook):
    """Evaluates after the step's checkpoint has landed, and writes its own eval.jsonl record."""

    counts_as_training = False

    def __init__(
        self,
        config: Any,
        checked: Checked,
        graphdef: Any,
        writer: Any,
        saver: Any,
        stop_requested: Callable[[], bool],
        log: Callable[[str], None],
    ):
        self.config, self.checked, self.settings, self.manager = config, checked, checked.settings, checked.manager
        self.graphdef, self.writer, self.saver, self.log = graphdef, writer, saver, log
        self.stop_requested = stop_requested
        self.tokenizer = checked.data.tokenizer
        self.skipped: set[str] = set()
        self.generator = None  # this host's copy of the parameters, and the programs compiled for them

    def wants(self, end: StepEnd) -> bool:
        return measures(self.checked, end)

    def on_interval(self, end: StepEnd, record: dict[str, float], state: TrainState) -> None:
        if self.saver is not None:  # the step's checkpoint is on disk before anything here can fail or be killed
            self.saver.checkpointer.wait()
        self.evaluate_and_write(state, end.step)

    def catch_up(self, state: TrainState, step: int, steps: int, eval_log: str) -> None:
        """A run resumed at a step the hook measures, whose evaluation did not finish (it failed, or
        was stopped): evaluate it now, before any further step."""
        if measures(self.checked, StepEnd(step, 0, step >= steps, False)) and not done_at(eval_log, step):
            self.log(f"harness: step {step} was saved, but its evaluation did not finish before the run stopped")
            self.evaluate_and_write(state, step)

    def evaluate_and_write(self, state: TrainState, step: int) -> None:
        self.log(f"harness: evaluating step {step} ({','.join(self.settings.tasks)}; {','.join(self.settings.modes)})")
        start = time.perf_counter()
        try:
            out = self.evaluate(state, step)
        except (Preempted, KeyboardInterrupt):
            raise
        except Exception as err:  # noqa: BLE001 - whatever failed, the run's checkpoint stands; one line
            saved = (
                f"checkpoint {step} is saved: fix the cause and run the same command again; it evaluates step {step}, "
                "then trains the steps left"
                if self.saver is not None
                else "nothing was saved (checkpoint.every_steps=0)"
            )
            raise EvaluationFailed(
                f"the lm-evaluation-harness evaluation at step {step} failed ({describe(err, 400)}); {saved}"
            ) from err
        self.writer.write(step, out | {DONE_KEY: time.perf_counter() - start}, stream="eval")

    def interrupt(self) -> None:
        if self.stop_requested():
            raise Preempted(
                "stopped on request during the lm-evaluation-harness evaluation; its step's checkpoint is saved: "
                "run the same command again, which evaluates that step, then trains the steps left"
            )

    def evaluate(self, state: TrainState, step: int) -> dict[str, float]:
        import lm_eval

        from fbt_jax.evals import runner
        from fbt_jax.evals.generation import Generator
        from fbt_jax.evals.harness import FBTLM, Loaded
        from fbt_jax.evals.harness_run import metric_names
        from fbt_jax.progress import library_bars_on_terminal_only

        model = nnx.merge(self.graphdef, state.params)
        if self.generator is None:
            self.generator = Generator(model)
        else:  # new parameters, the programs compiled at the last evaluation
            self.generator.load(model)
        loaded = Loaded(model, self.config, step, self.tokenizer, self.generator)
        s, out = self.settings, {}
        for mode in s.modes:
            try:
                runner.check_modes(self.config, step, (mode,))
            except ConfigError:  # the fusion has not trained yet: soft and fused read nothing
                if mode not in self.skipped:
                    self.skipped.add(mode)
                    self.log(f"harness: {mode} mode waits for the first feedback pass (step {step}: none trained yet)")
                continue
            lm = FBTLM(mode=mode, batch_size=s.batch_size, prefill_passes=s.prefill_passes, loaded=loaded,
                       progress=False, log=self.log, interrupt=self.interrupt)  # fmt: skip
            with library_bars_on_terminal_only():
                results = lm_eval.simple_evaluate(
                    model=lm, tasks=list(s.tasks), task_manager=self.manager, num_fewshot=s.num_fewshot,
                    limit=s.limit or None, log_samples=False, bootstrap_iters=0, random_seed=s.seed,
                    numpy_random_seed=s.seed, fewshot_random_seed=s.seed,
                )  # fmt: skip
            for task, row in results["results"].items():
                for metric in metric_names(row):
                    value = row.get(f"{metric},none")
                    if isinstance(value, (int, float)):
                        out[f"harness/{task}/{metric}/{mode}"] = float(value)
        return out


def done_at(eval_log: str, step: int) -> bool:
    """Whether eval.jsonl holds the hook's record for `step`."""
    return any(DONE_KEY in r and r["step"] == step for r in read_log(eval_log))
