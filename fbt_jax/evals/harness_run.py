"""`fbt-eval --harness`: lm-evaluation-harness tasks on one checkpoint in each decoding mode, the
paper's table (docs/evaluation.md).

The tasks are checked before the checkpoint is read: each must be known to the harness (its own, or
a YAML under --harness-include) and read data on this machine (nothing is downloaded: the Hugging
Face libraries run offline). Then, per mode, the harness runs the tasks through the `fbt` backend
(`harness.py`); every model response goes to a per-mode cache as its batch finishes, so a killed
evaluation started again with the same flags continues and ends with the numbers of an
uninterrupted one. Written: `harness.json` (per task and mode, each metric and its standard error,
and each mode's paired difference from standard on the same documents with a 95% bootstrap
interval), `harness.md` (the table), `eval.json` (the settings, which a later run must match).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import Any

from fbt_jax.data import store
from fbt_jax.errors import ConfigError
from fbt_jax.evals import runner, scoring

RESULTS, TABLE = "harness.json", "harness.md"
RESAMPLES = 1000  # bootstrap draws of the paired differences


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


def settings_from_config(config: Any) -> HarnessSettings | None:
    """The hook's settings from `config.eval` (None where it is off), checked in one line each."""
    e = config.eval
    tasks = tuple(t.strip() for t in e.harness_tasks.split(",") if t.strip())
    if not tasks:
        return None
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise ConfigError(
            "--config.eval.harness_tasks needs lm-evaluation-harness: pip install 'fbt-jax[lm-eval]'"
        ) from None
    from fbt_jax import decode

    modes = tuple(m.strip() for m in e.harness_modes.split(",") if m.strip())
    if not modes or any(m not in decode.MODES for m in modes):
        raise ConfigError(f"--config.eval.harness_modes={e.harness_modes!r}: use some of {','.join(decode.MODES)}")
    if e.harness_every_steps < 0 or e.harness_limit < 0:
        raise ConfigError("--config.eval.harness_every_steps and harness_limit must be >= 0 (0: last step; all)")
    if config.data.source == "task":
        raise ConfigError("--config.eval.harness_tasks needs a text run (data.source=text): the harness scores text")
    if e.harness_include and not os.path.isdir(e.harness_include):
        raise ConfigError(f"--config.eval.harness_include={e.harness_include!r} is not a directory of task YAMLs")
    fewshot = None if e.harness_num_fewshot < 0 else int(e.harness_num_fewshot)
    return HarnessSettings(tasks, modes, e.harness_include, fewshot, int(e.harness_limit), int(e.harness_batch_size))


def offline() -> None:
    """Nothing is downloaded: the dataset and hub libraries read their local caches and files only."""
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ[name] = "1"


def load_tasks(settings: HarnessSettings) -> Any:
    """The harness's task manager, once every task is known and its data loads from this machine."""
    offline()
    import logging

    logging.getLogger("lm_eval").setLevel(logging.ERROR)  # its notes on defaults; errors still show
    from lm_eval.tasks import TaskManager, get_task_dict

    manager = None
    if settings.include:  # tasks all under --harness-include: the harness's own ~200 folders need no index
        manager = TaskManager(include_path=settings.include, include_defaults=False)
        manager = manager if set(settings.tasks) <= set(manager.all_tasks) else None
    manager = manager or TaskManager(include_path=settings.include or None)
    for name in settings.tasks:
        if name not in manager.all_tasks:
            where = f" or under --harness-include={settings.include}" if settings.include else ""
            raise ConfigError(
                f"task {name!r} is not one of the harness's tasks{where}; `lm-eval ls tasks` lists them, and a "
                "directory of task YAMLs is given with --harness-include"
            )
        try:
            get_task_dict([name], manager)
        except Exception as err:  # noqa: BLE001 - datasets' errors vary by source; each becomes one line
            raise ConfigError(f"task {name!r}: {missing_data(err)}") from None
    return manager


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


def evaluate_harness(checkpoint: str, output: str, settings: HarnessSettings, progress: bool = True) -> dict:
    """Every task in every mode; writes and returns the table (see the module docstring)."""
    manager = load_tasks(settings)
    from fbt_jax.evals.harness import FBTLM, Loaded

    loaded = Loaded.read(checkpoint)
    runner.check_modes(loaded.config, loaded.step, settings.modes)
    identity = json.loads(json.dumps({"checkpoint": checkpoint, "step": loaded.step, **dataclasses.asdict(settings)}))
    runner.claim_output(output, identity)
    from fbt_jax.train.services import use_run_cache

    use_run_cache(loaded.config, checkpoint, lambda line: print(line, file=sys.stderr))
    import lm_eval

    per_mode, timing = {}, {}
    for mode in settings.modes:
        lm = FBTLM(mode=mode, batch_size=settings.batch_size, prefill_passes=settings.prefill_passes,
                   seed=settings.seed, loaded=loaded, progress=progress)  # fmt: skip
        before, start = dataclasses.replace(loaded.generator.timing), time.perf_counter()
        per_mode[mode] = lm_eval.simple_evaluate(
            model=lm, tasks=list(settings.tasks), task_manager=manager, num_fewshot=settings.num_fewshot,
            limit=settings.limit or None, use_cache=os.path.join(output, "cache", mode), log_samples=True,
            bootstrap_iters=RESAMPLES, random_seed=settings.seed, numpy_random_seed=settings.seed,
            fewshot_random_seed=settings.seed,
        )  # fmt: skip
        spent = loaded.generator.timing
        timing[mode] = {"seconds": time.perf_counter() - start, "model_seconds": spent.decode_s - before.decode_s,
                        "tokens": spent.tokens - before.tokens}  # fmt: skip
    table = tables(per_mode, settings.modes, settings.seed)
    table |= {"checkpoint": checkpoint, "step": loaded.step, "timing": timing}
    store.write_json(os.path.join(output, RESULTS), table, staging=output)
    text = markdown(table)
    with open(os.path.join(output, TABLE), "w", encoding="utf-8") as f:
        f.write(text)
    return table


def metric_names(row: dict[str, Any]) -> list[str]:
    """A results row's metrics ("acc,none" → "acc"), without their standard errors."""
    names = [key.split(",")[0] for key in row if "," in key and "_stderr" not in key]
    return list(dict.fromkeys(names))


def tables(per_mode: dict[str, dict], modes: tuple[str, ...], seed: int = 0) -> dict[str, Any]:
    """{"tasks": {task: {mode: {metric: value, metric_stderr: se, documents: n}}},
    "paired": {task: {"soft-standard": {metric: {difference, ci, documents}}}}}."""
    out: dict[str, Any] = {"tasks": {}, "paired": {}}
    for mode in modes:
        results = per_mode[mode]
        for task, row in results["results"].items():
            cells = {}
            for metric in metric_names(row):
                value = row.get(f"{metric},none")
                stderr = row.get(f"{metric}_stderr,none")
                cells[metric] = value
                cells[f"{metric}_stderr"] = stderr if isinstance(stderr, (int, float)) else None
            cells["documents"] = len(results.get("samples", {}).get(task, [])) or None
            out["tasks"].setdefault(task, {})[mode] = cells
    if "standard" not in modes:
        return out
    standard = per_mode["standard"].get("samples", {})
    for mode in (m for m in modes if m != "standard"):
        for task, samples in per_mode[mode].get("samples", {}).items():
            if task not in standard:
                continue
            differences = {}
            for metric in metric_names(per_mode[mode]["results"][task]):
                differences[metric] = paired(samples, standard[task], metric, seed)
            out["paired"].setdefault(task, {})[f"{mode}-standard"] = differences
    return out


def paired(samples: list[dict], standard: list[dict], metric: str, seed: int = 0) -> dict[str, Any]:
    """The mode's metric minus standard's on the documents both scored, with a 95% bootstrap
    interval over those documents (the metric's own aggregation: a mean, a perplexity, ...)."""
    from lm_eval.api.registry import get_metric_aggregation

    aggregate = get_metric_aggregation(metric)
    ours = {s["doc_id"]: s[metric] for s in samples if metric in s}
    theirs = {s["doc_id"]: s[metric] for s in standard if metric in s}
    docs = sorted(set(ours) & set(theirs))
    if aggregate is None or not docs:
        return {"difference": None, "ci": None, "documents": len(docs)}
    a, b = [ours[d] for d in docs], [theirs[d] for d in docs]
    difference = float(aggregate(a) - aggregate(b))
    draws = scoring.resamples(len(docs), seed, RESAMPLES)  # paired: a document's two values drawn together
    values = [float(aggregate([a[i] for i in draw]) - aggregate([b[i] for i in draw])) for draw in draws]
    return {"difference": difference, "ci": list(scoring.percentile_interval(values, difference)),
            "documents": len(docs)}  # fmt: skip


def _number(value: Any) -> str:
    return "–" if value is None else f"{value:.4f}"


def markdown(table: dict[str, Any]) -> str:
    """The table: per task, mode and metric, the value ± its standard error and the difference from
    standard on the same documents [95% interval]."""
    lines = ["| task | mode | metric | value ± stderr | − standard [95% interval] | documents |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for task, per_mode in table["tasks"].items():
        for mode, cells in per_mode.items():
            for metric in (k for k in cells if not k.endswith("_stderr") and k != "documents"):
                stderr = cells.get(f"{metric}_stderr")
                value = _number(cells[metric]) + (f" ± {stderr:.4f}" if stderr is not None else "")
                diff = table["paired"].get(task, {}).get(f"{mode}-standard", {}).get(metric)
                shown = "–"
                if diff and diff["difference"] is not None:
                    shown = f"{diff['difference']:+.4f} [{diff['ci'][0]:+.4f}, {diff['ci'][1]:+.4f}]"
                lines.append(f"| {task} | {mode} | {metric} | {value} | {shown} | {cells['documents'] or '–'} |")
    for mode, spent in table.get("timing", {}).items():  # what each mode's column cost
        rate = spent["tokens"] / spent["model_seconds"] if spent["model_seconds"] else 0.0
        lines.append(f"\n{mode}: {spent['tokens']:,} tokens scored or generated in {spent['model_seconds']:.1f} s of "
                     f"model time ({rate:,.0f} tokens/s), {spent['seconds']:.1f} s in all")  # fmt: skip
    return "\n".join(lines) + "\n"
