"""Is the budget sufficient? The check every experiment prints before it may write a verdict.

An experiment compares quantities at the end of its runs (held-out accuracy, loss). A comparison
made while those are still moving is a verdict on the budget, not on the method. The rule: over
the last `fraction` of training, every arm's compared quantity (the mean over its seeds, as the
verdicts compare it) changed by less than a stated tolerance. The check reads the runs' own eval
curves (what `fbt-sweep report` gathers) and gives one line beginning "budget check:". Where it
fails, the trend names a budget: the change over the window's second half against its first half fits an exponential approach to a limit, and the
budget is the first whose own last window would change by less than the tolerance.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class Rule:
    metric: str  # an eval key, e.g. "accuracy_K1"
    tolerance: float  # the largest change over the last window that counts as settled
    relative: bool = False  # tolerance as a fraction of the value (losses), else absolute
    fraction: float = 0.2  # the last window, as a fraction of training

    def describe(self) -> str:
        amount = f"{100 * self.tolerance:g}%" if self.relative else f"{self.tolerance:g}"
        return f"{self.metric} changes by less than {amount} over the last {100 * self.fraction:g}% of training"


@dataclasses.dataclass(frozen=True)
class Check:
    held: bool
    line: str  # "budget check: …"
    worst: dict[str, Any]  # the arm that moved most: run, change, steps needed
    suggested_steps: int  # the budget the trend points to (the current one when held)
    advice: str = ""  # said instead of "the trend points to about N steps": what to change, or other units


def value_at(curve: Sequence[tuple[int, dict[str, Any]]], metric: str, step: float) -> float:
    """The metric at `step`, linearly interpolated between the evals around it."""
    points = [(r["step"], r[metric]) for _, r in curve if metric in r]
    steps, values = np.array([p[0] for p in points], float), np.array([p[1] for p in points], float)
    return float(np.interp(step, steps, values))


def window_changes(row: dict[str, Any], rule: Rule) -> tuple[float, float, float, int]:
    """(change over the last window, over its first half, over its second half, the run's steps);
    relative to the final value when the rule is relative. The halves give the trend: both lie
    inside the window, after any change of regime earlier in the run (a feedback phase's start).
    With 4 or more evals in the window, its start, middle and end are read from a quadratic fitted
    to them (so one noisy eval does not decide), else interpolated between the evals around them."""
    curve = row["curve"]
    end = max(r["step"] for _, r in curve if rule.metric in r)
    width = rule.fraction * end
    at = (end - width, end - width / 2, end)
    inside = [(r["step"], r[rule.metric]) for _, r in curve if rule.metric in r and r["step"] >= end - width]
    if len(inside) >= 4:
        x, y = np.array(inside, float).T
        fit = np.polyfit((x - end) / width, y, 2)
        first, middle, last = (float(np.polyval(fit, (s - end) / width)) for s in at)
    else:
        first, middle, last = (value_at(curve, rule.metric, s) for s in at)
    scale = abs(last) if rule.relative else 1.0
    changes = (abs(last - first), abs(middle - first), abs(last - middle))
    return (*(c / max(scale, 1e-12) for c in changes), int(end))


def arm_means(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per arm (the rows that differ only in their seed), its curve the mean over seeds at
    the evals they share: the check judges what the verdict compares, an arm's mean."""
    arms: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        key = tuple(sorted((k, str(v)) for k, v in row.items() if k.startswith("label.") and k != "label.seed"))
        arms.setdefault(key, []).append(row)
    out = []
    for key, members in arms.items():
        by_step: dict[int, list[dict[str, Any]]] = {}
        for member in members:
            for _, record in member["curve"]:
                by_step.setdefault(record["step"], []).append(record)
        curve = []
        for step, records in sorted(by_step.items()):
            if len(records) == len(members):
                shared = set.intersection(*(set(r) for r in records)) - {"step"}
                numbers = [k for k in shared if all(isinstance(r[k], (int, float)) for r in records)]
                curve.append((step, {"step": step, **{k: float(np.mean([r[k] for r in records])) for k in numbers}}))
        name = ",".join(f"{k.removeprefix('label.')}={v}" for k, v in key) or members[0]["run"]
        out.append({"run": f"{name} (mean of {len(members)} seeds)", "curve": curve})
    return out


def steps_needed(change: float, first_half: float, second_half: float, steps: int, rule: Rule) -> int:
    """The budget whose own last window would change by less than the tolerance, if the quantity
    approaches its limit exponentially at the rate the window's two halves show; twice the budget
    when it is not slowing down (no trend to extrapolate)."""
    if change < rule.tolerance:
        return steps
    ratio = second_half / first_half if first_half > 0 else 1.0
    if ratio >= 0.95:
        return 2 * steps
    half = rule.fraction * steps / 2
    tau = -half / math.log(max(ratio, 1e-6))
    scale = second_half / (math.exp(-(steps - half) / tau) * (1 - math.exp(-half / tau)))  # f = limit - scale·e^(-s/τ)

    def window_change(total: float) -> float:
        return scale * (math.exp(-(1 - rule.fraction) * total / tau) - math.exp(-total / tau))

    total = float(steps)
    while window_change(total) >= rule.tolerance and total < 100 * steps:
        total *= 1.05
    return int(math.ceil(total / 100) * 100)


def check(rows: Sequence[dict[str, Any]], rules: Sequence[Rule], what: str = "") -> Check:
    """The check over every arm (its seeds' mean) and rule; `what` names the runs in the line."""
    worst: dict[str, Any] = {}
    suggested = 0
    for rule in rules:
        for row in arm_means(rows):
            change, first_half, second_half, steps = window_changes(row, rule)
            needed = steps_needed(change, first_half, second_half, steps, rule)
            suggested = max(suggested, needed)
            margin = change / rule.tolerance
            if not worst or margin > worst["margin"]:
                worst = {"run": row["run"], "rule": rule, "change": change, "margin": margin, "steps": steps,
                         "needed": needed}  # fmt: skip
    rule = worst["rule"]
    amount = f"{100 * worst['change']:.2f}%" if rule.relative else f"{worst['change']:.4f}"
    held = worst["margin"] < 1
    scope = f" ({what})" if what else ""
    rules_text = "; ".join(r.describe() for r in rules)
    if held:
        line = (
            f"budget check: held{scope} - rule: {rules_text}. Largest change: {amount} "
            f"({worst['run']}, {rule.metric}, last {100 * rule.fraction:g}% of {worst['steps']} steps)."
        )
    else:
        line = (
            f"budget check: failed{scope} - rule: {rules_text}. {worst['run']} moved {amount} in {rule.metric} over "
            f"the last {100 * rule.fraction:g}% of {worst['steps']} steps; the trends point to about {suggested} steps."
        )
    return Check(held, line, worst, suggested)


def combined(checks: Sequence[Check]) -> Check:
    """Several checks as one: held where all held; the line of the first that failed (else the first)."""
    failed = [c for c in checks if not c.held]
    first = (failed or list(checks))[0]
    return Check(not failed, first.line, first.worst, max(c.suggested_steps for c in checks), first.advice)


def check_with_feedback(
    rows: Sequence[dict[str, Any]], rules: Sequence[Rule], feedback_rules: Sequence[Rule], what: str = ""
) -> Check:
    """Every arm under `rules`, and the arms trained with feedback (schedule other than `k1`) also
    under `feedback_rules` (the K>1 quantities a K=1-only model never trains)."""
    feedback = [r for r in rows if r["label.schedule"] != "k1"]
    return combined([check(rows, rules, what), check(feedback, feedback_rules, what)])


def verdict(check_result: Check, decided: str) -> str:
    """The verdict as written: `decided` where the budget held, else undecided with the budget the
    trend points to."""
    if check_result.held:
        return decided
    advice = check_result.advice or f"the trend points to about {check_result.suggested_steps} steps"
    return f"undecided at this budget ({advice})"


# --- the verdict rule: judge a claim by its effect (issue #36) -----------------------------------------
#
# The budget check above asks every arm's every quantity to be flat. A verdict about a claim needs
# less and is fixed before any outcome is read, the same for every claim:
#   settled: the quantities the claim's effect is computed from, for the arms it compares, changed
#     by less than their tolerance over the last 20% of training (`check` on those arms only);
#   stable over a ladder: on budgets spanning at least LADDER_SPAN×, the effect (per seed) has the
#     same sign at every rung, lies more than two standard errors (over seeds) from zero at the top
#     two, and differs between them by less than two standard errors of that difference.
# Where either holds the top rung's effect decides: the paper's sign beyond two standard errors (and
# beyond `minimum`) is reproduced, the other sign the opposite of the paper, and within the noise of
# zero not reproduced (reached only when settled: a stable ladder is never within noise at its top).

LADDER_SPAN = 2.5  # the smallest budget ratio a ladder must span to show an effect stable
EFFECT_SE = 2.0  # standard errors: the effect's distance from zero, and the top two rungs' agreement


@dataclasses.dataclass(frozen=True)
class Rung:
    """An effect at one budget: its per-seed values, or (for a rung only a block's `mean ± std`
    remembers) its mean, sample std and number of seeds, which are all the rule reads."""

    steps: int
    values: tuple[float, ...] = ()
    summary: tuple[float, float, int] | None = None  # (mean, sample std, seeds) when values are gone

    @property
    def mean(self) -> float:
        return float(np.mean(self.values)) if self.values else self.summary[0]

    @property
    def seeds(self) -> int:
        return len(self.values) if self.values else self.summary[2]

    @property
    def se(self) -> float:
        """The standard error of the mean over seeds (inf with fewer than two)."""
        if self.seeds < 2:
            return math.inf
        std = float(np.std(self.values, ddof=1)) if self.values else self.summary[1]
        return std / math.sqrt(self.seeds)

    @classmethod
    def from_record(cls, steps: int, kept: list[float] | dict[str, Any]) -> Rung:
        """A rung as summary.json keeps it: its per-seed values, or {mean, std, seeds}."""
        if isinstance(kept, list):
            return cls(steps, tuple(kept))
        return cls(steps, summary=(kept["mean"], kept["std"], kept["seeds"]))

    def record(self) -> list[float] | dict[str, Any]:
        """What summary.json keeps of this rung (`from_record`'s inverse)."""
        if self.values:
            return list(self.values)
        mean, std, seeds = self.summary
        return {"mean": mean, "std": std, "seeds": seeds}


@dataclasses.dataclass(frozen=True)
class Judgement:
    verdict: str  # reproduced | not reproduced | the opposite of the paper | undecided at this budget (...)
    criterion: str  # "settled", "stable over a ladder", or "" (neither held)
    line: str  # "verdict rule: ..." naming the criterion that held, or why neither did


def ladder(earlier: Sequence[Rung], rung: Rung) -> list[Rung]:
    """The ladder a verdict reads: the `earlier` rungs (recorded or measured before), but one that
    `rung` measured again, then `rung`."""
    return [*(r for r in earlier if r.steps != rung.steps), rung]


def ladder_stability(rungs: Sequence[Rung]) -> tuple[bool, str]:
    """Whether the effect is stable over the ladder `rungs` (see above), and why (or why not)."""
    rungs = sorted(rungs, key=lambda r: r.steps)
    if len(rungs) < 2 or rungs[-1].steps < LADDER_SPAN * rungs[0].steps:
        span = f"{rungs[-1].steps / rungs[0].steps:g}×" if len(rungs) > 1 else "one budget"
        return False, f"no ladder spanning {LADDER_SPAN:g}× ({span})"
    values = ", ".join(f"{r.mean:+.3g}" for r in rungs)
    signs = {np.sign(r.mean) for r in rungs}
    if len(signs) > 1 or 0 in signs:
        return False, f"the effect {'is zero at a rung' if 0 in signs else 'changes sign'} over the ladder ({values})"
    second, top = rungs[-2], rungs[-1]
    if min(abs(second.mean) / second.se, abs(top.mean) / top.se) <= EFFECT_SE:
        return False, (
            f"the effect is within {EFFECT_SE:g} standard errors of zero at the top two rungs "
            f"({second.mean:+.3g} ± {second.se:.2g}, {top.mean:+.3g} ± {top.se:.2g})"
        )
    gap, gap_se = abs(top.mean - second.mean), math.hypot(top.se, second.se)
    steps = f"{rungs[0].steps}→{top.steps} steps ({top.steps / rungs[0].steps:g}×)"
    if gap >= EFFECT_SE * gap_se:
        return False, (
            f"the effect still moves between the top two rungs ({second.mean:+.3g} → {top.mean:+.3g}, "
            f"{gap:.2g} ≥ {EFFECT_SE:g} × {gap_se:.2g}) over {steps}: {values}"
        )
    return True, (
        f"stable over {steps}: {values}, one sign at every rung, "
        f"{abs(second.mean) / second.se:.1f} and {abs(top.mean) / top.se:.1f} standard errors from zero at the top "
        f"two, which differ by {gap:.2g} < {EFFECT_SE:g} × {gap_se:.2g}"
    )


def judge(
    effect: str,
    rungs: Sequence[Rung],
    settled: Check,
    paper_sign: int = 1,
    minimum: float = 0.0,
    at_most: float | None = None,
) -> Judgement:
    """The verdict on a claim whose `effect` (its name, e.g. "soft − standard accuracy") was measured
    per seed at the budgets `rungs`; `settled` is the budget check restricted to the arms and
    quantities the effect is computed from (at the top rung). `paper_sign` is the effect's sign
    where the paper's claim holds; `minimum` the size below which it does not count as reproduced.
    A claim of no cost gives `at_most` instead: reproduced where the effect (a cost) is below it by
    two standard errors, not reproduced otherwise."""
    stable, why = ladder_stability(rungs)
    top = max(rungs, key=lambda r: r.steps)
    said = f"{effect} {top.mean:+.3g} ± {top.se:.2g} (standard error over {top.seeds} seeds) at {top.steps} steps"
    if not (stable or settled.held):
        reason = settled.line.split(" - ", 1)[-1].rstrip(".")  # after "budget check: failed (what) - "
        line = f"verdict rule: neither criterion held: not settled ({reason}); not stable over a ladder: {why}"
        return Judgement(verdict(settled, ""), "", line)
    criterion = "stable over a ladder" if stable else "settled"
    if at_most is not None:
        decided = "reproduced" if top.mean + EFFECT_SE * top.se <= at_most else "not reproduced"
    elif abs(top.mean) <= EFFECT_SE * top.se:
        decided = "not reproduced"
    elif np.sign(top.mean) == paper_sign:
        decided = "reproduced" if abs(top.mean) > minimum else "not reproduced"
    else:
        decided = "the opposite of the paper"
    evidence = why if stable else f"the compared arms settled ({settled.line.split(' - ', 1)[-1].rstrip('.')})"
    return Judgement(decided, criterion, f"verdict rule: {criterion}: {evidence}; {said}: {decided}")
