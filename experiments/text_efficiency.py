"""Data efficiency on text: does a model trained with feedback on N tokens match a plain model
trained on about 2N (the paper's claim)? On the Python standard library's own sources (no
download), BPE-tokenized by a 1024-id tokenizer trained on them with `fbt-train-tokenizer`, a
small model is trained with two feedback mixtures on N tokens, the paper's 75/22/3 and the heavier
50/25/25, and plain (K = 1) on N, 1.5N and 2N tokens (each with its own learning-rate schedule),
three seeds each. The plain runs' final held-out loss against tokens, interpolated log-linearly,
says how many tokens a plain model needs to reach each feedback model's loss; a bootstrap over
seeds gives the interval.

The claim's effect, per seed: the saving, (tokens that seed's plain runs need to match its feedback
model at the better feedback K) ÷ N − 1, read within the plain runs' range (0 where plain_N is
already as good: feedback saves nothing; (largest plain budget ÷ N) − 1, a lower bound, where no plain
run reaches it). The verdict follows `budget.judge` (reproduced: a saving beyond two standard errors
and of at least 0.9, the paper's 2× within what three seeds resolve) where the compared arms
settled — the feedback model's fused (K=2) loss within 2% over its last 20% of steps, and the plain
model's loss still falling by more than 1% from N to its largest budget (else a plateau is matched
at every budget and no ratio can be read) — or where the saving is stable over the ladder of N.

    python experiments/text_efficiency.py [--smoke] [--write-docs docs/results.md]
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
from typing import Any

import budget
import common
import numpy as np
import summary
from tokens_to_match import interval, loss_at, mean_of, plain_points, ratio, times

EFFECT = "tokens-to-match saving, plain tokens needed ÷ N − 1 (75/22/3, its better K)"
MINIMUM = 0.9  # the paper's 2×, within what three seeds resolve: a saving of at least 1.9×

NAME = "text_efficiency"
MIXTURES = {  # feedback arm: (its schedule, how the tables name it)
    "paper_N": ("0:1; 0.75:2=0.88,3=0.12", "75/22/3"),  # K=1 for 75%, then K=2 88% / K=3 12%
    "heavy_N": ("0:1; 0.5:2=0.5,3=0.5", "50/25/25"),  # feedback for half the run
}
FEEDBACK_RULE = budget.Rule("loss_K2", 0.02, relative=True)
STILL_IMPROVING = 0.01  # plain's loss at its largest budget below plain_N's by more than this fraction
RULE_TEXT = (
    "each feedback model's K=2 loss within 2% over the last 20% of its steps, and the plain model's loss still "
    "falling from N to its largest budget (by more than 1%)"
)
Rows = dict[str, list[dict[str, Any]]]
LADDER = (1.0, 1.5, 2.5)  # multiples of N (every run's steps), climbed until the 75/22/3 arm's verdict is decided
SMOKE_LADDER = (1.0,)
LADDER_HEADER = ["N (steps)", "feedback arm", "budget check", "tokens a plain model needs (at its better feedback K)",
                 "verdict"]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Sizes:
    steps: int  # N, in steps of batch × 128 tokens
    batch: int
    seeds: tuple[int, ...]
    ratios: tuple[float, ...]  # plain runs at these multiples of N (1.0: the equal-data baseline)
    eval_batches: int  # of 32 validation records each: the same first records for every run
    warmup: int
    files: str  # the stdlib sources: globs below the standard library's directory
    vocab: int  # the BPE tokenizer's ids
    points: int = 10  # evaluations per run (the last step is always one)
    mixtures: tuple[str, ...] = tuple(MIXTURES)


# FULL: N = 1024 steps of 16 × 128 tokens (2M BPE tokens); 2N reads about half of the training split
# (the stdlib's packages too, site-packages left out), so no record is seen twice.
FULL = Sizes(1024, batch=16, seeds=(0, 1, 2), ratios=(1.0, 1.5, 2.0), eval_batches=4, warmup=30,
             files="*.py,[!s]*/**/*.py", vocab=1024)  # fmt: skip
# Smoke: one seed, the equal-data pair only (each extra job is ~15 s of start-up and compile).
SMOKE = Sizes(12, batch=8, seeds=(0,), ratios=(1.0,), eval_batches=1, warmup=2, files="[a-c]*.py", vocab=300,
              points=3, mixtures=("paper_N",))  # fmt: skip


def plain_name(ratio: float) -> str:
    return "plain_N" if ratio == 1.0 else f"plain_{ratio:g}N"


def prepare(directory: str, sizes: Sizes) -> str:
    """The tokenizer (trained once on the sources) and the prepared records (once)."""
    tokenizer = os.path.join(directory, "tokenizer", "tokenizer.json")
    if not os.path.exists(tokenizer):
        inputs = common.stdlib_inputs(os.path.join(directory, "tokenizer", "inputs.txt"), sizes.files)
        command = ["fbt-train-tokenizer", f"--input={inputs}", f"--vocab-size={sizes.vocab}", f"--output={tokenizer}"]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return common.prepare_stdlib(os.path.join(directory, "prepared"), 128, sizes.files, tokenizer=tokenizer)


def rung_name(factor: float) -> str:
    """A rung's sweep directory and spec name: `sweep` (×1), `sweep-x1.5`, ..."""
    return "sweep" if factor == 1.0 else f"sweep-x{factor:g}"


def write_spec(directory: str, data_path: str, sizes: Sizes, name: str = "sweep") -> str:
    """The sweep spec, written beside the sweep: its sizes depend on --smoke and the rung. The runs
    at N agree on everything but the schedule, so fbt-sweep trains their common K=1 beginning once."""

    def run(name: str, schedule: str, steps: int) -> dict[str, Any]:
        every = max(1, steps // sizes.points)
        return {"name": name, "passes.schedule": schedule, "train.steps": steps, "eval.every_steps": every}

    runs = [run(plain_name(1.0), "0:1", sizes.steps)]
    runs += [run(name, MIXTURES[name][0], sizes.steps) for name in sizes.mixtures]
    runs += [run(plain_name(r), "0:1", round(r * sizes.steps)) for r in sizes.ratios if r != 1.0]
    spec = {
        "name": NAME,
        "base": os.path.join(common.REPO, "configs", "tiny.py"),  # its model: D=64, 2 layers
        "overrides": {
            "data.source": "text",
            "data.path": data_path,
            "data.seq_len": 128,
            "model.vocab_size": sizes.vocab,
            "train.batch_size": sizes.batch,
            "train.log_every": 25,
            "optimizer.warmup_steps": sizes.warmup,
            "eval.num_passes": (1, 2, 3),
            "eval.batch_size": 32,
            "eval.num_batches": sizes.eval_batches,
            "eval.contraction_passes": 0,  # the monitor's extra passes and compile: not asked here
        },
        "runs": runs,
        "seeds": list(sizes.seeds),
    }
    path = os.path.join(directory, "spec.py" if name == "sweep" else f"spec-{name}.py")
    with open(path, "w", encoding="utf-8") as f:
        f.write(f'"""Written by experiments/{NAME}.py."""\n\n\ndef get_sweep():\n    return {spec!r}\n')
    return path


def budget_check(groups: Rows, arm: str, steps: int) -> budget.Check:
    """`arm`'s fused loss settled, and the plain model still improving between N and its largest budget."""
    what = f"{MIXTURES[arm][1]}, N = {steps} steps"
    settled = budget.check(groups[arm], (FEEDBACK_RULE,), what)
    plain = plain_points(groups)
    gain = (plain[0][1] - plain[-1][1]) / plain[0][1] if len(plain) > 1 else 0.0
    if gain <= STILL_IMPROVING:
        line = (
            f"budget check: failed ({what}) - the plain model's loss improves by {100 * gain:.2f}% from N "
            f"to its largest budget (rule: more than {100 * STILL_IMPROVING:g}%): no ratio of tokens can be read."
        )
        advice = "the plain model has stopped improving by N: a smaller N or a larger model"
        return budget.Check(False, line, settled.worst, settled.suggested_steps, advice)
    return settled


def best_k(groups: Rows, arm: str) -> int:
    return min((2, 3), key=lambda k: mean_of(groups[arm], f"final_loss_K{k}"))


def saving(groups: Rows, arm: str, steps: int) -> budget.Rung:
    """The claim's effect for `arm`, per seed (a seed's feedback run against its own plain runs)."""
    k, plain = best_k(groups, arm), plain_points(groups)
    most = plain[-1][0] / plain[0][0]
    seeds = sorted(r["label.seed"] for r in groups[arm])
    return budget.Rung(steps, tuple(min(ratio(groups, arm, k, [s]), most) - 1 for s in seeds))


def answer(groups: Rows, arm: str, judged: budget.Judgement) -> tuple[list[str], str, str]:
    """For one feedback arm: the lines (tokens to match it at K=1 and its best K, with intervals;
    what equal FLOPs buy; the verdict rule's line), its verdict, and its figures for the summary."""
    label = MIXTURES[arm][1]
    rows = groups[arm]
    k_best = best_k(groups, arm)
    plain = plain_points(groups)
    most = plain[-1][0] / plain[0][0]
    lines = [f"**{label}** (its better feedback depth: K = {k_best}):"]
    for k in (1, k_best):
        value, (low, high) = ratio(groups, arm, k), interval(groups, arm, k)
        lines.append(
            f"- to match its loss at K={k} ({mean_of(rows, f'final_loss_K{k}'):.4f}) a plain model needs "
            f"**{times(value, most)} the tokens** (90% bootstrap interval over seeds {times(low, most)} – "
            f"{times(high, most)})."
        )
    cost = mean_of(rows, "train_flops") / mean_of(groups[plain_name(1.0)], "train_flops")
    matched = loss_at(cost * plain[0][0], plain)  # the plain loss at the feedback model's training FLOPs
    best = mean_of(rows, f"final_loss_K{k_best}")
    reach = "a loss outside its runs' range" if matched is None else f"≈{matched:.4f}"
    lines.append(
        f"- at equal FLOPs ({cost:.2f}× plain_N's): a plain model reaches {reach}, against {best:.4f}"
        + ("." if matched is None else f" (feedback **{'better' if best < matched else 'worse'} per FLOP**).")
    )
    lines += ["", judged.line, "", f"verdict (feedback on N tokens ≈ plain on 2N, {label}): {judged.verdict}", ""]
    value, (low, high) = ratio(groups, arm, k_best), interval(groups, arm, k_best)
    figures = f"{times(value, most)} N [{times(low, most)}, {times(high, most)}] at K={k_best}"
    return lines, judged.verdict, figures


def table(groups: Rows) -> list[str]:
    lines = [
        "| variant | schedule | tokens | mean K | loss K=1 | loss K=2 | loss K=3 | train TFLOPs | seconds |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, rows in groups.items():
        losses = [common.mean_std([r[f"final_loss_K{k}"] for r in rows], 4) for k in (1, 2, 3)]
        if name not in MIXTURES:  # a plain model's fusion is never trained: its K>1 loss means nothing
            losses[1:] = ["–", "–"]
        schedule = MIXTURES[name][0] if name in MIXTURES else "0:1"
        lines.append(
            f"| {name} | `{schedule}` | {rows[0]['tokens']:,} | {rows[0]['mean_num_passes']:.2f} | "
            + " | ".join(losses)
            + f" | {mean_of(rows, 'train_flops') / 1e12:.3g} | {mean_of(rows, 'seconds'):.0f} |"
        )
    return lines


def mean_curve(rows: list[dict[str, Any]], k: int) -> tuple[list[int], list[float]]:
    """Held-out loss at K=k against tokens, averaged over the seeds (which evaluate the same steps)."""
    by_tokens: dict[int, list[float]] = {}
    for row in rows:
        for tokens, record in row["curve"]:
            by_tokens.setdefault(tokens, []).append(record[f"loss_K{k}"])
    tokens = sorted(t for t, v in by_tokens.items() if len(v) == len(rows))
    return tokens, [float(np.mean(by_tokens[t])) for t in tokens]


def plot(groups: Rows, path: str) -> None:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, rows in groups.items():
        for k in (1, 2) if name in MIXTURES else (1,):
            dashed = name in MIXTURES and k == 1  # a feedback model read without feedback
            ax.plot(*mean_curve(rows, k), "--" if dashed else "-", marker=".", label=f"{name}, eval K={k}")
    ax.set(xlabel="training tokens", ylabel="held-out loss (nats/token)", title="stdlib sources: mean over seeds")
    ax.legend(fontsize=8)
    common.save_figure(fig, path)


def measure(
    directory: str, data_path: str, sizes: Sizes, factor: float, earlier: dict[str, list[budget.Rung]]
) -> dict[str, Any]:
    """One rung of the ladder: every run at `factor` × N steps, trained (or finished), and each arm
    judged over this rung and the `earlier` ones (per arm)."""
    sizes = dataclasses.replace(sizes, steps=round(factor * sizes.steps))
    name = rung_name(factor)
    rows = common.run_sweep(write_spec(directory, data_path, sizes, name), os.path.join(directory, name), parallel=2)
    groups = common.by_label(rows, "run")
    checks = {arm: budget_check(groups, arm, sizes.steps) for arm in sizes.mixtures}
    effects = {arm: saving(groups, arm, sizes.steps) for arm in sizes.mixtures}
    judged = {
        arm: budget.judge(EFFECT.replace("75/22/3", MIXTURES[arm][1]), budget.ladder(earlier.get(arm, []),
                          effects[arm]), checks[arm], minimum=MINIMUM)
        for arm in sizes.mixtures
    }  # fmt: skip
    answers = {arm: answer(groups, arm, judged[arm]) for arm in sizes.mixtures}
    cells = [
        [str(sizes.steps), MIXTURES[arm][1], "held" if checks[arm].held else "failed", answers[arm][2], answers[arm][1]]
        for arm in sizes.mixtures
    ]
    minutes = common.sweep_minutes(os.path.join(directory, name))
    return dict(steps=sizes.steps, sizes=sizes, groups=groups, checks=checks, answers=answers, cells=cells,
                minutes=minutes, effects=effects, judged=judged, code=common.rows_code(rows))  # fmt: skip


def main() -> None:
    timer = common.Timer()
    ladder = ("--ladder", dict(default="", help=f"multiples of N to climb until every check holds (default "
                                                f"{','.join(f'{f:g}' for f in LADDER)})"))  # fmt: skip
    args = common.arguments(__doc__, NAME, extra=[ladder])
    sizes = SMOKE if args.smoke else FULL
    factors = (
        [float(f) for f in args.ladder.split(",")] if args.ladder else list(SMOKE_LADDER if args.smoke else LADDER)
    )
    directory = os.path.abspath(args.dir)
    os.makedirs(directory, exist_ok=True)
    # The jobs compile the same few programs (trunks and their forks exactly the same): one cache.
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(directory, "compile_cache"))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    data_path = prepare(directory, sizes)
    recorded = summary.load_effects(args, NAME)  # the 75/22/3 arm's savings at the rungs measured before
    earlier_effects = {"paper_N": [budget.Rung.from_record(int(n), kept) for n, kept in recorded.items()]}
    rungs = []
    for factor in factors:  # each rung is trained only while the verdict rule has not decided
        rung = measure(directory, data_path, sizes, factor, earlier_effects)
        rungs.append(rung)
        earlier_effects = {arm: [*earlier_effects.get(arm, []), rung["effects"][arm]] for arm in sizes.mixtures}
        if rung["judged"][sizes.mixtures[0]].criterion:
            break
    last = rungs[-1]
    sizes, groups, checks, answers = last["sizes"], last["groups"], last["checks"], last["answers"]
    base_steps = (SMOKE if args.smoke else FULL).steps
    rung_steps = {round(f * base_steps) for f in LADDER}
    earlier = common.earlier_rungs(args, NAME, len(LADDER_HEADER), rung_steps, {r["steps"] for r in rungs})
    for rung in earlier:
        rung["cells"] = rung["rows"]
    shown = sorted(earlier + rungs, key=lambda r: r["steps"])
    path = common.plot_path(args, NAME)
    plot(groups, path)
    meta = json.loads(pathlib.Path(data_path, "meta.json").read_text(encoding="utf-8"))
    source = meta["source"]  # the plan's summary: the globs, how many files, how many bytes
    n_tokens = groups[plain_name(1.0)][0]["tokens"]
    minutes = "; ".join(f"N = {r['steps']} steps: {r['minutes']:.0f} min" for r in rungs)
    carried = common.carried_note(earlier, [r["steps"] for r in earlier if str(r["steps"]) not in recorded])
    body = [
        f"Written by `python experiments/{NAME}.py --write-docs docs/results.md`. Machine: {common.machine()}; "
        f"the runs took {minutes} of job time (`fbt-sweep --parallel=2`, two jobs at a time, compiles included); "
        f"this invocation {timer.minutes():.1f} min.{carried}",
        "",
        f"Corpus: {source['files']} Python files of this interpreter's standard library (`{sizes.files}` below "
        f"`{os.path.dirname(os.__file__)}`), {source['bytes']:,} bytes; a {sizes.vocab}-id byte-level BPE "
        "tokenizer trained on them (`fbt-train-tokenizer`), 128-token records. A hash of each file's text holds out "
        f"10%: {meta['tokens']['train']:,} training tokens ({meta['documents']['train']} files), "
        f"{meta['tokens']['validation']:,} validation tokens ({meta['documents']['validation']} files).",
        "",
        f"Model: `configs/tiny.py`'s (width 64, 2 layers, 4 heads, 2 kv heads, MLP 256), batch {sizes.batch} × 128 "
        f"tokens, learning rate 3e-3 with {sizes.warmup} warmup steps and cosine decay over each run's own steps. "
        f"Budget ladder: N = {', '.join(str(round(f * base_steps)) for f in LADDER)} steps, climbed until the "
        f"verdict rule decides for 75/22/3 (plain runs at N, 1.5N, 2N on each rung); this invocation measured N = "
        f"{', '.join(str(r['steps']) for r in rungs)}. "
        f"Seeds {', '.join(map(str, sizes.seeds))}. Final held-out loss (nats per token) on the first "
        f"{sizes.eval_batches * 32} validation records, fused from position 1 (K=2, 3: fused prefill); "
        "mean ± std over seeds. TFLOPs count every step's K passes; seconds are each run's jobs, trunk included.",
        "",
        "The budget ladder: the tokens a plain model needs to match each feedback arm at its better feedback depth "
        "(as a multiple of N, with a 90% bootstrap interval over seeds), and the verdict per rung:",
        "",
        common.docs_block.table(LADDER_HEADER, [cells for rung in shown for cells in rung["cells"]]),
        "",
        *[f"{paragraph}\n" for rung in earlier for paragraph in rung["paragraphs"]],
        f"At N = {sizes.steps} steps ({n_tokens:,} tokens, {n_tokens / meta['tokens']['train']:.0%} of the training "
        "split):",
        "",
        *table(groups),
        "",
        "Plain models are read at K=1 (their fusion is untrained).",
        "",
        *[line for arm in sizes.mixtures for line in (checks[arm].line, "", *answers[arm][0])],
        common.figure_line(args, path, "held-out loss vs tokens"),
    ]
    common.finish(args, NAME, "\n".join(body))
    figures = f"N = {sizes.steps} steps, tokens a plain model needs to match: " + "; ".join(
        f"{MIXTURES[arm][1]}: {answers[arm][2]}" for arm in sizes.mixtures
    )
    paper, *others = sizes.mixtures  # the claim's arm; the other is shown beside it
    verdict = answers[paper][1] + "".join(f" ({MIXTURES[arm][1]}: {answers[arm][1]})" for arm in others)
    held = all(check.held for check in checks.values())
    rule = f"{RULE_TEXT} (per feedback arm: settled), or the saving stable over the ladder N × 1, 1.5, 2.5"
    kept = {str(r.steps): r.record() for r in earlier_effects[paper]}
    criterion = "; ".join(f"{MIXTURES[arm][1]}: {last['judged'][arm].criterion or 'neither'}" for arm in sizes.mixtures)
    row = summary.Row(figures, rule, held, verdict, criterion=criterion, effect=EFFECT, effects=kept,
                      commits={str(r["steps"]): r["code"] for r in rungs})  # fmt: skip
    summary.record(args, NAME, row)


if __name__ == "__main__":
    main()
