"""Tokens to match (experiments/text_efficiency.py): how many tokens a plain model needs to reach a
feedback model's loss, read off the plain runs' final losses against their tokens (log-linear
between them), with a bootstrap interval over seeds. `groups` maps a run name to its seeds' rows
(what `fbt-sweep report` gathers); the plain runs are those whose name starts with "plain".
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

Rows = dict[str, list[dict[str, Any]]]


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


def plain_points(groups: Rows, seeds: list[int] | None = None) -> list[tuple[float, float]]:
    """(tokens, final K=1 loss) of the plain runs, averaged over `seeds` (a list with repeats: a
    bootstrap draw) or all of them."""
    points = []
    for name, rows in groups.items():
        if name.startswith("plain"):
            by_seed = {r["label.seed"]: r["final_loss_K1"] for r in rows}
            chosen = seeds if seeds is not None else list(by_seed)
            points.append((rows[0]["tokens"], float(np.mean([by_seed[s] for s in chosen]))))
    return sorted(points)


def ratio(groups: Rows, arm: str, k: int, seeds: list[int] | None = None) -> float:
    """Tokens a plain model needs to match `arm`'s final K=k loss, as a multiple of N (inf: more
    than the largest plain budget)."""
    plain = plain_points(groups, seeds)
    by_seed = {r["label.seed"]: r[f"final_loss_K{k}"] for r in groups[arm]}
    target = float(np.mean([by_seed[s] for s in (seeds if seeds is not None else list(by_seed))]))
    tokens = tokens_to_reach(target, plain)
    return math.inf if tokens is None else tokens / plain[0][0]


def interval(groups: Rows, arm: str, k: int, draws: int = 2000) -> tuple[float, float]:
    """The 5th and 95th percentiles of the ratio over bootstrap draws of the seeds (paired: a
    seed's plain and feedback runs are drawn together)."""
    seeds = sorted({r["label.seed"] for r in groups[arm]})
    rng = np.random.default_rng(0)
    values = [ratio(groups, arm, k, list(rng.choice(seeds, len(seeds)))) for _ in range(draws)]
    low, high = np.percentile(values, [5, 95])
    return float(low), float(high)


def times(value: float, most: float) -> str:
    """A ratio of tokens as written: '> 2×' beyond the plain runs, '≤ 1×' where plain_N is already as good."""
    if not math.isfinite(value):
        return f"> {most:g}×"
    return "≤ 1×" if value <= 1.0 else f"{value:.2f}×"
