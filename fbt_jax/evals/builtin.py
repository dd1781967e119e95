"""Generative versions of the built-in tasks, so that an evaluation runs with no files at all.

A built-in task labels every input (the word problem's running state, the modular running sum,
the token `delay` back); its generative version asks for the label of the last input, "prompt →
final state": the first quarter of a validation sequence is the prompt (prefilled in the mode),
the rest is fed token by token in the mode, and the one generated token is the answer. This is the
protocol of fbt-eval's per-position accuracies (`evaluate.mode_metrics`), so the generative
accuracy of a mode is that mode's accuracy at the last position.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fbt_jax.data.plan import plan_data
from fbt_jax.data.tasks import TASKS, prompt_length
from fbt_jax.errors import ConfigError
from fbt_jax.evals.spec import Problem, TaskSpec

DEFAULT_PROBLEMS = 256


def is_builtin(name: str) -> bool:
    return name in TASKS


def builtin_spec(name: str) -> TaskSpec:
    """One generated token, compared exactly with the final label."""
    return TaskSpec(name=name, compare="exact", extract={"kind": "text"}, max_new_tokens=1, source=f"built-in {name}")


def builtin_problems(name: str, config: Any, num_problems: int = 0) -> list[Problem]:
    """The first `num_problems` validation sequences of the run's own task as problems."""
    if config.data.source != "task" or config.data.task != name:
        trained = config.data.task if config.data.source == "task" else f"{config.data.source} data"
        raise ConfigError(
            f"built-in task {name} needs a checkpoint trained on it; this run trained on {trained} "
            f"(a run on a task is evaluated on its own task, a text run on spec files)"
        )
    task = plan_data(config, read_data=False).task
    rows = np.arange(num_problems or DEFAULT_PROBLEMS)
    batch = task.examples("validation", rows)
    prompt = prompt_length(task.seq_len)
    problems = []
    for i, (inputs, targets) in enumerate(zip(batch["inputs"], batch["targets"])):
        ids = [int(x) for x in inputs]
        problems.append(
            Problem(
                id=f"validation-{i}",
                prompt=" ".join(map(str, ids)),
                answer=str(int(targets[-1])),
                prompt_ids=tuple(ids[:prompt]),
                forced=tuple(ids[prompt:]),
            )
        )
    return problems
