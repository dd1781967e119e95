"""Probes: is what position t must produce linearly readable at the first layer, without feedback
and with it?

For the S3 word problem (the state-tracking experiment's models, every rung of its budget ladder on
disk: the group state s_t) and delayed
recall out of a plain pass's reach (`configs/sweeps/delayed_recall.py`: the token x_(t−8) under a
4-position attention window), models trained without feedback (`k1`), with the paper's 75/22/3
mixture (`paper`) and with the heavier 50/25/25 one (`heavy`), three seeds each. At each position
t, a separate linear probe (multinomial logistic regression) is fitted on the first layer's
output (layer 0: the first block's output) for 1024 training-split sequences and scored on 1024
validation-split sequences (`fbt_jax.probes.probes_by_position`), with the stack's input fully
fused from position 1 and the carried states from

- K = 1: no feedback (the plain transformer);
- K = 2: one feedback pass (the states of a plain pass, shifted by one);
- the exact recurrence: T passes, each position fed the fully computed state of the one before
  (what latent-feedback decoding feeds).

The S3 claim is judged over the ladder (`budget.judge`): one pass − none, per seed, at every rung
(and at rungs only summary.json remembers). Beside it, a sharper effect: the paper arm's one-pass
probe − the K=1-only model's one-pass probe, seed by seed, which separates what feedback training
made of layer 0 from what reading any carried state gives.

    python experiments/layer_probes.py --write-docs docs/results.md
"""

from __future__ import annotations

import os
from typing import Any

import budget
import common
import numpy as np
import state_tracking
import summary

from fbt_jax.data.pipeline import make_source
from fbt_jax.data.plan import plan_data
from fbt_jax.probes import probes_by_position
from fbt_jax.trained import load_model

NAME = "layer_probes"
RECALL_SPEC = os.path.join(common.REPO, "configs", "sweeps", "delayed_recall.py")
SCHEDULES = ("k1", "paper", "heavy")
SETTINGS = (("K1", "K=1 (no feedback)"), ("K2", "K=2 (one feedback pass)"), ("exact", "exact recurrence"))


def probe(row: dict[str, Any], num_sequences: int) -> dict[str, Any]:
    model, config = load_model(row["workdir"], log=lambda *_: None)
    rows = np.arange(num_sequences)
    train = make_source(plan_data(config), "train").examples(rows)
    test = make_source(plan_data(config), "validation").examples(rows)
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


# Absolute tolerances: a model that solves the task has a loss near 0.
RECALL_RULES = (budget.Rule("accuracy_K1", 0.01), budget.Rule("loss_K1", 0.01))
RECALL_FEEDBACK_RULES = (budget.Rule("accuracy_K2", 0.01), budget.Rule("loss_K2", 0.02))


def recall_check(rows: list[dict[str, Any]], what: str = "delayed recall") -> budget.Check:
    """Every arm's K=1 accuracy and loss settled, and the feedback arms' K=2 accuracy and loss."""
    return budget.check_with_feedback(rows, RECALL_RULES, RECALL_FEEDBACK_RULES, what)


CHECKS = {"S3": state_tracking.budget_check, "delayed recall": recall_check}  # per task: (rows, what) → Check


def late_mean(seeds: list[dict[str, Any]], name: str, seq_len: int) -> np.ndarray:
    return np.array([late(r["probe"][name], r["probe"]["positions"], seq_len) for r in seeds])


EFFECT = "layer-0 probe accuracy, one pass − none (75/22/3, t ≥ 8)"
MINIMUM = 0.1  # a gain below ten points of probe accuracy does not make the answer readable


SHARPER = "layer-0 one-pass probe accuracy, 75/22/3 − K=1 only (t ≥ 8)"


def by_seed(seeds: list[dict[str, Any]], name: str, seq_len: int) -> dict[Any, float]:
    return {r["label.seed"]: late(r["probe"][name], r["probe"]["positions"], seq_len) for r in seeds}


def rungs(ladder: list[list[dict[str, Any]]], seq_len: int) -> tuple[list[budget.Rung], list[budget.Rung]]:
    """Per rung of the S3 ladder, the claim's effect (the paper arm's one pass − none) and the
    sharper one (the paper arm's one-pass probe − the K=1-only model's, seed by seed): a K=1 model
    fed one pass of its own states shows how much of the gain the feedback training made."""
    effects, sharper = [], []
    for rows in ladder:
        arms = common.by_label(rows, "schedule")
        steps = rows[0]["config"].train.steps
        one_pass, plain = by_seed(arms["paper"], "K2", seq_len), by_seed(arms["paper"], "K1", seq_len)
        effects.append(budget.Rung(steps, tuple(one_pass[s] - plain[s] for s in sorted(one_pass))))
        untrained = by_seed(arms["k1"], "K2", seq_len)
        sharper.append(
            budget.Rung(steps, tuple(one_pass[s] - untrained[s] for s in sorted(one_pass) if s in untrained))
        )
    return effects, sharper


def judge(
    seeds: list[dict[str, Any]], seq_len: int, settled: budget.Check, ladder: list[budget.Rung] | None = None
) -> tuple[str, budget.Judgement | None]:
    """The claim on one task's feedback-trained models (`seeds`: the top rung's), by its effect (one
    pass's probe accuracy minus none's, per seed, over the `ladder` of rungs where there is one;
    `budget.judge` with `settled` the check of these models): reproduced at the paper's size where
    layer 0 is near chance without feedback and ≥ 0.9 with one pass, partly where the gain is real
    but smaller. Untestable where the models did not learn the task: nothing is there to be read."""
    plain, one_pass = late_mean(seeds, "K1", seq_len), late_mean(seeds, "K2", seq_len)
    chance = late_mean(seeds, "chance", seq_len).mean()
    learned = max(np.mean([r[f"final_accuracy_K{k}"] for r in seeds]) for k in (1, 2, 3))
    if learned < chance + 0.1:
        untestable = f"held-out accuracy {learned:.3f} at its best K, chance {chance:.3f}"
        return f"untestable: no model learned the task ({untestable})", None
    steps = seeds[0]["config"].train.steps
    judged = budget.judge(EFFECT, ladder or [budget.Rung(steps, tuple(one_pass - plain))], settled, minimum=MINIMUM)
    if judged.verdict == "reproduced" and not (one_pass.mean() >= 0.9 and plain.mean() <= chance + 0.1):
        return "partly (a gain, not the paper's size)", judged
    return judged.verdict, judged


def per_position_table(rows: list[dict[str, Any]]) -> str:
    """Probe accuracy at every position, mean over seeds, per mixture and feedback setting."""
    positions = rows[0]["probe"]["positions"]
    header = ["mixture", "setting", *[f"t={t}" for t in positions]]
    lines = []
    for schedule, seeds in common.by_label(rows, "schedule").items():
        for name, label in (*SETTINGS, ("chance", "chance")):
            lines.append([schedule, label, *[f"{v:.2f}" for v in np.mean([r["probe"][name] for r in seeds], 0)]])
    return common.docs_block.table(header, lines)


LADDER_HEADER = ["steps", "75/22/3 K=1", "75/22/3 one pass", "one pass − none", "K=1 only, one pass",
                 "75/22/3 − K=1 only, one pass", "code"]  # fmt: skip


def ladder_table(ladder: list[list[dict[str, Any]]], seq_len: int, codes: dict[str, str]) -> str:
    """The S3 probes at every rung on disk (t ≥ seq_len / 2, mean ± std over seeds)."""
    lines = []
    for rows, effect, sharper in zip(ladder, *rungs(ladder, seq_len)):
        arms = common.by_label(rows, "schedule")
        cells = [late_mean(arms["paper"], "K1", seq_len), late_mean(arms["paper"], "K2", seq_len), effect.values,
                 late_mean(arms["k1"], "K2", seq_len), sharper.values]  # fmt: skip
        lines.append([str(effect.steps), *[common.mean_std(c) for c in cells], codes[str(effect.steps)]])
    return common.docs_block.table(LADDER_HEADER, lines)


def verdicts(
    ladder: list[list[dict[str, Any]]],
    recall: list[dict[str, Any]],
    checks: dict[str, budget.Check],
    seq_len: int,
    recorded: tuple[dict, dict],
) -> tuple[list[str], summary.Row]:
    """Per task, on the paper's mixture (its own checks settle it): the verdict lines and the summary
    row. S3 is judged over its ladder: the rungs on disk, and those only `recorded` (the effects and
    codes summary.json kept) where their runs are gone."""
    word, (kept, kept_codes) = ladder[-1], recorded
    effects, sharper = rungs(ladder, seq_len)
    codes = {str(r.steps): common.rows_code(rows) for r, rows in zip(effects, ladder)}
    carried = [budget.Rung.from_record(int(k), v) for k, v in kept.items() if k not in codes]
    codes |= {str(r.steps): kept_codes.get(str(r.steps), summary.UNRECORDED) for r in carried}
    s3_ladder = sorted(carried + effects, key=lambda r: r.steps)
    said, figures, judged = {}, [], {}
    for task, rows, task_ladder in (("S3", word, s3_ladder), ("delayed recall", recall, None)):
        paper = [r for r in rows if r["label.schedule"] == "paper"]
        compared = CHECKS[task](paper, f"{task}, 75/22/3")
        said[task], judged[task] = judge(paper, seq_len, compared, task_ladder)
        figures.append(
            f"{task}, 75/22/3, t ≥ {seq_len // 2}: K=1 {common.mean_std(late_mean(paper, 'K1', seq_len))} → one pass "
            f"{common.mean_std(late_mean(paper, 'K2', seq_len))}, exact recurrence "
            f"{common.mean_std(late_mean(paper, 'exact', seq_len))} (chance {late_mean(paper, 'chance', seq_len).mean():.2f})"
        )
    figures[0] += f" at {word[0]['config'].train.steps} steps; one pass − none over the ladder: " + ", ".join(
        f"{r.steps} steps {r.mean:+.3f}" for r in s3_ladder
    )
    both = [r for r in word if r["label.schedule"] in ("paper", "k1")]
    sharp = budget.judge(SHARPER, sharper, CHECKS["S3"](both, "S3, 75/22/3 and K=1 only"), minimum=MINIMUM)
    figures[0] += f"; {SHARPER} {sharper[-1].mean:+.3f} ± {sharper[-1].se:.3f} (standard error), {sharp.verdict}"
    lines = []
    for task, v in said.items():
        lines.append(f"verdict (one feedback pass makes the {task} answer readable at layer 0): {v}")
        not_applied = f"verdict rule: not applied, there is no effect to judge ({v})"
        lines.append(judged[task].line if judged[task] is not None else not_applied)
    lines.append(f"verdict (S3: the feedback-trained layer 0 reads better after one pass than a K=1-only model's): "
                 f"{sharp.verdict}")  # fmt: skip
    lines.append(sharp.line)
    rule = (
        "the 75/22/3 models settled (S3: the state-tracking rule, §1; delayed recall: K=1 accuracy within 0.01 and "
        "loss within 0.01 nats, K=2 accuracy within 0.01 and loss within 0.02 nats), over the last 20% of steps, or "
        "the S3 effect stable over the state-tracking ladder"
    )
    verdict_text = "; ".join(f"{task}: {v}" for task, v in said.items())
    criterion = "; ".join(f"{task}: {j.criterion or 'neither'}" for task, j in judged.items() if j is not None)
    held = all(c.held for c in checks.values())
    recorded_effects = {str(r.steps): r.record() for r in s3_ladder} if judged["S3"] is not None else {}
    row = summary.Row("; ".join(figures), rule, held, verdict_text, criterion=criterion, effect=f"S3: {EFFECT}",
                      effects=recorded_effects, commits=codes)  # fmt: skip
    return lines, row


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
    recall_spec = common.smoke_spec(RECALL_SPEC, args.sweeps_dir, ("k1", "paper")) if args.smoke else RECALL_SPEC
    # The word-problem models are the state-tracking experiment's (trained there, or here if not yet),
    # every rung of its ladder on disk.
    ladder = [[r for r in rows if r["label.schedule"] in SCHEDULES] for rows in common.state_tracking_ladder(args)]
    word = ladder[-1]
    recall = common.run_sweep(recall_spec, os.path.join(args.dir, "delayed_recall"))
    num_sequences = 64 if args.smoke else 1024
    for row in [r for rows in ladder for r in rows] + recall:
        row["probe"] = probe(row, num_sequences)
    tasks = [(f"{group} word problem", rows) for group, rows in common.by_label(word, "run").items()]
    tasks.append(("delayed recall", recall))
    figure = common.plot_path(args, NAME)
    plot(tasks, figure)
    checks = {
        "S3": state_tracking.budget_check(word, "S3 models"),
        "delayed recall": recall_check(recall),
    }
    recorded = summary.load_effects(args, NAME), summary.load_commits(args, NAME)
    verdict_lines, row = verdicts(ladder, recall, checks, 16, recorded)
    body = [
        f"Written by `python experiments/{NAME}.py{' --smoke' if args.smoke else ''}` on {common.machine()} in "
        f"{timer.minutes():.1f} min (the word-problem models are shared with `experiments/state_tracking.py`). "
        f"Layer-0 probe accuracy on {num_sequences} held-out sequences, one probe per position, averaged over "
        f"positions t ≥ 8 of 16 (mean ± std over seeds; for delayed recall these are all the scored positions); chance is the majority class at each position, averaged "
        f"the same way.",
        "",
        *[check.line + "\n" for check in checks.values()],
        *[line + "\n" for line in verdict_lines],
        f"The S3 ladder (the state-tracking models of every rung on disk; `code`: the commit they were trained and "
        f"probed at):\n\n{ladder_table(ladder, 16, row.commits)}\n",
        f"Every model at {word[0]['config'].train.steps} steps:\n",
        table(tasks, 16),
        "",
        *[
            f"**{task}, position by position** (mean over seeds):\n\n{per_position_table(rows)}\n"
            for task, rows in tasks
        ],
        common.figure_line(args, figure, "layer-0 probe accuracy per position"),
    ]
    common.finish(args, NAME, "\n".join(body))
    summary.record(args, NAME, row)


if __name__ == "__main__":
    main()
