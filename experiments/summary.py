"""The summary table at the top of docs/results.md: one row per claim, written by the experiment
that tests it.

Every experiment ends by recording its row (`record`): the figures it compared, its budget rule,
whether the rule held on its runs, and its verdict ("reproduced", "not reproduced", "partly", or
"undecided at this budget" where the rule did not hold). The rows are kept in
`results/summary.json` beside the Markdown file, and the table is rendered from all of them in the
order of CLAIMS; a claim whose experiment has not yet been run with its budget check says so
rather than keep an older verdict.

    python experiments/summary.py --write-docs docs/results.md   # re-render from the recorded rows
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import budget
import common

from fbt_jax.data import store

NAME = "summary"
UNRECORDED = "before commits were recorded"  # a rung recorded before Row.commits existed
CLAIMS = {  # experiment: what the paper says (method.md §9)
    "state_tracking": "latent feedback helps on state tracking: the paper's 75/22/3 mixture decodes the S3 word "
    "problem better with feedback than without",
    "layer_probes": "one feedback pass makes the answer linearly readable at layer 0: ≈ chance → 99.6% (state "
    "tracking), 100% (delayed recall)",
    "depth_stability": "{1, 2} diverges beyond its passes; 3% of 3-pass batches contract to a fixed point stable to "
    "1000 passes",
    "text_efficiency": "≈ 2× data efficiency: feedback on N tokens matches plain on 2N",
    "after_tuning": "the feedback gain persists after instruction tuning (GSM8K 64.5 → 67.9 fused), and the base "
    "model's shorter answers with feedback are gone after it",
    "upcycle_split": "(fbt-jax's own) the feedback phase can start from an exported and re-imported K=1 model at no "
    "cost against one uninterrupted run",
}


@dataclasses.dataclass(frozen=True)
class Row:
    figures: str  # what was compared, with its numbers
    rule: str  # the budget rule, in a few words
    held: bool  # whether every arm's budget check held on these runs (reported; the verdict needs less)
    verdict: str  # budget.judge's answer (budget.verdict's, for a row recorded before the effect rule)
    smoke: bool = False
    criterion: str = ""  # which criterion of budget.judge decided ("" where none did, or not yet judged)
    effect: str = ""  # what the effect is ("soft − standard accuracy (75/22/3)")
    effects: dict = dataclasses.field(default_factory=dict)  # steps → per-seed values ({mean, std, seeds} if gone)
    commits: dict = dataclasses.field(default_factory=dict)  # steps → the code it was computed at (common.rows_code)


def rows_path(docs_path: str) -> str:
    return os.path.join(os.path.dirname(os.path.abspath(docs_path)), "results", "summary.json")


def load_rows(docs_path: str) -> dict[str, Row]:
    path = rows_path(docs_path)
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return {name: Row(**row) for name, row in json.load(f).items()}


def load_effects(args: argparse.Namespace, name: str, variant: str = "") -> dict:
    """The per-seed effects that summary.json keeps for experiment `name` (at `variant`), by steps:
    what a later invocation judges a ladder with, when the runs are gone. Nothing for a smoke run."""
    if args.smoke or not args.write_docs:
        return {}
    row = load_rows(args.write_docs).get(key(name, variant))
    return dict(row.effects) if row else {}


def key(name: str, variant: str = "") -> str:
    """A row's key in summary.json: the experiment's name, then its scale where not the default."""
    return f"{name} {variant}".rstrip()


def split_key(row_key: str) -> tuple[str, str]:
    """(experiment name, variant) of a row's key: `key`'s inverse."""
    name, _, variant = row_key.partition(" ")
    return name, variant


def table(rows: dict[str, Row]) -> str:
    """One line per claim, then one per scaled run of its experiment (e.g. `--scale=gpu`)."""
    header = ["the paper says", "here", "rule", "every arm settled?", "decided by", "verdict"]
    lines = []
    for name, claim in CLAIMS.items():
        if name not in rows:
            lines.append([claim, f"not yet run (`experiments/{name}.py`)", "–", "–", "–", "undecided"])
        for row_key in sorted(k for k in rows if split_key(k)[0] == name):
            row, variant = rows[row_key], split_key(row_key)[1]
            figures = f"{row.figures} (smoke run)" if row.smoke else row.figures
            said = f"the same, at `{variant}`" if variant else claim
            decided = row.criterion or ("neither criterion" if row.effect else "the older rule (every arm settled)")
            lines.append([said, figures, row.rule, "yes" if row.held else "no", decided, f"**{row.verdict}**"])
    return common.docs_block.table(header, lines)


def top_effect(row: Row) -> str:
    """'+0.322 ± 0.027 (standard error over 3 seeds) at 30000 steps': the effect at the row's largest
    budget."""
    if not row.effects:
        return ""
    steps = max(row.effects, key=int)
    rung = budget.Rung.from_record(int(steps), row.effects[steps])
    return f"{rung.mean:+.3f} ± {rung.se:.3f} (standard error over {rung.seeds} seeds) at {steps} steps"


def carried(row: Row, now: str) -> str:
    """' Carried from other code: 6000, 15000 steps (1234567).': the rungs of `row`'s effect computed
    by code other than `now`, grouped by their code ('' where there is none)."""
    other = {steps: row.commits.get(steps, UNRECORDED) for steps in row.effects}
    other = {steps: code for steps, code in other.items() if code != now}
    if not other:
        return ""
    by_code: dict[str, list[str]] = {}
    for steps in sorted(other, key=int):
        by_code.setdefault(other[steps], []).append(steps)
    said = "; ".join(f"{', '.join(steps)} steps ({code})" for code, steps in by_code.items())
    return f" Carried from other code: {said}."


def load_commits(args: argparse.Namespace, name: str, variant: str = "") -> dict:
    """The code each recorded rung of `name` was computed at, by steps (`load_effects`'s companion)."""
    if args.smoke or not args.write_docs:
        return {}
    row = load_rows(args.write_docs).get(key(name, variant))
    return dict(row.commits) if row else {}


def sentences(rows: dict[str, Row]) -> list[str]:
    """One sentence per claim (and scaled run): reproduced, not, or open, with its numbers."""
    out, now = [], common.code_version()
    for row_key in sorted(rows, key=lambda k: (list(CLAIMS).index(split_key(k)[0]), k)):
        row, (name, variant) = rows[row_key], split_key(row_key)
        claim = CLAIMS[name] + (f" (at `{variant}`)" if variant else "")
        smoke = " (smoke run)" if row.smoke else ""
        effect = f"{row.effect} {top_effect(row)}" if row.effect else row.figures
        if row.verdict.startswith(("reproduced", "not reproduced", "the opposite")):
            out.append(
                f"- **{row.verdict.capitalize()}**{smoke}: {claim}. {effect}; decided as {row.criterion}."
                f"{carried(row, now)}"
            )
        else:
            out.append(f"- **Open**{smoke}: {claim}. {effect}; {row.verdict}.{carried(row, now)}")
    return out


def render(docs_path: str) -> str:
    rows = load_rows(docs_path)
    body = [
        "Written by `python experiments/summary.py` from the rows each experiment records when it writes its "
        f"block (`{os.path.relpath(rows_path(docs_path), os.path.dirname(os.path.abspath(docs_path)))}`, which "
        "keeps each effect per seed and budget). Each claim is judged by its effect (`experiments/budget.py`, "
        "fixed before the outcomes are read): a verdict where the arms the effect compares settled over the last "
        "20% of training, or where the effect is stable over a budget ladder spanning at least 2.5× (one sign at "
        "every rung, more than two standard errors from zero at the top two, which agree within two standard "
        "errors); otherwise *undecided*, with the budget the trend points to. A row without a criterion was "
        "recorded under the older rule (every arm of every quantity settled) and keeps that verdict until its "
        "experiment runs again. Every rung was computed by the code of commit "
        f"{common.code_version()} (the last commit that changed {', '.join(common.CODE_PATHS)}; after the @, the "
        "jax that ran it), and its "
        "experiment's command computes it again at any commit with that code, except the rungs named as carried "
        "from other code. At this scale:",
        "",
        *sentences(rows),
        "",
        table(rows),
    ]
    return "\n".join(body)


def record(args: argparse.Namespace, name: str, row: Row, variant: str = "") -> None:
    """With --write-docs, store `name`'s row (at `variant`, its scale) beside that file and rewrite
    its summary block."""
    if name not in CLAIMS:
        raise KeyError(f"{name} has no claim in experiments/summary.py's CLAIMS")
    if not args.write_docs:
        return
    docs_path = args.write_docs
    rows = load_rows(docs_path)
    kept = rows.get(key(name, variant))  # a rung carried from the row an earlier invocation recorded keeps its code
    commits = {**(kept.commits if kept else {}), **row.commits}
    commits = {steps: commits[steps] for steps in row.effects if steps in commits}
    rows[key(name, variant)] = dataclasses.replace(row, smoke=args.smoke, commits=commits)
    path = rows_path(docs_path)
    claimed = [k for k in rows if split_key(k)[0] in CLAIMS]
    ordered = sorted(claimed, key=lambda k: (list(CLAIMS).index(split_key(k)[0]), k))
    serialised = {k: dataclasses.asdict(rows[k]) for k in ordered}
    store.write_json(path, serialised, staging=os.path.dirname(path))
    common.docs_block.write_block(docs_path, NAME, render(docs_path), folder="experiments")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write-docs", metavar="PATH", required=True, help="the Markdown file whose table to rewrite")
    args = parser.parse_args()
    common.docs_block.check_block(args.write_docs, NAME, folder="experiments")
    body = render(args.write_docs)
    print(body)
    common.docs_block.write_block(args.write_docs, NAME, body, folder="experiments")


if __name__ == "__main__":
    main()
