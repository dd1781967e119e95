"""Probes: is what position t must produce linearly readable at the first layer, without feedback
and with it?

For the S3 and S5 word problems (the state-tracking experiment's models: the group state s_t) and
delayed recall (`configs/sweeps/delayed_recall.py`: the token x_(t−4)), models trained without
feedback (`k1`) and with the paper's 75/22/3 mixture (`paper`), plus for the word problems the
heavier 50/25/25 mixture (`heavy`, the one whose feedback helps most there), three seeds each. At each position
t, a separate linear probe (multinomial logistic regression) is fitted on the first layer's
output (layer 0: the first block's output) for 1024 training-split sequences and scored on 1024
validation-split sequences (`fbt_jax.probes.probes_by_position`), with the stack's input fully
fused from position 1 and the carried states from

- K = 1: no feedback (the plain transformer);
- K = 2: one feedback pass (the states of a plain pass, shifted by one);
- the exact recurrence: T passes, each position fed the fully computed state of the one before
  (what latent-feedback decoding feeds).

    python experiments/layer_probes.py --write-docs docs/results.md
"""

from __future__ import annotations

import os
from typing import Any

import common
import numpy as np

from fbt_jax.data.pipeline import make_source
from fbt_jax.probes import probes_by_position
from fbt_jax.trained import load_model

NAME = "layer_probes"
RECALL_SPEC = os.path.join(common.REPO, "configs", "sweeps", "delayed_recall.py")
SCHEDULES = ("k1", "paper")  # delayed recall's; the word problems add the heavy mixture, where feedback works best
WORD_SCHEDULES = (*SCHEDULES, "heavy")
SETTINGS = (("K1", "K=1 (no feedback)"), ("K2", "K=2 (one feedback pass)"), ("exact", "exact recurrence"))


def probe(row: dict[str, Any], num_sequences: int) -> dict[str, Any]:
    model, config = load_model(row["workdir"], log=lambda *_: None)
    rows = np.arange(num_sequences)
    train = make_source(config, "train").examples(rows)
    test = make_source(config, "validation").examples(rows)
    return probes_by_position(model, train, test, layer=0)


def late(values: list[float], positions: list[int], seq_len: int) -> float:
    """Mean over the second half of the sequence, where a plain layer 0 cannot have the answer."""
    return float(np.mean([v for v, t in zip(values, positions) if t >= seq_len // 2]))


def table(tasks: list[tuple[str, list[dict[str, Any]]]], seq_len: int) -> str:
    header = ["task", "trained", *[label for _, label in SETTINGS], "chance"]
    lines = []
    for task, rows in tasks:
        for schedule, seeds in common.by_label(rows, "schedule").items():
            cells = [task, schedule]
            for name, _ in SETTINGS:
                cells.append(common.mean_std([late(r["probe"][name], r["probe"]["positions"], seq_len) for r in seeds]))
            cells.append(
                f"{np.mean([late(r['probe']['chance'], r['probe']['positions'], seq_len) for r in seeds]):.3f}"
            )
            lines.append(cells)
    return common.docs_block.table(header, lines)


def plot(tasks: list[tuple[str, list[dict[str, Any]]]], path: str) -> None:
    plt = common.pyplot()
    fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 4), squeeze=False)
    for ax, (task, rows) in zip(axes[0], tasks):
        by_schedule = common.by_label(rows, "schedule")
        shown = "heavy" if "heavy" in by_schedule else "paper"  # the strongest feedback mixture trained
        seeds = by_schedule[shown]
        positions = seeds[0]["probe"]["positions"]
        for i, (name, label) in enumerate(SETTINGS):
            values = np.array([r["probe"][name] for r in seeds])
            ax.plot(positions, values.mean(0), marker=".", color=f"C{i}", label=label)
            ax.fill_between(positions, values.min(0), values.max(0), color=f"C{i}", alpha=0.2)
        ax.plot(positions, seeds[0]["probe"]["chance"], color="gray", linestyle="--", label="chance")
        ax.set(title=f"{task}, {shown} mixture: layer-0 probe", xlabel="position t", ylabel="accuracy", ylim=(0, 1.02))
        ax.legend(fontsize=8)
    common.save_figure(fig, path)


def main() -> None:
    args = common.arguments(__doc__, NAME)
    timer = common.Timer()
    recall_spec = common.smoke_spec(RECALL_SPEC, args.sweeps_dir, SCHEDULES) if args.smoke else RECALL_SPEC
    # The word-problem models are the state-tracking experiment's (trained there, or here if not yet).
    word = [r for r in common.state_tracking_runs(args) if r["label.schedule"] in WORD_SCHEDULES]
    recall = common.run_sweep(recall_spec, os.path.join(args.dir, "delayed_recall"))
    num_sequences = 64 if args.smoke else 1024
    for row in word + recall:
        row["probe"] = probe(row, num_sequences)
    tasks = [(f"{group} word problem", rows) for group, rows in common.by_label(word, "run").items()]
    tasks.append(("delayed recall", recall))
    figure = common.plot_path(args, NAME)
    plot(tasks, figure)
    body = [
        f"Written by `python experiments/{NAME}.py{' --smoke' if args.smoke else ''}` on {common.machine()} in "
        f"{timer.minutes():.1f} min (the word-problem models are shared with `experiments/state_tracking.py`). "
        f"Layer-0 probe accuracy on {num_sequences} held-out sequences, one probe per position, averaged over "
        f"positions t ≥ 8 of 16 (mean ± std over seeds); chance is the majority class at each position, averaged "
        f"the same way.",
        "",
        table(tasks, 16),
        "",
        common.figure_line(args, figure, "layer-0 probe accuracy per position"),
    ]
    common.finish(args, NAME, "\n".join(body))


if __name__ == "__main__":
    main()
