"""The tables of a generative evaluation, from its generations alone: per task and mode, pass@k
(accuracy with one greedy generation) with a 95% interval, mean and median generated tokens and
tokens/s; per task, each mode's paired difference from standard on the same problems; a plot.

Written as `scores.json`, `scores.md` and `scores.png`; recomputed whole at the end of every
attempt, so a resumed evaluation ends with the table an uninterrupted one writes.
"""

from __future__ import annotations

import os
from typing import Any

from fbt_jax.data import store
from fbt_jax.evals import scoring

SCORES = "scores.json"


def tables(
    records: list[dict[str, Any]], modes: tuple[str, ...], ks: tuple[int, ...], timing: dict[str, Any], seed: int = 0
) -> dict[str, Any]:
    """{"tasks": {task: {mode: row}}, "paired": {task: {mode: difference vs standard}}}."""
    by_task: dict[str, dict[str, dict[str, list[bool]]]] = {}
    tokens: dict[tuple[str, str], list[int]] = {}
    for r in records:
        by_task.setdefault(r["task"], {}).setdefault(r["mode"], {}).setdefault(r["id"], []).append(bool(r["correct"]))
        tokens.setdefault((r["task"], r["mode"]), []).append(int(r["tokens"]))
    out: dict[str, Any] = {"tasks": {}, "paired": {}}
    for task, per_mode in by_task.items():
        out["tasks"][task] = {}
        for mode in (m for m in modes if m in per_mode):
            row = scoring.summarize(per_mode[mode], tokens[(task, mode)], ks, seed)
            spent = timing.get(f"{task}/{mode}", {})
            row["tokens_per_s"] = spent.get("tokens", 0) / spent["seconds"] if spent.get("seconds") else None
            out["tasks"][task][mode] = row
        if "standard" in per_mode:
            out["paired"][task] = {
                f"{mode}-standard": scoring.paired(per_mode[mode], per_mode["standard"], min(ks), seed)
                for mode in modes
                if mode != "standard" and mode in per_mode
            }
    return out


def markdown(scores: dict[str, Any], ks: tuple[int, ...], samples: int) -> str:
    """The tables as markdown."""
    names = ["accuracy"] if samples == 1 else [f"pass@{k}" for k in ks]
    keys = [f"pass@{k}" for k in ks][: len(names)]
    head = ["task", "mode", "problems", *names, "mean tokens", "median tokens", "tokens/s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for task, per_mode in scores["tasks"].items():
        for mode, row in per_mode.items():
            cells = [f"{row[k]:.3f} [{row[k + '_ci'][0]:.3f}, {row[k + '_ci'][1]:.3f}]" for k in keys]
            speed = f"{row['tokens_per_s']:,.0f}" if row["tokens_per_s"] else "–"
            lines.append(
                f"| {task} | {mode} | {row['problems']} | {' | '.join(cells)} | {row['mean_tokens']:.1f} | "
                f"{row['median_tokens']:.1f} | {speed} |"
            )
    if any(scores["paired"].values()):
        lines += ["", f"Paired with standard on the same problems ({names[0]} difference, 95% bootstrap interval):", ""]
        lines += ["| task | comparison | problems | difference |", "|---|---|---|---|"]
        for task, comparisons in scores["paired"].items():
            for name, d in comparisons.items():
                lines.append(
                    f"| {task} | {name} | {d['problems']} | {d['difference']:+.3f} [{d['ci'][0]:+.3f}, {d['ci'][1]:+.3f}] |"
                )
    return "\n".join(lines) + "\n"


def plot(scores: dict[str, Any], ks: tuple[int, ...], path: str) -> None:
    """Per task: pass@k (with its interval) and median generated tokens by mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    tasks = list(scores["tasks"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    k = f"pass@{min(ks)}"
    modes = sorted({m for per_mode in scores["tasks"].values() for m in per_mode})
    width = 0.8 / max(len(modes), 1)
    for j, mode in enumerate(modes):
        x = np.arange(len(tasks)) + j * width
        rows = [scores["tasks"][t].get(mode) for t in tasks]
        values = [r[k] if r else np.nan for r in rows]
        errors = np.array([[r[k] - r[k + "_ci"][0], r[k + "_ci"][1] - r[k]] if r else [0, 0] for r in rows]).T
        axes[0].bar(x, values, width, yerr=errors, capsize=3, label=mode)
        axes[1].bar(x, [r["median_tokens"] if r else np.nan for r in rows], width, label=mode)
    for ax, label in ((axes[0], k), (axes[1], "median generated tokens")):
        ax.set_xticks(np.arange(len(tasks)) + width * (len(modes) - 1) / 2, tasks)
        ax.set(ylabel=label)
        ax.legend()
    axes[0].set_ylim(0, 1)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write(output: str, records: list[dict[str, Any]], settings: Any, timing: dict[str, Any]) -> dict[str, Any]:
    """scores.json, scores.md and scores.png in `output`; returns the scores."""
    scores = tables(records, settings.modes, settings.pass_at, timing, settings.seed)
    store.write_json(os.path.join(output, SCORES), scores, staging=output)
    with open(os.path.join(output, "scores.md"), "w", encoding="utf-8") as f:  # a view of scores.json
        f.write(markdown(scores, settings.pass_at, settings.samples))
    plot(scores, settings.pass_at, os.path.join(output, "scores.png"))
    return scores
