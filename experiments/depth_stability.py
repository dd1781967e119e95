"""Depth stability: does a {1, 2}-trained map diverge beyond its passes, and a {1, 2, 3}-trained one
contract to a fixed point?

Two sets of models, three seeds each, {1, 2} (`k12`), the paper's 75/22/3 (`paper`) and the
heavier 50/25/25 (`heavy`):

- the S3 models of `experiments/state_tracking.py` (16 tokens), every rung of its budget ladder on
  disk, run for k = 1 … 32 passes;
- narrow byte-level language models trained at 1024 tokens on the standard library's sources
  (`configs/sweeps/depth_1024.py`), run for k = 1 … 1000 passes (the states become the exact
  recurrence at pass T = 1024).

For each k: held-out loss, and the relative per-pass change ‖Hᵏ − Hᵏ⁻¹‖ / ‖Hᵏ‖ over the positions
pass k can still change (`fbt_jax.evaluate.depth_sweep`); the contraction monitor's verdict for
passes 4–7 (`fbt_jax.contraction`).

The claim's effect, per sequence length and seed: how much more the {1, 2} model's loss grows
beyond its trained passes than the 75/22/3 model's (each as its loss at the deepest k over its loss
at its trained K, minus 1). The verdict follows `budget.judge`: where the two arms' losses settled
(the 16-token models: the state-tracking experiment's rule; the 1024-token models: K=1 and K=2
held-out loss within 2% over the last 20% of training), or (T=16) where the effect is stable over
the state-tracking ladder, reproduced where the effect is positive, beyond two standard errors and
beyond 5%. Each run's own reading (stable: contracting, and within
5% of its loss at the trained K) is shown beside it, per mixture.

    python experiments/depth_stability.py --write-docs docs/results.md
    python experiments/depth_stability.py --carry-long --write-docs docs/results.md  # T=16 alone, minutes

`--carry-long` keeps the 1024-token part (about 4 h of 2 cores to train and measure) as the block
an earlier invocation wrote it, and measures the 16-token ladder alone.
"""

from __future__ import annotations

import os
import re
from typing import Any

import budget
import common
import numpy as np
import state_tracking
import summary

from fbt_jax import contraction
from fbt_jax.data.pipeline import make_source
from fbt_jax.data.plan import plan_data
from fbt_jax.evaluate import depth_sweep
from fbt_jax.trained import load_model

NAME = "depth_stability"
LONG_SPEC = os.path.join(common.REPO, "configs", "sweeps", "depth_1024.py")
SCHEDULES = ("k12", "paper", "heavy")
TRAINED_K = {"k12": 2, "paper": 3, "heavy": 3}
LONG_RULES = (budget.Rule("loss_K1", 0.02, relative=True), budget.Rule("loss_K2", 0.02, relative=True))
TOLERANCE = 0.05  # the loss at the deepest k against the loss at the trained K


def sweep_depths(rows: list[dict[str, Any]], max_depth: int, num_sequences: int) -> None:
    """Adds each row's depth sweep and monitor verdict (passes 4–7) on held-out sequences."""
    for row in rows:
        model, config = load_model(row["workdir"], log=lambda *_: None)
        batch = make_source(plan_data(config), "validation").examples(np.arange(num_sequences))
        row["depth"] = depth_sweep(model, batch, max_depth, progress=False)
        sums = {f"{key}_{k}": row["depth"][key][k - 1] for key in ("change_sq", "state_sq") for k in range(4, 8)}
        row["monitor"] = contraction.summarize(sums, 4, 7)


def stable(row: dict[str, Any]) -> bool:
    """Contracting, and the loss at the deepest k within TOLERANCE of the loss at the trained K."""
    loss = row["depth"]["loss"]
    trained = loss[TRAINED_K[row["label.schedule"]] - 1]
    return bool(row["monitor"]["contracting"]) and loss[-1] <= (1 + TOLERANCE) * trained


EFFECT = "loss growth beyond the trained passes, {1, 2} − 75/22/3"


def growth(row: dict[str, Any]) -> float:
    """The loss at the deepest k over the loss at the trained K, minus 1."""
    loss = row["depth"]["loss"]
    return float(loss[-1] / loss[TRAINED_K[row["label.schedule"]] - 1] - 1)


def effect(rows: list[dict[str, Any]]) -> budget.Rung:
    """The claim's effect per seed (a seed's {1, 2} run against its 75/22/3 run)."""
    by_seed = {(r["label.schedule"], r["label.seed"]): growth(r) for r in rows}
    seeds = sorted(s for schedule, s in by_seed if schedule == "k12" and ("paper", s) in by_seed)
    values = tuple(by_seed[("k12", s)] - by_seed[("paper", s)] for s in seeds)
    return budget.Rung(rows[0]["config"].train.steps, values)


def verdict(
    rows: list[dict[str, Any]], settled: budget.Check, seq_len: int, ladder: list[budget.Rung] | None = None
) -> tuple[list[str], budget.Judgement]:
    """The verdict paragraphs for one sequence length (`settled`: the two compared arms' check at
    the top rung `rows`; `ladder`: the effect at every rung, where the models come from a ladder)."""
    judged = budget.judge(f"{EFFECT} (T={seq_len})", ladder or [effect(rows)], settled, minimum=TOLERANCE)
    counts = ", ".join(
        f"{schedule} {sum(stable(r) for r in seeds)} of {len(seeds)}"
        for schedule, seeds in common.by_label(rows, "schedule").items()
    )
    line = (
        f"verdict (T={seq_len}: {{1, 2}} diverges, 75/22/3 stays at its fixed point): stable models {counts}: "
        f"{judged.verdict}"
    )
    return [line, judged.line], judged


def loss_figures(rows: list[dict[str, Any]], seq_len: int) -> str:
    """Loss at the trained K → at the deepest k, per mixture."""
    parts = []
    for schedule, seeds in common.by_label(rows, "schedule").items():
        trained = [r["depth"]["loss"][TRAINED_K[schedule] - 1] for r in seeds]
        deepest = [r["depth"]["loss"][-1] for r in seeds]
        parts.append(f"{schedule} {common.mean_std(trained)} → {common.mean_std(deepest)}")
    depth = len(rows[0]["depth"]["loss"])
    return f"T={seq_len}, loss at the trained K → at k={depth}: " + ", ".join(parts)


def table(rows: list[dict[str, Any]], depths: list[int]) -> str:
    header = ["mixture", *[f"loss k={k}" for k in depths], *[f"change k={k}" for k in depths[1:]]]
    header += ["rate, passes 4–7", "contracting"]
    lines = []
    for schedule, seeds in common.by_label(rows, "schedule").items():
        cells = [schedule]
        cells += [common.mean_std([r["depth"]["loss"][k - 1] for r in seeds]) for k in depths]
        cells += [common.mean_std([r["depth"]["change"][k - 1] for r in seeds], 4) for k in depths[1:]]
        cells.append(common.mean_std([r["monitor"]["contraction_rate"] for r in seeds]))
        cells.append(f"{sum(int(r['monitor']['contracting']) for r in seeds)} of {len(seeds)}")
        lines.append(cells)
    return common.docs_block.table(header, lines)


def plot(parts: list[tuple[str, list[dict[str, Any]]]], path: str) -> None:
    plt = common.pyplot()
    fig, axes = plt.subplots(2, len(parts), figsize=(6 * len(parts), 8), squeeze=False)
    for column, (title, rows) in enumerate(parts):
        for i, (schedule, seeds) in enumerate(common.by_label(rows, "schedule").items()):
            for j, r in enumerate(seeds):
                ks = np.arange(1, len(r["depth"]["loss"]) + 1)
                label = schedule if j == 0 else None
                axes[0, column].semilogx(ks, r["depth"]["loss"], color=f"C{i}", alpha=0.7, label=label)
                change = np.maximum(r["depth"]["change"][1:], 1e-8)
                axes[1, column].loglog(ks[1:], change, color=f"C{i}", alpha=0.7, label=label)
        axes[0, column].set(title=title, xlabel="feedback depth k (passes)", ylabel="held-out loss")
        axes[1, column].set(xlabel="k", ylabel="‖Hᵏ − Hᵏ⁻¹‖ / ‖Hᵏ‖ (positions still open)")
        axes[0, column].legend()
        axes[1, column].legend()
    common.save_figure(fig, path)


CARRY = (
    "--carry-long",
    dict(action="store_true", help="keep the 1024-token part (its check, verdict, table and summary figures) from "
         "the block an earlier invocation wrote, instead of training and measuring it again (~4 h of 2 cores)"),
)  # fmt: skip


def earlier_long(args: Any, long_len: int) -> dict[str, Any]:
    """The T=`long_len` part of the block an earlier invocation wrote, and of its summary row: what
    --carry-long keeps. Fails before anything is measured where there is none."""
    if not args.write_docs:
        raise SystemExit(f"--carry-long needs --write-docs: the file whose {NAME} block holds the part to carry")
    begin, end = common.docs_block.markers(NAME, "experiments")
    text = open(args.write_docs, encoding="utf-8").read()
    row = summary.load_rows(args.write_docs).get(NAME)
    mark = f"T={long_len}"
    block = text.split(begin, 1)[1].split(end, 1)[0] if begin in text and end in text else ""
    paragraphs = [p.strip() for p in block.split("\n\n")]

    def first(*heads: str) -> int | None:
        return next((i for i, p in enumerate(paragraphs) if p.startswith(heads)), None)

    check = first(f"budget check: failed ({mark})", f"budget check: held ({mark})")
    verdict_at, table_at = first(f"verdict ({mark}:"), first(f"**Standard-library bytes at {mark}**")
    if row is None or None in (check, verdict_at, table_at) or f"; {mark}, " not in row.figures:
        raise SystemExit(f"--carry-long: {args.write_docs} has no {mark} part of the "
                         f"{NAME} block to carry; run without --carry-long")  # fmt: skip
    minutes = re.search(r"took (\d+) min of job time", block)
    steps = next(iter(row.effects), None)
    return dict(
        check=paragraphs[check], verdicts=paragraphs[verdict_at : verdict_at + 2],
        table=paragraphs[table_at : table_at + 2], minutes=int(minutes.group(1)) if minutes else None,
        figures=f"{mark}, " + row.figures.split(f"; {mark}, ", 1)[1],
        held=paragraphs[check].startswith("budget check: held"),
        verdict=row.verdict.split(f"; {mark}: ", 1)[1], criterion=row.criterion.split(f"; {mark}: ", 1)[1],
        effects=row.effects, commits={steps: row.commits.get(steps, summary.UNRECORDED)} if steps else {},
    )  # fmt: skip


def short_ladder_table(ladder: list[list[dict[str, Any]]], codes: dict[str, str]) -> str:
    """T=16 at every rung of the state-tracking ladder on disk: each arm's loss growth, the effect."""
    header = ["steps", "k12 growth", "paper growth", "{1, 2} − 75/22/3", "stable models", "code"]
    lines = []
    for rows in ladder:
        arms, rung = common.by_label(rows, "schedule"), effect(rows)
        counts = ", ".join(
            f"{schedule} {sum(stable(r) for r in seeds)} of {len(seeds)}" for schedule, seeds in arms.items()
        )
        growths = [common.mean_std([growth(r) for r in arms[s]]) for s in ("k12", "paper")]
        lines.append([str(rung.steps), *growths, common.mean_std(rung.values), counts, codes[str(rung.steps)]])
    return common.docs_block.table(header, lines)


def measure_long(args: Any, long_len: int, long_depth: int) -> dict[str, Any]:
    """Train (or finish) the 1024-token models and measure them: the long part of the block."""
    long_spec = LONG_SPEC
    if args.smoke:  # two mixtures on the modules a–c: a quick check that it runs
        long_spec = common.smoke_spec(LONG_SPEC, args.sweeps_dir, ("k12", "paper"), data__seq_len=long_len)
    prepared = common.prepare_stdlib(
        os.path.join(args.dir, f"prepared-{long_len}"), long_len, "[a-c]*.py" if args.smoke else "*.py"
    )
    # Smoke: the two mixtures draw the same passes over all their few steps, so fbt-sweep would
    # train the whole run as a shared trunk and give each mixture a job that only evaluates; one
    # job each instead (no trunk at all: a minimum beyond the run).
    unshared = dict(min_shared_steps=common.SMOKE_OVERRIDES["train.steps"] + 1) if args.smoke else {}
    long = common.run_sweep(
        long_spec, os.path.join(args.dir, "depth_1024"), overrides=[f"data.path={prepared}"], **unshared
    )
    sizes = common.load_spec(long_spec)["overrides"]
    check = budget.check(long, LONG_RULES, f"T={long_len}")
    compared = [r for r in long if r["label.schedule"] in ("k12", "paper")]
    sweep_depths(long, long_depth, 2)  # 1000 passes over 1024 positions: two sequences keep it to minutes
    lines, judged = verdict(long, budget.check(compared, LONG_RULES, f"T={long_len}, k12 and paper"), long_len)
    depths = [1, 2, 3, 4, 8, 32, 128, long_depth] if not args.smoke else [1, 2, 3, 4, 8, long_depth]
    rung = effect(long)
    return dict(
        rows=long, check=check.line, held=check.held, verdicts=lines, verdict=judged.verdict,
        criterion=judged.criterion or "neither", figures=loss_figures(long, long_len),
        minutes=round(common.sweep_minutes(os.path.join(args.dir, "depth_1024"))),
        table=[f"**Standard-library bytes at T={long_len}** (width {sizes['model.embed_dim']}, 2 layers, "
               f"{sizes['train.steps']} steps of {sizes['train.batch_size']} sequences), k = 1 … {long_depth}:",
               table(long, depths)],
        effects={str(rung.steps): list(rung.values)}, commits={str(rung.steps): common.rows_code(long)},
    )  # fmt: skip


def main() -> None:
    args = common.arguments(__doc__, NAME, extra=[CARRY])
    timer = common.Timer()
    short_len, long_len = 16, (64 if args.smoke else 1024)
    long_depth = 60 if args.smoke else 1000
    carried = earlier_long(args, long_len) if args.carry_long else None  # before anything is measured
    # The 16-token models are the state-tracking experiment's (trained there, or here if not yet),
    # every rung of its ladder on disk: the T=16 claim is judged over that ladder.
    ladder = [
        [r for r in rows if r["label.run"] == "S3" and r["label.schedule"] in SCHEDULES]
        for rows in common.state_tracking_ladder(args)
    ]
    short = ladder[-1]
    for rows in ladder:
        sweep_depths(rows, 2 * short_len, 64)
    short_check = state_tracking.budget_check(short, f"T={short_len}, the state-tracking models")
    compared = [r for r in short if r["label.schedule"] in ("k12", "paper")]
    settled = state_tracking.budget_check(compared, f"T={short_len}, k12 and paper")
    short_effects = [effect(rows) for rows in ladder]
    short_lines, short_judged = verdict(short, settled, short_len, short_effects)
    codes = {str(rung.steps): common.rows_code(rows) for rung, rows in zip(short_effects, ladder)}
    long = carried or measure_long(args, long_len, long_depth)
    figure = common.plot_path(args, NAME)
    parts = [(f"S3, trained at T={short_len}", short)]
    parts += [] if carried else [(f"stdlib bytes, trained at T={long_len}", long["rows"])]
    plot(parts, figure)
    seeds = len(common.by_label(short, "schedule")["paper"])
    source = (
        f"the T={long_len} part (its check, verdict and table) is carried from the block an earlier invocation "
        f"wrote (`--carry-long`; its models took {long['minutes']} min of job time to train), and the plot shows "
        f"T={short_len} alone"
        if carried
        else f"training the {long_len}-token models took {long['minutes']} min of job time (two jobs at a time)"
    )
    steps = short[0]["config"].train.steps
    body = [
        f"Written by `python experiments/{NAME}.py{' --smoke' if args.smoke else ''}"
        f"{' --carry-long' if carried else ''}` on {common.machine()} in {timer.minutes():.1f} min of wall time; "
        f"{source}; the 16-token models are `experiments/state_tracking.py`'s, every rung of its ladder on disk. "
        f"Mean ± std over {seeds} seeds; loss on 64 (T={short_len}) and 2 (T={long_len}) held-out sequences; the "
        "change is measured over the positions pass k can still change.",
        "",
        f"{short_check.line}\n",
        f"{long['check']}\n",
        *[line + "\n" for line in (*short_lines, *long["verdicts"])],
        f"**S3 at T={short_len}, the state-tracking ladder** (loss growth: the loss at k={2 * short_len} over the "
        "loss at the trained K, minus 1; `code`: the commit the models were trained and measured at):\n",
        short_ladder_table(ladder, codes),
        "",
        f"**S3 at T={short_len}, {steps} steps** (width 64, 2 layers), k = 1 … {2 * short_len}:\n",
        table(short, [1, 2, 3, 4, 8, short_len, 2 * short_len]),
        "",
        f"{long['table'][0]}\n",
        long["table"][1],
        "",
        common.figure_line(args, figure, "loss and per-pass change against feedback depth"),
    ]
    common.finish(args, NAME, "\n".join(body))
    ladder_figures = ", ".join(f"{rung.steps} steps {rung.mean:+.3f}" for rung in short_effects)
    row = summary.Row(
        f"{loss_figures(short, short_len)} at {steps} steps, {{1, 2}} − 75/22/3 growth over the ladder: "
        f"{ladder_figures}; {long['figures']}",
        f"k12 and paper settled (T={short_len}: the state-tracking rule, §1, or the effect stable over its ladder; "
        f"T={long_len}: K=1 and K=2 loss within 2%, over the last 20% of steps)",
        short_check.held and long["held"],
        f"T={short_len}: {short_judged.verdict}; T={long_len}: {long['verdict']}",
        criterion=f"T={short_len}: {short_judged.criterion or 'neither'}; T={long_len}: {long['criterion']}",
        effect=f"{EFFECT} (T={long_len})",
        effects=long["effects"],  # the claim's deep end: T=1024
        commits=long["commits"],
    )
    summary.record(args, NAME, row)


if __name__ == "__main__":
    main()
