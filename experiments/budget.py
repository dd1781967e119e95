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
    advice: str = ""  # what to change instead, where more steps are not the answer


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
