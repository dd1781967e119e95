"""`fbt-eval --harness`: lm-evaluation-harness tasks on one checkpoint in each decoding mode, the
paper's table (docs/evaluation.md).

Everything that can be refused is refused before the output is written or the parameters are read
(`harness_tasks.py`, the training hook's check too): each task known to the harness (its own, or a
YAML under --harness-include) with its data on this machine (nothing is downloaded: the Hugging
Face libraries run offline), room in the run's context for its generations, the modes the
checkpoint can decode. Then, per mode, the harness runs the tasks through the `fbt` backend
(`harness.py`); every model response goes to a per-mode cache as its batch finishes, so a killed
evaluation started again with the same flags continues and ends with the numbers of an
uninterrupted one. Written: `harness.json` (per task and mode, each metric and its standard error,
and each mode's paired difference from standard on the same documents with a 95% bootstrap
interval), `harness.md` (the table), `eval.json` (the settings, which a later run must match).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import sys
import time
from typing import Any

from fbt_jax.data import store
from fbt_jax.errors import ConfigError, divert_library_noise
from fbt_jax.evals import runner, scoring
from fbt_jax.evals.harness_tasks import HarnessSettings, check_tasks, load_tasks

RESULTS, TABLE = "harness.json", "harness.md"
RESAMPLES = 1000  # bootstrap draws of the paired differences


def evaluate_harness(checkpoint: str, output: str, settings: HarnessSettings, progress: bool = True) -> dict:
    """Every task in every mode; writes and returns the table (see the module docstring). Everything
    that can be refused is refused before `output` is written or the checkpoint's parameters are read."""
    from fbt_jax.trained import read_run_config

    manager, tasks = load_tasks(settings)
    config, step = read_run_config(checkpoint, flag="--checkpoint")
    check_tasks(tasks, int(config.data.seq_len), "the run's data.seq_len")
    runner.check_modes(config, step, settings.modes)
    identity = json.loads(json.dumps({"checkpoint": checkpoint, "step": step, **dataclasses.asdict(settings)}))
    created = not os.path.exists(output)
    claimed = created or not os.path.exists(os.path.join(output, runner.SETTINGS_FILE))
    runner.claim_output(output, identity)
    divert_library_noise(os.path.join(output, "fbt-eval.log"))
    try:
        return _evaluate(checkpoint, output, settings, manager, progress)
    except ConfigError:
        if claimed:  # refused while building requests, before any answer: leave the directory as it was
            shutil.rmtree(os.path.join(output, "cache"), ignore_errors=True)
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(output, runner.SETTINGS_FILE))
            with contextlib.suppress(OSError):
                if created:
                    os.rmdir(output)  # only where nothing else is in it
        raise


def _evaluate(checkpoint: str, output: str, settings: HarnessSettings, manager: Any, progress: bool) -> dict:
    from fbt_jax.evals.harness import FBTLM, Loaded
    from fbt_jax.progress import library_bars_on_terminal_only
    from fbt_jax.run_services import use_run_cache

    loaded = Loaded.read(checkpoint)  # each mode's backend checks the modes again on the step it read
    use_run_cache(loaded.config, checkpoint, lambda line: print(line, file=sys.stderr))
    import lm_eval

    per_mode, timing = {}, {}
    for mode in settings.modes:
        lm = FBTLM(mode=mode, batch_size=settings.batch_size, prefill_passes=settings.prefill_passes,
                   seed=settings.seed, chat=settings.chat, loaded=loaded, progress=progress)  # fmt: skip
        before, start = dataclasses.replace(loaded.generator.timing), time.perf_counter()
        with library_bars_on_terminal_only():
            per_mode[mode] = lm_eval.simple_evaluate(
                model=lm, tasks=list(settings.tasks), task_manager=manager,
                num_fewshot=settings.num_fewshot, limit=settings.limit or None,
                use_cache=os.path.join(output, "cache", mode), log_samples=True, bootstrap_iters=RESAMPLES,
                random_seed=settings.seed, numpy_random_seed=settings.seed, fewshot_random_seed=settings.seed,
                apply_chat_template=settings.chat, fewshot_as_multiturn=settings.chat,
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
