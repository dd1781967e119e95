"""What an lm-evaluation-harness evaluation will ask of a model, checked before anything compiles.

One check serves `fbt-eval --harness` and the training hook (`eval.harness_*`), so both refuse the
same things, in one line each, before the first compile and before anything is written:

- the settings themselves (modes, batch size, limits), whether from flags or from a config;
- lm-evaluation-harness installed (an optional extra);
- every task known to the harness (its own, or a YAML under the include path) with its data on
  this machine (nothing is downloaded: the Hugging Face libraries run offline);
- what the backend would refuse about a task for this model: a `generate_until` task whose
  `max_gen_toks` leaves no room for a prompt in the model's context, a mode the run cannot decode.

Building each task's requests (every document's context and continuation) is left to the
evaluation itself: it is the expensive part, and what it refuses is named there in one line.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any

from fbt_jax import decode
from fbt_jax.errors import ConfigError

INSTALL = "pip install 'fbt-jax[lm-eval]'"
DEFAULT_NEW_TOKENS = 256  # the harness's own default max_gen_toks for generate_until


@dataclasses.dataclass(frozen=True)
class HarnessSettings:
    tasks: tuple[str, ...]
    modes: tuple[str, ...]
    include: str = ""  # a directory of task YAMLs (the harness's --include_path)
    num_fewshot: int | None = None  # None: each task's own
    limit: int = 0  # first N documents per task (0: all)
    batch_size: int = 32
    prefill_passes: int = 2
    seed: int = 0
    chat: bool = False  # the run's chat template applied (fewshot examples as turns): a tuned run

    def check(self, flags: dict[str, str]) -> None:
        """One-line errors for settings that cannot work; `flags` names each field as its user set it
        (`--modes`, or `--config.eval.harness_modes`)."""
        if not self.tasks:
            raise ConfigError(f"{flags['tasks']} names no task; give the harness's task names, comma-separated")
        if not self.modes or any(m not in decode.MODES for m in self.modes):
            raise ConfigError(f"{flags['modes']}={','.join(self.modes)!r}: use some of {','.join(decode.MODES)}")
        if self.batch_size < 1:
            raise ConfigError(f"{flags['batch_size']}={self.batch_size} must be at least 1 (rows per batch)")
        if (self.num_fewshot is not None and self.num_fewshot < 0) or self.limit < 0:
            raise ConfigError(f"{flags['num_fewshot']} and {flags['limit']} must be >= 0")
        if self.prefill_passes < 1:
            name = flags.get("prefill_passes", "the fused prefill's passes")  # no config field: always 2 there
            raise ConfigError(f"{name}={self.prefill_passes} must be at least 1")
        if self.include and not os.path.isdir(self.include):
            raise ConfigError(f"{flags['include']}={self.include!r} is not a directory of task YAMLs")


CONFIG_FLAGS = {field: f"--config.eval.harness_{field}" for field in ("tasks", "modes", "batch_size", "limit",
                                                                       "num_fewshot", "include")}  # fmt: skip


def require_harness(what: str) -> None:
    """A one-line error where lm-evaluation-harness (an optional extra) is not installed."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise ConfigError(f"{what} needs lm-evaluation-harness, which is not installed here: {INSTALL}") from None


def settings_from_config(config: Any) -> HarnessSettings | None:
    """The training hook's settings from `config.eval` (None where it is off), checked in one line each."""
    e = config.eval
    if not e.harness_tasks.strip():
        return None
    require_harness("--config.eval.harness_tasks")
    if e.harness_every_steps < 0:
        raise ConfigError("--config.eval.harness_every_steps must be >= 0 (0: at the last step only)")
    if config.data.source == "task":
        raise ConfigError("--config.eval.harness_tasks needs a text run (data.source=text): the harness scores text")
    settings = HarnessSettings(
        tasks=names(e.harness_tasks),
        modes=names(e.harness_modes),
        include=e.harness_include,
        num_fewshot=None if e.harness_num_fewshot < 0 else int(e.harness_num_fewshot),
        limit=int(e.harness_limit),
        batch_size=int(e.harness_batch_size),
    )
    settings.check(CONFIG_FLAGS)
    return settings


def names(text: str) -> tuple[str, ...]:
    """A comma-separated list, blanks and repeats dropped."""
    return tuple(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))


def offline() -> None:
    """Nothing is downloaded: the dataset and hub libraries read their local caches and files only.
    Their progress bars are drawn on a terminal only, as ours are (`progress.py`)."""
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ[name] = "1"
    if not sys.stderr.isatty():
        import datasets

        datasets.disable_progress_bars()


def load_tasks(settings: HarnessSettings) -> tuple[Any, dict[str, Any]]:
    """(the harness's task manager, {leaf task name: task}), once every task is known and its data
    loads from this machine; a group's tasks are its leaves."""
    offline()
    import logging

    logging.getLogger("lm_eval").setLevel(logging.ERROR)  # its notes on defaults; errors still show
    from lm_eval.tasks import TaskManager

    manager = None
    if settings.include:  # tasks all under --harness-include: the harness's own ~200 folders need no index
        manager = TaskManager(include_path=settings.include, include_defaults=False)
        manager = manager if set(settings.tasks) <= set(manager.all_tasks) else None
    manager = manager or TaskManager(include_path=settings.include or None)
    leaves: dict[str, Any] = {}
    for name in settings.tasks:
        if name not in manager.all_tasks:
            where = f" or under {settings.include}" if settings.include else ""
            raise ConfigError(
                f"task {name!r} is not one of the harness's tasks{where}; `lm-eval ls tasks` lists them, and a "
                "directory of task YAMLs is given with --harness-include (--config.eval.harness_include)"
            )
        try:
            leaves |= manager.load([name])["tasks"]
        except Exception as err:  # noqa: BLE001 - datasets' errors vary by source; each becomes one line
            raise ConfigError(f"task {name!r}: {missing_data(err)}") from None
    return manager, leaves


def check_tasks(tasks: dict[str, Any], context: int, where: str) -> None:
    """Refuse a generative task whose `max_gen_toks` leaves no room for a prompt in `context` tokens
    (the backend would refuse its first request); `where` names the context's setting."""
    for name, task in tasks.items():
        if getattr(task.config, "output_type", "") != "generate_until":
            continue
        settings = task.config.generation_kwargs or {}
        new = int(settings.get("max_gen_toks", DEFAULT_NEW_TOKENS))
        if new >= context:
            given = "its max_gen_toks" if "max_gen_toks" in settings else "the harness's default max_gen_toks"
            raise ConfigError(
                f"task {name!r} generates up to {new} tokens ({given}), which leaves no room for a prompt in the "
                f"model's context of {context} tokens ({where}); drop the task, give it a smaller "
                "generation_kwargs.max_gen_toks in a task YAML of your own (--harness-include), or use a longer context"
            )


def missing_data(err: BaseException) -> str:
    """What a task's data loader said, as the reason its data is not on this machine."""
    text = " ".join(str(err).split()) or type(err).__name__
    if isinstance(err, FileNotFoundError) or "Unable to find" in text or "doesn't exist" in text:
        return (
            f"its data is not on this machine ({text[:300]}); relative data_files are read from the working "
            f"directory ({os.getcwd()}): give absolute paths, or run from where they are"
        )
    return (
        f"its data did not load offline ({text[:300]}); point the task at local files (dataset_path: json with "
        "data_files) or fill the Hugging Face datasets cache once on a machine with a network (docs/evaluation.md)"
    )
