"""`fbt-sweep report`: every run's overrides, held-out metrics, tokens, compute and time, gathered
into results.csv (one row per run), results.md (means ± std over seeds), plots, and TensorBoard
HParams summaries (`tensorboard --logdir <sweep>/tensorboard`).

A run's curve is its trunks' evaluations followed by its own: a forked run trained exactly those
steps. Its compute counts every step's K passes (3 × forward FLOPs per token); its time counts its
own job plus its trunks, i.e. what it would have cost alone with the sharing.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
from typing import Any

import numpy as np

from fbt_jax.flops import forward_flops
from fbt_jax.model import ModelConfig
from fbt_jax.sweep.plan import Job, pass_counts
from fbt_jax.sweep.spec import Sweep
from fbt_jax.sweep.state import SweepDirectory, read_json


def gather(sweep_dir: SweepDirectory, sweep: Sweep, jobs: list[Job], scores: str = "") -> list[dict[str, Any]]:
    """One record per finished run: labels, overrides, metrics, tokens, FLOPs, seconds, curve, and
    with `scores` (a directory inside each run's workdir) the pass@k of its `fbt-eval --tasks`."""
    by_name = {job.name: job for job in jobs}
    rows = []
    for run in sweep.runs:
        chain = [by_name[run.name]]
        while chain[0].parent:
            chain.insert(0, by_name[chain[0].parent])
        summary = read_json(os.path.join(chain[-1].workdir, "summary.json"))
        if summary is None or summary.get("steps") != run.config.train.steps:
            continue  # not finished
        curve = []
        for job in chain:
            curve += [
                r for r in _read_lines(os.path.join(job.workdir, "eval.jsonl")) if job.start < r["step"] <= job.end
            ]
        cfg = run.config
        tokens_per_step = cfg.train.batch_size * cfg.data.seq_len
        ks = pass_counts(cfg)  # K of every step
        counts = np.bincount(ks)
        model = ModelConfig.from_config(cfg.model)
        flops = sum(
            int(n) * 3 * forward_flops(model, cfg.data.seq_len, k) * tokens_per_step for k, n in enumerate(counts) if n
        )
        # Wall time of the run's jobs (its trunks in full), as the executor measured it.
        seconds = sum(sweep_dir.job_seconds(j.name) or 0.0 for j in chain)
        final = curve[-1] if curve else {}
        row = {"run": run.name, **{f"label.{k}": v for k, v in run.labels.items()}}
        for key in sorted(k for k in final if k.startswith(("loss_K", "accuracy_K"))):
            row[f"final_{key}"] = final[key]
            values = [r[key] for r in curve if key in r]
            row[f"best_{key}"] = min(values) if key.startswith("loss") else max(values)
        row |= {"tokens": cfg.train.steps * tokens_per_step, "train_flops": flops, "seconds": seconds}
        # Where the time went, over every attempt of the run's jobs (goodput.py's record of each).
        times = [
            s["goodput"]
            for s in (read_json(os.path.join(j.workdir, "summary.json")) for j in chain)
            if s and "goodput" in s
        ]
        if len(times) == len(chain):
            wall = sum(t["wall_seconds"] for t in times)
            row["wall_seconds"] = wall
            row["goodput"] = sum(t["seconds"]["steps"] for t in times) / wall if wall else 0.0
        if scores:
            row |= evaluation_scores(os.path.join(chain[-1].workdir, scores))
        row["mean_num_passes"] = float(np.mean(ks))
        row["curve"] = [(r["step"] * tokens_per_step, r) for r in curve]
        row["overrides"] = run.overrides
        rows.append(row)
    return rows


SCORE_FILES = {  # what `fbt-eval` writes → which of its per-task, per-mode figures the report keeps
    "scores.json": lambda key: key.startswith("pass@") and not key.endswith("_ci"),  # --tasks: pass@k
    "harness.json": lambda key: not key.endswith("_stderr") and key != "documents",  # --harness: each metric
}


def evaluation_scores(directory: str) -> dict[str, float]:
    """`final_<task>/<mode>/<figure>` of a run's `fbt-eval --tasks` or `--harness` output in
    `directory` (nothing where it has none yet)."""
    out = {}
    for name, kept in SCORE_FILES.items():
        found = read_json(os.path.join(directory, name)) or {"tasks": {}}
        out |= {
            f"final_{task}/{mode}/{key}": value
            for task, per_mode in found["tasks"].items()
            for mode, row in per_mode.items()
            for key, value in row.items()
            if kept(key) and isinstance(value, (int, float))
        }
    return out


def write_report(sweep_dir: SweepDirectory, sweep: Sweep, jobs: list[Job], scores: str = "") -> dict[str, str]:
    rows = gather(sweep_dir, sweep, jobs, scores)
    if not rows:
        return {}
    columns = [c for c in rows[0] if c not in ("curve", "overrides")]
    for row in rows[1:]:
        columns += [c for c in row if c not in columns and c not in ("curve", "overrides")]
    paths = {"csv": sweep_dir.path("results.csv"), "md": sweep_dir.path("results.md")}
    with open(paths["csv"], "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    with open(paths["md"], "w", encoding="utf-8") as f:
        f.write(markdown_table(rows, len(sweep.runs)))
    paths |= _plots(sweep_dir, rows)
    _hparams(sweep_dir, rows)
    return paths


def _group_key(row: dict[str, Any]) -> str:
    """The run's labels without its seed: what the seeds are replicates of."""
    return ",".join(f"{k[6:]}={v}" for k, v in row.items() if k.startswith("label.") and k != "label.seed") or "all"


def markdown_table(rows: list[dict[str, Any]], total_runs: int) -> str:
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(_group_key(row), []).append(row)
    metrics = sorted({k for row in rows for k in row if k.startswith("final_")})
    lines = [
        f"{len(rows)} of {total_runs} runs finished; mean ± std over seeds (n per row), final held-out metrics.",
        "",
        "| runs | n | mean K | "
        + " | ".join(m.removeprefix("final_") for m in metrics)
        + " | TFLOPs | seconds | goodput |",
        "|---|---|---|" + "---|" * len(metrics) + "---|---|---|",
    ]
    for key, members in groups.items():
        cells = [_mean_std([r.get(m) for r in members]) for m in metrics]
        flops = np.mean([r["train_flops"] for r in members]) / 1e12
        seconds = np.mean([r["seconds"] for r in members])
        goodput = [r["goodput"] for r in members if "goodput" in r]
        shown = f"{100 * np.mean(goodput):.1f}%" if len(goodput) == len(members) else "–"
        lines.append(
            f"| {key} | {len(members)} | {members[0]['mean_num_passes']:.2f} | "
            + " | ".join(cells)
            + f" | {flops:.3g} | {seconds:.0f} | {shown} |"
        )
    return "\n".join(lines) + "\n"


def _mean_std(values: list[Any]) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "–"
    return f"{np.mean(values):.4f} ± {np.std(values):.4f}" if len(values) > 1 else f"{values[0]:.4f}"


def _plots(sweep_dir: SweepDirectory, rows: list[dict[str, Any]]) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(sweep_dir.path("plots"), exist_ok=True)
    ks = sorted({int(k.split("K")[1]) for row in rows for k in row if k.startswith("final_loss_K")})
    out = {}
    fig, axes = plt.subplots(1, len(ks), figsize=(5 * len(ks), 4), squeeze=False)
    for ax, k in zip(axes[0], ks):
        for row in rows:
            points = [(tokens, r[f"loss_K{k}"]) for tokens, r in row["curve"] if f"loss_K{k}" in r]
            if points:
                ax.plot(*zip(*points), label=row["run"], linewidth=1)
        ax.set(xlabel="training tokens", ylabel=f"held-out loss, K={k}", title=f"eval with K={k}")
    axes[0][-1].legend(fontsize=6)
    fig.tight_layout()
    out["loss_vs_tokens"] = sweep_dir.path("plots", "loss_vs_tokens.png")
    fig.savefig(out["loss_vs_tokens"], dpi=120)
    plt.close(fig)
    groups = sorted({_group_key(r) for r in rows})
    fig, axes = plt.subplots(1, len(ks), figsize=(5 * len(ks), 4), squeeze=False)
    for ax, k in zip(axes[0], ks):
        means = [np.mean([r[f"final_loss_K{k}"] for r in rows if _group_key(r) == g]) for g in groups]
        stds = [np.std([r[f"final_loss_K{k}"] for r in rows if _group_key(r) == g]) for g in groups]
        ax.bar(range(len(groups)), means, yerr=stds, capsize=3)
        ax.set_xticks(range(len(groups)), groups, rotation=30, ha="right", fontsize=7)
        ax.set(ylabel=f"final held-out loss, K={k}", title=f"eval with K={k}")
    fig.tight_layout()
    out["final_vs_mixture"] = sweep_dir.path("plots", "final_vs_mixture.png")
    fig.savefig(out["final_vs_mixture"], dpi=120)
    plt.close(fig)
    return out


def _hparams(sweep_dir: SweepDirectory, rows: list[dict[str, Any]]) -> None:
    from tensorboardX import SummaryWriter

    for row in rows:
        hparams = {
            k: (v if isinstance(v, (int, float, str, bool)) else json.dumps(v)) for k, v in row["overrides"].items()
        }
        metrics = {f"hparam/{k}": v for k, v in row.items() if k.startswith(("final_", "best_"))}
        directory = sweep_dir.path("tensorboard", row["run"])
        shutil.rmtree(directory, ignore_errors=True)  # written anew by each report
        with SummaryWriter(directory) as writer:
            writer.add_hparams(hparams, metrics, name=".")


def _read_lines(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
