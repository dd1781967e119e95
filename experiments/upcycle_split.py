"""Upcycling at CPU scale: does a model trained K=1 for 75% of a run, exported to Hugging Face,
imported back and given the last 25% as a feedback phase come as close as the same schedule
trained in one run? The optimizer state is lost at the export (Adam's moments start again, with
a short warmup to the learning rate the one run had at that step, then the same decay).

Per seed, a byte-level language model on this Python's standard library sources (configs/tiny.py's
D=64 two-layer model, 128-byte records, no logit scale, so that the export is an ordinary Llama):
the one run with the paper's schedule (75% K=1, then K=2 88% / K=3 12%), stopped at 75% and
exported there; three feedback phases of the remaining 25% from that export: imported with its
fbt files (the fusion restored bitwise: still at its initialisation, since K=1 never reaches it),
and as a plain Hugging Face Llama (as one from the hub) with the fusion initialised `readout` or
`random`. The held-out K=2 loss at each phase's step 0 against K=1's shows what each fusion
initialisation starts from, and the first eval where K=2 is below K=1 how fast the phase recovers.

    python experiments/upcycle_split.py [--smoke] [--write-docs docs/results.md]
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import shutil
import subprocess
import sys
from typing import Any

import budget
import common
import summary

NAME = "upcycle_split"
LATE = "0:2=0.88,3=0.12"  # the paper's late-phase mixture
ARMS = ("fbt", "readout", "random")  # how the export is imported for the feedback phase
TEXT = (  # every run: text_efficiency's model and data, no logit scale (nothing to fold at the export)
    "--config.data.source=text", "--config.data.seq_len=128", "--config.model.vocab_size=257",
    "--config.model.scale_logits=False", "--config.train.batch_size=16", "--config.train.log_every=25",
    "--config.optimizer.warmup_steps=30", "--config.eval.batch_size=32", "--config.eval.num_batches=4",
    "--config.eval.contraction_passes=0",
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Sizes:
    steps: int
    seeds: tuple[int, ...]
    eval_every: int  # the feedback phases'
    warmup: int  # the feedback phases'
    extra: tuple[str, ...] = ()  # overrides of every run (after TEXT)
    arms: tuple[str, ...] = ARMS


FULL = Sizes(
    steps=5600, seeds=(0, 1, 2), eval_every=25, warmup=25
)  # a 1400-step phase: the 700-step phase (2800 steps) left the K=2 loss moving 2.2%, its trend asked for ~1400
SMOKE = Sizes(steps=16, seeds=(0,), eval_every=2, warmup=2, extra=(
    "--config.optimizer.warmup_steps=2", "--config.eval.num_batches=1", "--config.train.batch_size=4"),
    arms=("readout",))  # fmt: skip


def train(workdir: str, *overrides: str) -> None:
    command = ["fbt-train", "--config=configs/tiny.py", f"--config.workdir={workdir}", *overrides]
    print("$ " + " ".join(command), flush=True)
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, cwd=common.REPO)


def evals(workdir: str) -> list[dict[str, Any]]:
    with open(os.path.join(workdir, "eval.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def tiny_config(overrides: list[str] | tuple[str, ...] = ()) -> Any:
    """configs/tiny.py with `--config.a.b=value` overrides applied as fbt-train applies them."""
    sys.path.insert(0, os.path.join(common.REPO, "configs"))
    import tiny

    config = tiny.get_config()
    for override in overrides:
        key, value = override.removeprefix("--config.").split("=", 1)
        *sections, field = key.split(".")
        section = config
        for name in sections:
            section = section[name]
        current = section[field]
        section[field] = (value == "True") if isinstance(current, bool) else type(current)(value)
    return config


def tail_config(sizes: Sizes, base: list[str], seed: int, imported: str) -> list[str]:
    """The feedback phase: the one run's last 25% from the imported model, its learning rate taken
    from the one run's schedule at 75%, decaying to the same end value."""
    from fbt_jax.train.step import make_optimizer

    one = tiny_config([*base, f"--config.train.steps={sizes.steps}"])
    start_lr = float(make_optimizer(one)[1](sizes.steps * 3 // 4))
    end_lr = one.optimizer.learning_rate * one.optimizer.min_learning_rate_ratio
    overrides = [
        *base,
        f"--config.seed={seed}",
        f"--config.init_from={imported}",
        f"--config.train.steps={sizes.steps // 4}",
        f"--config.passes.schedule={LATE}",
        f"--config.optimizer.learning_rate={start_lr}",
        f"--config.optimizer.min_learning_rate_ratio={end_lr / start_lr}",
        f"--config.optimizer.warmup_steps={sizes.warmup}",
        f"--config.eval.every_steps={sizes.eval_every}",
        f"--config.checkpoint.every_steps={sizes.steps // 4}",
    ]
    return overrides


def step0(overrides: list[str], workdir: str) -> dict[str, float]:
    """The held-out losses of the imported model before the feedback phase's first step."""
    from fbt_jax.train.trainer import Trainer

    config = tiny_config([f"--config.workdir={workdir}", *overrides])
    trainer = Trainer(config, log=lambda *a: None)
    trainer.restore_or_init(None)
    trainer.compile(pass_counts=())
    return trainer.evaluate()


def run_seed(sizes: Sizes, root: str, seed: int) -> dict[str, Any]:
    from fbt_jax.interop import exporter, importer

    quiet = lambda *a: None  # noqa: E731
    base = os.path.join(root, f"{sizes.steps}-steps", f"seed{seed}")  # each budget its own runs
    one = os.path.join(base, "one")
    data_path = common.prepare_stdlib(os.path.join(root, "prepared"), 128)
    base_args = [*TEXT, f"--config.data.path={data_path}", *sizes.extra]
    common_args = [*base_args, f"--config.seed={seed}", f"--config.train.steps={sizes.steps}",
                   f"--config.checkpoint.every_steps={sizes.steps // 4}", f"--config.eval.every_steps={sizes.steps // 4}"]  # fmt: skip
    train(one, *common_args, f"--config.train.stop_at_step={sizes.steps * 3 // 4}")  # phase 1
    hf, plain = os.path.join(base, "hf"), os.path.join(base, "hf-plain")
    if not os.path.isdir(hf):
        exporter.export_run(one, hf, log=quiet)
    if not os.path.isdir(plain):  # the same export without the fbt files: an ordinary Llama
        shutil.copytree(hf, plain + ".tmp", ignore=shutil.ignore_patterns("fbt_*"))
        os.rename(plain + ".tmp", plain)
    boundary = next(row for row in evals(one) if row["step"] == sizes.steps * 3 // 4)
    train(one, *common_args)  # the one run continues to its end
    out: dict[str, Any] = {"one": evals(one)[-1], "boundary": boundary}
    for arm in sizes.arms:
        imported = os.path.join(base, f"imported-{arm}")
        if not os.path.isfile(os.path.join(imported, "config.json")):
            shutil.rmtree(imported, ignore_errors=True)
            importer.import_model(
                hf if arm == "fbt" else plain, imported, fusion_init=arm if arm != "fbt" else "readout", log=quiet
            )
        workdir = os.path.join(base, f"tail-{arm}")
        overrides = tail_config(sizes, base_args, seed, imported)
        out[f"step0_{arm}"] = step0(overrides, workdir)
        train(workdir, *overrides)
        out[arm] = evals(workdir)
    return out


def job_minutes(root: str, steps: int) -> float:
    """Every run's wall time at budget `steps`, all attempts, from their goodput ledgers (a rerun
    that finds the runs finished adds only its few seconds)."""
    ledgers = glob.glob(os.path.join(root, f"{steps}-steps", "seed*", "*", "goodput.jsonl"))
    return sum(json.loads(line)["wall_seconds"] for path in ledgers for line in open(path, encoding="utf-8")) / 60


def said_rung(rung: budget.Rung) -> str:
    """A rung's effect as the block gives it: per seed, or mean ± std where only those were kept."""
    if rung.values:
        return ", ".join(f"{v:+.4f}" for v in rung.values)
    return f"{rung.mean:+.4f} ± {rung.summary[1]:.4f} ({rung.seeds} seeds)"


def first_below(curve: list[dict[str, Any]]) -> int | None:
    return next((row["step"] for row in curve if row["loss_K2"] < row["loss_K1"]), None)


RULE = budget.Rule("loss_K2", 0.02, relative=True)
NO_COST = 0.01  # nats/byte: the split may be worse than the one run by at most this (or twice its spread)


def budget_check(results: list[dict[str, Any]], arms: tuple[str, ...]) -> budget.Check:
    """The feedback phases' K=2 loss settled: a split that merely has not caught up yet is a budget."""
    phases = [
        {"run": f"{arm}, seed {i}", "label.arm": arm, "label.seed": i, "curve": [(row["step"], row) for row in r[arm]]}
        for i, r in enumerate(results)
        for arm in arms
    ]
    check = budget.check(phases, (RULE,), "feedback phases")
    # The trend's budget is the phase's; the run that phase ends is four times as long (75% + 25%).
    phase = check.suggested_steps
    return dataclasses.replace(
        check, advice=f"the trend points to a feedback phase of about {phase} steps, a {4 * phase}-step run"
    )


EFFECT = "split − one run, final K=2 loss"


def judged(rungs: list[budget.Rung], results: list[dict[str, Any]], arm: str) -> budget.Judgement:
    """No cost: the split's final K=2 loss (per seed, against the one run's) lies below the one run's
    + NO_COST by two standard errors at the top rung; decided where the compared phase (the `arm`
    import) settled, or over the ladder of `rungs` (the budgets measured before, then this one)."""
    settled = budget_check(results, (arm,))
    return budget.judge(f"{EFFECT} ({arm} import)", rungs, settled, at_most=NO_COST)


def main() -> None:
    args = common.arguments(__doc__, NAME)
    sizes = SMOKE if args.smoke else FULL
    timer = common.Timer()
    root = os.path.abspath(args.dir)  # the in-process steps take absolute paths, as the commands make them
    runs = os.path.join(root, f"{sizes.steps}-steps")  # this budget's runs: every invocation may train there
    common.stamp_training(runs, common.code_version(), begun=os.path.isdir(runs))
    results = [run_seed(sizes, root, seed) for seed in sizes.seeds]
    rows = []
    tail = ((f"75% + export/import ({a}) + 25%", a) for a in sizes.arms)
    for label, key in ((f"one run ({sizes.steps} steps)", "one"), *tail):
        finals = [r[key] if key == "one" else r[key][-1] for r in results]
        rows.append([label, *(common.mean_std([f[f"loss_K{k}"] for f in finals]) for k in (1, 2, 3)),
                     *(common.mean_std([f[f"accuracy_K{k}"] for f in finals]) for k in (1, 2))])  # fmt: skip
    table = common.docs_block.table(["run", "loss K=1", "loss K=2", "loss K=3", "accuracy K=1", "accuracy K=2"], rows)
    start_rows = [["(the one run at that step)", common.mean_std([r["boundary"]["loss_K1"] for r in results]),
                   common.mean_std([r["boundary"]["loss_K2"] for r in results]), ""]]  # fmt: skip
    for arm in sizes.arms:
        s0 = [r[f"step0_{arm}"] for r in results]
        below = [first_below(r[arm]) for r in results]
        start_rows.append([arm, common.mean_std([s["loss_K1"] for s in s0]), common.mean_std([s["loss_K2"] for s in s0]),
                           ", ".join("never" if b is None else str(b) for b in below)])  # fmt: skip
    start = common.docs_block.table(
        ["import", "step 0: loss K=1", "step 0: loss K=2", "first eval with K=2 < K=1 (per seed)"], start_rows
    )
    first = sizes.arms[0]
    diffs = [r[first][-1]["loss_K2"] - r["one"]["loss_K2"] for r in results]
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for arm, color in zip(sizes.arms, ("C0", "C1", "C2")):
        for r in results:
            steps = [row["step"] for row in r[arm]]
            ax.plot(
                steps,
                [row["loss_K2"] for row in r[arm]],
                color=color,
                alpha=0.8,
                label=f"{arm} K=2" if r is results[0] else None,
            )
            ax.plot(
                steps,
                [row["loss_K1"] for row in r[arm]],
                color=color,
                alpha=0.4,
                ls="--",
                label=f"{arm} K=1" if r is results[0] else None,
            )
    ax.set_xlabel("feedback-phase step")
    ax.set_ylabel("held-out loss")
    ax.legend(fontsize=7)
    path = common.plot_path(args, NAME)
    common.save_figure(fig, path)
    body = (
        f"Written by `python experiments/{NAME}.py{' --smoke' if args.smoke else ''}` in {timer.minutes():.1f} min "
        f"on {common.machine()} (its runs took {job_minutes(root, sizes.steps):.1f} min of job time, one at a time, over every "
        f"invocation); seeds {list(sizes.seeds)}, mean ± std.\n\n"
        f"Final held-out loss and accuracy (fully fused from position 1):\n\n{table}\n\n"
        f"Split minus one run, K=2 loss per seed ({first} import): {', '.join(f'{d:+.4f}' for d in diffs)}.\n\n"
        f"The feedback phase's start, per import (held-out, before its first step), and when K=2 overtakes K=1 "
        f"(evals every {sizes.eval_every} steps):\n\n{start}\n\n{common.figure_line(args, path, 'feedback phase after import')}\n"
    )
    check = budget_check(results, sizes.arms)
    recorded = summary.load_effects(args, NAME)  # the effect per seed at the budgets measured before
    rungs = budget.ladder([budget.Rung.from_record(int(n), kept) for n, kept in recorded.items()],
                          budget.Rung(sizes.steps, tuple(diffs)))  # fmt: skip
    judgement = judged(rungs, results, first)
    said = judgement.verdict
    if len(rungs) > 1:  # what the rule reads besides this budget's runs
        body += (
            f"\nThe same, per seed, at the budgets earlier invocations measured (their runs are not read again; "
            f"`results/summary.json` keeps them): {'; '.join(f'{r.steps} steps: {said_rung(r)}' for r in rungs[:-1])}.\n"
        )
    body += (
        f"\n{check.line}\n\nverdict (the split costs nothing against one run, {first} import): {said}\n\n"
        f"{judgement.line}\n"
    )
    common.finish(args, NAME, body)
    figures = f"split − one run, final K=2 loss ({first} import): {common.mean_std(diffs, 4)} nats/byte"
    rule = f"the {first} phase's K=2 loss within 2% over its last 20% of steps (settled); no cost: below +{NO_COST} by 2 SE"
    row = summary.Row(figures, rule, check.held, said, criterion=judgement.criterion, effect=f"{EFFECT} ({first} import)",
                      effects={str(r.steps): r.record() for r in rungs},
                      commits={str(sizes.steps): common.rows_code([{"trained_at": common.trained_at(runs)}])})  # fmt: skip
    summary.record(args, NAME, row)


if __name__ == "__main__":
    main()
