"""lm-evaluation-harness tasks during training (off unless `eval.harness_tasks` names some): every
`eval.harness_every_steps` and at the last step, the current parameters are evaluated in each of
`eval.harness_modes` through the `fbt` backend (`evals/harness.py`), and each task's metrics are
added to that step's record as `harness/<task>/<metric>/<mode>`, so that they reach metrics.jsonl,
TensorBoard and W&B with the step's other figures (the way levanter runs the harness in training).

The tasks are checked when the run starts (known to the harness, data on this machine), before any
step. Soft and fused need a trained fusion: before the first feedback pass of the schedule they
are skipped, with a line saying so once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flax import nnx

from fbt_jax.errors import ConfigError
from fbt_jax.train.loop import Hook, StepEnd
from fbt_jax.train.step import TrainState


class HarnessEvaluator(Hook):
    """Adds the harness's metrics to the step's record (before the logger writes it)."""

    counts_as_training = False

    def __init__(self, config: Any, settings: Any, graphdef: Any, log: Callable[[str], None]):
        import jax

        from fbt_jax.data.tokenizers import load_tokenizer
        from fbt_jax.evals.harness_run import load_tasks

        if jax.process_count() > 1:
            raise ConfigError("--config.eval.harness_tasks runs in one process; evaluate the checkpoints with fbt-eval")
        self.config, self.settings, self.graphdef, self.log = config, settings, graphdef, log
        self.every_steps = int(config.eval.harness_every_steps)
        self.manager = load_tasks(settings)  # unknown tasks and missing data fail here, before any step
        self.tokenizer = load_tokenizer(config.data.tokenizer)
        self.skipped: set[str] = set()
        self.generator = None  # this host's copy of the parameters, and the programs compiled for them

    def measures(self, end: StepEnd) -> bool:
        """Whether this step is evaluated (the logger writes at these steps too)."""
        return end.last or bool(self.every_steps and end.step % self.every_steps == 0)

    def wants(self, end: StepEnd) -> bool:
        return self.measures(end)

    def on_interval(self, end: StepEnd, record: dict[str, float], state: TrainState) -> None:
        record |= self.evaluate(state, end.step)

    def evaluate(self, state: TrainState, step: int) -> dict[str, float]:
        import lm_eval

        from fbt_jax.evals.generation import Generator
        from fbt_jax.evals.harness import FBTLM, Loaded
        from fbt_jax.evals.harness_run import metric_names

        model = nnx.merge(self.graphdef, state.params)
        if self.generator is None:
            self.generator = Generator(model)
        else:  # new parameters, the programs compiled at the last evaluation
            self.generator.load(model)
        loaded = Loaded(model, self.config, step, self.tokenizer, self.generator)
        s, out = self.settings, {}
        for mode in s.modes:
            try:
                lm = FBTLM(mode=mode, batch_size=s.batch_size, prefill_passes=s.prefill_passes, loaded=loaded,
                           progress=False, log=self.log)  # fmt: skip
            except ConfigError:  # the fusion has not trained yet: soft and fused read nothing
                if mode not in self.skipped:
                    self.skipped.add(mode)
                    self.log(f"harness: {mode} mode waits for the first feedback pass (step {step}: none trained yet)")
                continue
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
