"""Pass mixtures on state tracking: held-out accuracy and loss per eval K and per decoding mode.

Trains `configs/sweeps/state_tracking.py` (the S3 word problem; K = 1 only, {1, 2}, the paper's
75/22/3 and a heavier 50/25/25 mixture; three seeds) and evaluates every final checkpoint on 256
held-out sequences:

- per eval K (the K-pass forward, fully fused from position 1), from the runs' own final eval;
- per decoding mode (standard, soft, fused), inputs teacher-forced after a 4-token prompt
  (`fbt_jax.evaluate.mode_metrics`), scored on the positions after the prompt.

The claim's effect is soft − standard decoding accuracy of the paper's 75/22/3 arm, per seed. The
verdict follows `budget.judge`: where that arm's held-out K=1 accuracy moved by less than 0.01, its
K=1 and K=2 losses by less than 2% over the last 20% of training (settled), or where the effect is
stable over a budget ladder of at least 2.5×. The budget check of every arm is still shown (an arm
still moving is reported beside the verdict, not hidden). Until one criterion holds, the experiment
climbs the ladder: the same sweep at 2.5× and then 5× the steps (`--ladder`), each in its own
directory; each rung's check and verdict are shown, and the per-seed effects go to summary.json.
A rung an earlier invocation measured keeps its row (carried from the block it wrote), so that
`--ladder=2.5` can climb one rung in a later session, on a machine that kept none of the runs. An
explicit `--ladder` measures every rung it names (`--ladder=1,2.5,5`: the whole ladder at one
commit), while the default climbs only until the verdict rule decides.

    python experiments/state_tracking.py --write-docs docs/results.md
"""

from __future__ import annotations

import math
import re
from typing import Any

import budget
import common
import numpy as np
import scales
import summary

from fbt_jax.data.pipeline import make_source
from fbt_jax.data.plan import plan_data
from fbt_jax.data.tasks import prompt_length
from fbt_jax.evaluate import mode_metrics
from fbt_jax.trained import load_model

NAME = "state_tracking"
MODES = ("standard", "soft", "fused")


def evaluate_modes(row: dict[str, Any], num_sequences: int) -> dict[str, dict[str, float]]:
    model, config = load_model(row["workdir"], log=lambda *_: None)
    batch = make_source(plan_data(config), "validation").examples(np.arange(num_sequences))
    return mode_metrics(model, batch, prompt_len=prompt_length(config.data.seq_len))


RULES = (budget.Rule("accuracy_K1", 0.01), budget.Rule("loss_K1", 0.02, relative=True))
FEEDBACK_RULES = (budget.Rule("loss_K2", 0.02, relative=True),)


def budget_check(rows: list[dict[str, Any]], what: str = "") -> budget.Check:
    """Every arm's K=1 accuracy and loss, and the feedback arms' K=2 loss, settled (see the module doc)."""
    return budget.check_with_feedback(rows, RULES, FEEDBACK_RULES, what)


RULE_TEXT = "every arm's K=1 accuracy within 0.01 and K=1 loss within 2%, the feedback arms' K=2 loss within 2%"


def mode_accuracy(rows: list[dict[str, Any]], schedule: str, mode: str) -> np.ndarray:
    return np.array([r["modes"][mode]["accuracy"] for r in rows if r["label.schedule"] == schedule])


EFFECT = "soft − standard accuracy (75/22/3)"
MINIMUM = 0.02  # a gain below two points of accuracy does not reproduce the claim


def effect(rows: list[dict[str, Any]]) -> budget.Rung:
    """The claim's effect at one rung, per seed."""
    gains = mode_accuracy(rows, "paper", "soft") - mode_accuracy(rows, "paper", "standard")
    return budget.Rung(rows[0]["config"].train.steps, tuple(float(g) for g in gains))


def compared_check(rows: list[dict[str, Any]], what: str) -> budget.Check:
    """The budget check of what the effect is computed from: the paper arm's quantities."""
    return budget_check([r for r in rows if r["label.schedule"] == "paper"], what)


def earlier_effect(rung: dict[str, Any], recorded: dict[str, Any]) -> budget.Rung:
    """A carried rung's effect: its per-seed values where summary.json kept them, else its mean,
    sample std and seeds (from summary.json, or the ladder row's `mean ± std` of the sweep's three
    seeds): all the rule reads."""
    kept = recorded.get(str(rung["steps"]))
    if kept is not None:
        return budget.Rung.from_record(rung["steps"], kept)
    mean, std = (float(x) for x in rung["rows"][0][LADDER_HEADER.index("soft − standard")].split(" ± "))
    return budget.Rung(rung["steps"], summary=(mean, std, 3))


def verdict(rows: list[dict[str, Any]], judged: budget.Judgement, check: budget.Check) -> tuple[str, summary.Row]:
    """The verdict line and summary row at the top rung so far (`judged` over every rung)."""
    gains = np.array(effect(rows).values)
    said = judged.verdict
    line = (
        f"verdict (the paper's 75/22/3 mixture decodes S3 better with latent feedback): soft − standard accuracy "
        f"{common.mean_std(gains)} over {len(gains)} seeds: {said}"
    )
    figures = (
        f"S3, {size(rows[0]['config'])}, {rows[0]['config'].train.steps} steps, {len(gains)} seeds, held-out accuracy after a 4-token prompt: "
        f"75/22/3 standard {common.mean_std(mode_accuracy(rows, 'paper', 'standard'))}, soft "
        f"{common.mean_std(mode_accuracy(rows, 'paper', 'soft'))} (soft − standard {common.mean_std(gains)})"
    )
    heavy = [r for r in rows if r["label.schedule"] == "heavy"]
    if heavy:
        figures += (
            f"; 50/25/25 standard {common.mean_std(mode_accuracy(rows, 'heavy', 'standard'))}, fused "
            f"{common.mean_std(mode_accuracy(rows, 'heavy', 'fused'))}"
        )
    rule = f"{RULE_TEXT}, over the last 20% of steps (the 75/22/3 arm: settled), or the effect stable over a ladder"
    return line, summary.Row(figures, rule, check.held, said, criterion=judged.criterion, effect=EFFECT)


def size(config: Any) -> str:
    """'width 64, 2 layers, batch 32 × 16 tokens': what the runs trained, from their own config."""
    model = config.model
    return (f"width {model.embed_dim}, {model.num_layers} layers, batch {config.train.batch_size} × "
            f"{config.data.seq_len} tokens")  # fmt: skip


def tables(rows: list[dict[str, Any]]) -> str:
    out = []
    for group, members in common.by_label(rows, "run").items():
        for metric, title in (("accuracy", "accuracy (higher is better)"), ("loss", "loss (nats)")):
            header = ["mixture", "mean K"] + [f"K={k}" for k in (1, 2, 3)] + list(MODES)
            lines = []
            for schedule, seeds in common.by_label(members, "schedule").items():
                cells = [schedule, f"{np.mean([r['mean_num_passes'] for r in seeds]):.2f}"]
                cells += [common.mean_std([r[f"final_{metric}_K{k}"] for r in seeds]) for k in (1, 2, 3)]
                cells += [common.mean_std([r["modes"][m][metric] for r in seeds]) for m in MODES]
                lines.append(cells)
            out.append(f"**{group}, held-out {title}**, mean ± std over {len(seeds)} seeds:\n")
            out.append(common.docs_block.table(header, lines) + "\n")
    return "\n".join(out)


def monitor_table(rows: list[dict[str, Any]]) -> str:
    """The contraction monitor at each run's final eval: the passes just beyond its trained K."""
    header = ["task", "mixture", "passes", "first change", "last change", "rate per pass", "contracting"]
    lines = []
    for group, members in common.by_label(rows, "run").items():
        for schedule, seeds in common.by_label(members, "schedule").items():
            finals = [r["curve"][-1][1] for r in seeds]
            passes = sorted(int(k.removeprefix("pass_change_K")) for k in finals[0] if k.startswith("pass_change_K"))
            first, last = passes[0], passes[-1]
            lines.append(
                [
                    group,
                    schedule,
                    f"{first}–{last}",
                    common.mean_std([f[f"pass_change_K{first}"] for f in finals]),
                    common.mean_std([f[f"pass_change_K{last}"] for f in finals]),
                    common.mean_std([f["contraction_rate"] for f in finals]),
                    f"{sum(int(f['contracting']) for f in finals)} of {len(finals)}",
                ]
            )
    return common.docs_block.table(header, lines)


def plot(rows: list[dict[str, Any]], path: str) -> None:
    plt = common.pyplot()
    groups = common.by_label(rows, "run")
    fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 4), squeeze=False)
    columns = [f"K={k}" for k in (1, 2, 3)] + list(MODES)
    for ax, (group, members) in zip(axes[0], groups.items()):
        schedules = common.by_label(members, "schedule")
        width = 0.8 / len(schedules)
        for i, (schedule, seeds) in enumerate(schedules.items()):
            values = [[r[f"final_accuracy_K{k}"] for r in seeds] for k in (1, 2, 3)]
            values += [[r["modes"][m]["accuracy"] for r in seeds] for m in MODES]
            x = np.arange(len(columns)) + i * width
            ax.bar(x, [np.mean(v) for v in values], width, yerr=[np.std(v) for v in values], label=schedule)
        ax.set_xticks(np.arange(len(columns)) + 0.4 - width / 2, columns)
        ax.set(title=f"{group} word problem, held-out accuracy", ylabel="accuracy")
        ax.legend(fontsize=8)
    common.save_figure(fig, path)


LADDER = ",".join(f"{f:g}" for f in common.LADDER)  # multiples of the spec's 6000 steps, climbed until the check holds
SMOKE_LADDER = ",".join(f"{f:g}" for f in common.SMOKE_LADDER)


def rung_factors(rungs: list[dict[str, Any]], base_steps: float) -> str:
    """'×1, ×2.5': the budget multiples of the rungs shown."""
    return ", ×".join(f"{r['steps'] / base_steps:g}" for r in rungs)


LADDER_HEADER = ["steps", "budget check", "75/22/3 standard", "75/22/3 soft", "soft − standard", "verdict"]


def ladder_cells(rung: dict[str, Any]) -> list[str]:
    """The paper mixture's decoding gain at one rung of the ladder, with that rung's check and verdict."""
    rows = rung["rows"]
    standard, soft = mode_accuracy(rows, "paper", "standard"), mode_accuracy(rows, "paper", "soft")
    held = "held" if rung["check"].held else "failed"
    return [str(rung["steps"]), held, common.mean_std(standard), common.mean_std(soft),
            common.mean_std(soft - standard), rung["said"]]  # fmt: skip


def code_note(codes: dict[str, str]) -> str:
    """'Every rung was trained and evaluated by the code of commit X.', or each rung's code where they differ."""
    if len(set(codes.values())) == 1:
        return f"Every rung was trained and evaluated by the code of commit {next(iter(codes.values()))}."
    return "The rungs' code: " + "; ".join(f"{steps} steps: {code}" for steps, code in codes.items()) + "."


def main() -> None:
    ladder = ("--ladder", dict(default="", help=f"budget multiples to measure, every one (default: {LADDER}, "
                                                "climbed until the verdict rule decides)"))  # fmt: skip
    args = common.arguments(__doc__, NAME, extra=[ladder, scales.OPTION])
    factors = [float(f) for f in (args.ladder or (SMOKE_LADDER if args.smoke else LADDER)).split(",")]
    num_sequences = 32 if args.smoke else 256
    base_steps = 0.0
    rungs: list[dict[str, Any]] = []
    earlier: list[dict[str, Any]] = []
    recorded = summary.load_effects(args, NAME, scales.variant(args))
    for factor in factors:  # each rung is trained only while no criterion has decided the claim
        rows = common.state_tracking_runs(args, factor)
        timer = common.Timer()
        for row in rows:
            row["modes"] = evaluate_modes(row, num_sequences)
        steps = rows[0]["config"].train.steps
        base_steps = steps / factor
        rung_steps = {round(f * base_steps) for f in common.LADDER}
        earlier = common.earlier_rungs(
            args, NAME, len(LADDER_HEADER), rung_steps, {r["steps"] for r in rungs} | {steps}
        )
        effects = [earlier_effect(r, recorded) for r in earlier] + [effect(r["rows"]) for r in rungs] + [effect(rows)]
        # A rung's own verdict reads the ladder up to it; the last one, below, the whole ladder.
        upto = [e for e in effects if e.steps <= steps]
        judged = budget.judge(EFFECT, upto, compared_check(rows, f"{steps} steps"), minimum=MINIMUM)
        check = budget_check(rows, f"{steps} steps")
        line, summary_row = verdict(rows, judged, check)
        minutes = common.sweep_minutes(common.state_tracking_dir(args, factor))
        rungs.append(dict(rows=rows, steps=steps, check=check, line=line, said=summary_row.verdict, judged=judged,
                          row=summary_row, train=minutes, evaluate=timer.minutes()))  # fmt: skip
        if judged.criterion and not args.ladder:  # decided: no higher rung unless one was asked for
            break
    last = rungs[-1]
    if len(effects) > len(upto):  # rungs above the last one measured, carried: the verdict reads them too
        judged = budget.judge(EFFECT, effects, compared_check(last["rows"], f"{last['steps']} steps"), minimum=MINIMUM)
        line, summary_row = verdict(last["rows"], judged, last["check"])
        last.update(line=line, said=summary_row.verdict, judged=judged, row=summary_row)
    for rung in rungs:
        rung.update(cells=ladder_cells(rung), paragraphs=[rung["check"].line, rung["line"]])
    for rung in earlier:  # its timing, as the block that measured it gave it
        timing = re.search(
            rf"{rung['steps']} steps: (\d+) min of job time, the mode evaluations ([\d.]+) min", rung["block"]
        )
        rung.update(train=float(timing.group(1)) if timing else math.nan, cells=rung["rows"][0],
                    evaluate=float(timing.group(2)) if timing else math.nan)  # fmt: skip
    shown = sorted(earlier + rungs, key=lambda r: r["steps"])
    figure = common.plot_path(args, NAME)
    plot(last["rows"], figure)
    timings = "; ".join(
        f"{r['steps']} steps: {r['train']:.0f} min of job time, the mode evaluations {r['evaluate']:.1f} min"
        for r in shown
    )
    carried = common.carried_note(earlier)
    if earlier:
        carried += " Their verdicts are as written then; the verdict rule's paragraph judges the whole ladder."
    kept_codes = summary.load_commits(args, NAME, scales.variant(args))
    codes = {str(r["steps"]): kept_codes.get(str(r["steps"]), summary.UNRECORDED) for r in earlier}
    codes |= {str(r["steps"]): common.rows_code(r["rows"]) for r in rungs}
    carried += " " + code_note(codes)
    scale = scales.of(args)
    flags = "".join(f" {flag}" for flag in (scales.variant(args), "--smoke" if args.smoke else "") if flag)
    overrides = "".join(f" --override={o}" for o in scale.sweep_overrides())
    body = [
        f"Written by `python experiments/{NAME}.py{flags}` on {common.machine()}: "
        f"{len(last['rows'])} runs per budget ({size(last['rows'][0]['config'])}), trained by "
        f"`fbt-sweep run configs/sweeps/{NAME}.py{overrides} --parallel={scale.parallel}` ({scale.about}); budget ladder "
        f"×{rung_factors(shown, base_steps)}, climbed until the verdict rule decides "
        f"({timings}); the modes are evaluated on {num_sequences} held-out sequences.{carried}",
        "",
        *[f"{paragraph}\n" for rung in shown for paragraph in rung["paragraphs"]],
        f"{last['judged'].line}\n",
        "The budget ladder, the paper's mixture (accuracy after a 4-token prompt):\n",
        common.docs_block.table(LADDER_HEADER, [rung["cells"] for rung in shown]),
        "",
        f"Every mixture at {last['steps']} steps:\n",
        tables(last["rows"]),
        "The contraction monitor at the final eval (`eval.jsonl`: the relative per-pass change of the 4 passes after "
        "the largest K each mixture trained, over all eval sequences; contracting = rate below 1 and last change "
        "below 1):\n",
        monitor_table(last["rows"]),
        "",
        common.figure_line(args, figure, "held-out accuracy per eval K and decoding mode"),
    ]
    common.finish(args, NAME, "\n".join(body))
    row = last["row"]
    rule = f"{row.rule} (ladder ×{rung_factors(shown, base_steps)})"
    effects = {**recorded, **{str(r["steps"]): effect(r["rows"]).record() for r in rungs}}
    for rung in earlier:  # only a summary survives of a rung whose runs and per-seed values are gone
        effects.setdefault(str(rung["steps"]), earlier_effect(rung, recorded).record())
    ladder_figures = ", ".join(
        f"{r['steps']} steps {r['cells'][LADDER_HEADER.index('soft − standard')]}" for r in shown
    )
    figures = f"{row.figures}; soft − standard over the ladder: {ladder_figures}" if len(shown) > 1 else row.figures
    row = summary.Row(figures, rule, row.held, row.verdict, criterion=row.criterion, effect=EFFECT, effects=effects,
                      commits=codes)  # fmt: skip
    summary.record(args, NAME, row, scales.variant(args))


if __name__ == "__main__":
    main()
