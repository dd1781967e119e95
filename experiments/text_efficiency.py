"""Data efficiency on text: does a model trained with feedback on N tokens match a plain model
trained on about 2N (the paper's claim)? On the Python standard library's own sources (byte
tokens, no download) a small model is trained plain (K = 1) and with the paper's 75/22/3 pass
mixture on N tokens, and plain on 1.5N and 2N tokens (each with its own learning-rate schedule),
three seeds each; the plain runs' final held-out loss against tokens, interpolated log-linearly,
says how many tokens a plain model needs to reach the feedback model's loss.

    python experiments/text_efficiency.py [--smoke] [--write-docs docs/results.md]
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
from typing import Any

import budget
import common
import numpy as np
import summary

NAME = "text_efficiency"
PAPER = "0:1; 0.75:2=0.88,3=0.12"  # 75% K=1, then K=2 88% / K=3 12%: 75/22/3 overall
FEEDBACK = "feedback_N"
Rows = dict[str, list[dict[str, Any]]]


@dataclasses.dataclass(frozen=True)
class Sizes:
    steps: int  # N, in steps of batch × 128 tokens
    batch: int
    seeds: tuple[int, ...]
    ratios: tuple[float, ...]  # plain runs at these multiples of N (1.0: the equal-data baseline)
    eval_batches: int  # of 32 validation records each: the same first records for every run
    warmup: int
    points: int = 8  # evaluations per run (the last step is always one)
    schedule: str = PAPER  # the feedback run's


# FULL: N = 512 steps of 16 × 128 tokens (1M tokens); 2N reads about half of the training split, so
# no record is seen twice. About 10 minutes on this 2-core CPU with nothing else running.
FULL = Sizes(steps=512, batch=16, seeds=(0, 1, 2), ratios=(1.0, 1.5, 2.0), eval_batches=4, warmup=30)
# Smoke: the equal-data pair only, and no K=3 (each extra job or K is ~15 s of start-up and compile).
SMOKE = Sizes(12, batch=8, seeds=(0, 1), ratios=(1.0,), eval_batches=1, warmup=2, points=3, schedule="0:1; 0.75:2")


def plain_name(ratio: float) -> str:
    return "plain_N" if ratio == 1.0 else f"plain_{ratio:g}N"


def write_spec(directory: str, data_path: str, sizes: Sizes) -> str:
    """The sweep spec, written beside the sweep: its sizes depend on --smoke. plain_N and
    feedback_N agree on everything but the schedule, so fbt-sweep trains their K=1 first 75% once."""

    def run(name: str, schedule: str, steps: int) -> dict[str, Any]:
        every = max(1, steps // sizes.points)
        return {"name": name, "passes.schedule": schedule, "train.steps": steps, "eval.every_steps": every}

    runs = [run(plain_name(1.0), "0:1", sizes.steps), run(FEEDBACK, sizes.schedule, sizes.steps)]
    runs += [run(plain_name(r), "0:1", round(r * sizes.steps)) for r in sizes.ratios if r != 1.0]
    spec = {
        "name": NAME,
        "base": os.path.join(common.REPO, "configs", "tiny.py"),  # its model: D=64, 2 layers
        "overrides": {
            "data.source": "text",
            "data.path": data_path,
            "data.seq_len": 128,
            "model.vocab_size": 257,  # the byte tokenizer's 256 bytes + end of document
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
    path = os.path.join(directory, "spec.py")
    with open(path, "w", encoding="utf-8") as f:
        f.write(f'"""Written by experiments/{NAME}.py."""\n\n\ndef get_sweep():\n    return {spec!r}\n')
    return path


def mean_of(rows: list[dict[str, Any]], key: str) -> float:
    return float(np.mean([row[key] for row in rows]))


def tokens_to_reach(target: float, points: list[tuple[float, float]]) -> float | None:
    """Tokens where the (tokens, loss) points first reach `target` (log-linear); None if they never do."""
    if points[0][1] <= target:
        return points[0][0]
    for (t0, l0), (t1, l1) in zip(points, points[1:]):
        if l1 <= target:
            return math.exp(math.log(t0) + (l0 - target) / (l0 - l1) * (math.log(t1) - math.log(t0)))
    return None


def loss_at(tokens: float, points: list[tuple[float, float]]) -> float | None:
    """The loss at `tokens`, log-linear between the points around it (None outside them)."""
    for (t0, l0), (t1, l1) in zip(points, points[1:]):
        if t0 <= tokens <= t1:
            return l0 + (math.log(tokens) - math.log(t0)) / (math.log(t1) - math.log(t0)) * (l1 - l0)
    return None


def mean_curve(rows: list[dict[str, Any]], k: int) -> tuple[list[int], list[float]]:
    """Held-out loss at K=k against tokens, averaged over the seeds (which evaluate the same steps)."""
    by_tokens: dict[int, list[float]] = {}
    for row in rows:
        for tokens, record in row["curve"]:
            by_tokens.setdefault(tokens, []).append(record[f"loss_K{k}"])
    tokens = sorted(t for t, v in by_tokens.items() if len(v) == len(rows))
    return tokens, [float(np.mean(by_tokens[t])) for t in tokens]


def plot(groups: Rows, best_k: int, path: str) -> None:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, rows in groups.items():
        for k in (1, best_k) if name == FEEDBACK else (1,):
            dashed = name == FEEDBACK and k == 1  # the feedback model read without feedback
            ax.plot(*mean_curve(rows, k), "--" if dashed else "-", marker=".", label=f"{name}, eval K={k}")
    ax.set(xlabel="training tokens", ylabel="held-out loss (nats/byte)", title="stdlib sources: mean over seeds")
    ax.legend()
    common.save_figure(fig, path)


FEEDBACK_RULE = budget.Rule("loss_K2", 0.02, relative=True)
STILL_IMPROVING = 0.01  # plain's loss at its largest budget below plain_N's by more than this fraction
RULE_TEXT = (
    "the feedback model's K=2 loss within 2% over the last 20% of its steps, and the plain model's loss still "
    "improving from N to its largest budget (by more than 1%)"
)


def budget_check(groups: Rows) -> budget.Check:
    """The feedback model's fused loss settled (else the comparison is made before it learned to
    read its feedback), and the plain model still improving between N and its largest budget
    (else every ratio is meaningless: a plateau is matched at any budget)."""
    settled = budget.check(groups[FEEDBACK], (FEEDBACK_RULE,), "feedback model")
    plain = sorted((r[0]["tokens"], mean_of(r, "final_loss_K1")) for name, r in groups.items() if name != FEEDBACK)
    gain = (plain[0][1] - plain[-1][1]) / plain[0][1] if len(plain) > 1 else 0.0
    if gain <= STILL_IMPROVING:
        line = (
            f"budget check: failed - the plain model's loss improves by {100 * gain:.2f}% from N to its largest budget "
            f"(rule: more than {100 * STILL_IMPROVING:g}%), so no ratio of tokens can be read from these runs."
        )
        advice = "the plain model has stopped improving by N: a smaller N or a larger model"
        return budget.Check(False, line, settled.worst, settled.suggested_steps, advice)
    return settled


def answer(groups: Rows, best_k: int, check: budget.Check) -> tuple[list[str], str, str]:
    """How many tokens the plain model needs to match the feedback model, and what equal FLOPs buy;
    the lines, the verdict and the figures for the summary."""
    plain = sorted((r[0]["tokens"], mean_of(r, "final_loss_K1")) for name, r in groups.items() if name != FEEDBACK)
    n_tokens, most = plain[0][0], plain[-1][0] / plain[0][0]
    lines, ratios = [], {}
    for k in sorted({1, best_k}):
        target = mean_of(groups[FEEDBACK], f"final_loss_K{k}")
        tokens = tokens_to_reach(target, plain)
        ratios[k] = math.inf if tokens is None else tokens / n_tokens
        if tokens is None:
            needs = f"**more than {most:g}× the tokens** (at {most:g}N it reaches {plain[-1][1]:.4f})"
        elif tokens <= n_tokens:
            needs = f"**no more tokens** (at N it already has {plain[0][1]:.4f}): no data saving"
        else:
            needs = f"**≈{ratios[k]:.2f}× the tokens**"
        lines.append(f"- to match the feedback model's loss at K={k} ({target:.4f}) the plain model needs {needs}.")
    cost = mean_of(groups[FEEDBACK], "train_flops") / mean_of(groups[plain_name(1.0)], "train_flops")
    matched = loss_at(cost * n_tokens, plain)  # the plain loss at the feedback model's training FLOPs
    best = min(mean_of(groups[FEEDBACK], f"final_loss_K{k}") for k in ratios)
    reach = "a loss outside its runs' range" if matched is None else f"≈{matched:.4f} (interpolated)"
    per_flop = "" if matched is None else f": feedback is **{'better' if best < matched else 'worse'} per FLOP**"
    lines.append(
        f"- at equal FLOPs: feedback training costs {cost:.2f}× plain_N's FLOPs; a plain model given them ({cost:.2f}N "
        f"tokens) reaches {reach}, against the feedback model's best {best:.4f}{per_flop}."
    )
    saving = max(ratios.values())
    if most >= 2 or saving < most:  # else no plain run reaches far enough to judge the 2× claim
        decided = "reproduced" if saving >= 1.9 else "partly (a saving under 2×)" if saving > 1 else "not reproduced"
    else:
        decided = f"undecided (no plain run reaches 2N; the saving is at least {most:g}×)"
    said = budget.verdict(check, decided)
    lines.append(f"\nverdict (feedback on N tokens ≈ plain on 2N): {said}")
    best = ratios[best_k]
    needed = f"more than {most:g}×" if not math.isfinite(best) else "no more than 1×" if best <= 1 else f"≈{best:.2f}×"
    figures = f"tokens a plain model needs to match the feedback model's K={best_k} loss: {needed} N"
    return lines, said, figures


def table(groups: Rows, sizes: Sizes) -> list[str]:
    lines = [
        "| variant | schedule | tokens | mean K | loss K=1 | loss K=2 | loss K=3 | train TFLOPs | seconds |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, rows in groups.items():
        losses = [common.mean_std([r[f"final_loss_K{k}"] for r in rows], 4) for k in (1, 2, 3)]
        if name != FEEDBACK:  # a plain model's fusion is never trained: its K>1 loss means nothing
            losses[1:] = ["–", "–"]
        schedule = sizes.schedule if name == FEEDBACK else "0:1"
        lines.append(
            f"| {name} | `{schedule}` | {rows[0]['tokens']:,} | {rows[0]['mean_num_passes']:.2f} | "
            + " | ".join(losses)
            + f" | {mean_of(rows, 'train_flops') / 1e12:.3g} | {mean_of(rows, 'seconds'):.0f} |"
        )
    return lines


def main() -> None:
    timer = common.Timer()
    args = common.arguments(__doc__, NAME)
    sizes = SMOKE if args.smoke else FULL
    directory = os.path.abspath(args.dir)
    os.makedirs(directory, exist_ok=True)
    # The jobs compile the same few programs (trunks and their forks exactly the same): one cache.
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(directory, "compile_cache"))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    data_path = common.prepare_stdlib(os.path.join(directory, "prepared"), 128)
    spec = write_spec(directory, data_path, sizes)
    rows = common.run_sweep(spec, os.path.join(directory, "sweep"), parallel=2)
    groups = common.by_label(rows, "run")
    best_k = min((2, 3), key=lambda k: mean_of(groups[FEEDBACK], f"final_loss_K{k}"))
    check = budget_check(groups)
    answer_lines, said, figures = answer(groups, best_k, check)
    path = common.plot_path(args, NAME)
    plot(groups, best_k, path)
    meta = json.loads(pathlib.Path(data_path, "meta.json").read_text(encoding="utf-8"))
    source = meta["source"]  # the plan's summary: the glob, how many files, how many bytes
    n_tokens = groups[plain_name(1.0)][0]["tokens"]
    body = [
        f"Written by `python experiments/{NAME}.py --write-docs docs/results.md`. Machine: {common.machine()}; "
        f"its {len(rows)} runs took {common.sweep_minutes(os.path.join(directory, 'sweep')):.0f} min of job time "
        f"(`fbt-sweep --parallel=2`, two jobs at a time, compiles included); this invocation {timer.minutes():.1f} min.",
        "",
        f"Corpus: the {source['files']} top-level modules (`*.py`) of this interpreter's standard library "
        f"(`{os.path.dirname(source['spec'])}`), {source['bytes']:,} bytes; byte tokens (vocabulary "
        f"257) packed into 128-token records. A hash of each file's text holds out 10%: "
        f"{meta['tokens']['train']:,} training tokens ({meta['documents']['train']} files), "
        f"{meta['tokens']['validation']:,} validation tokens ({meta['documents']['validation']} files).",
        "",
        f"Model: `configs/tiny.py`'s (width 64, 2 layers, 4 heads, 2 kv heads, MLP 256), batch {sizes.batch} × 128 "
        f"tokens, learning rate 3e-3 with {sizes.warmup} warmup steps and cosine decay over each run's own steps. "
        f"N = {sizes.steps} steps = {n_tokens:,} tokens ({n_tokens / meta['tokens']['train']:.0%} of the training "
        f"split). Seeds {', '.join(map(str, sizes.seeds))}. Final held-out loss (nats per byte) on the first "
        f"{sizes.eval_batches * 32} validation records, fused from position 1 (K=2, 3: fused prefill); "
        "mean ± std over seeds. TFLOPs count every step's K passes; seconds are each run's jobs, trunk included.",
        "",
        *table(groups, sizes),
        "",
        f"Plain models are read at K=1 (their fusion is untrained). The feedback model's best K is {best_k}.",
        "",
        check.line,
        "",
        *answer_lines,
        "",
        common.figure_line(args, path, "held-out loss vs tokens"),
    ]
    common.finish(args, NAME, "\n".join(body))
    summary.record(args, NAME, summary.Row(figures, RULE_TEXT, check.held, said))


if __name__ == "__main__":
    main()
