"""Scoring generations: answer extraction, comparison, pass@k and intervals.

- `extract` pulls the answer out of a generation (or the gold answer out of a reference) by a
  spec's rule: the whole text, the last number, a regex's group, the text after a marker, or the
  last `\\boxed{…}` (MATH).
- `pass_at_k` is the unbiased estimator of Chen et al. (2021): with n samples of which c pass,
  1 − C(n − c, k) / C(n, k), computed as a stable product.
- Intervals are 95%: Wilson's for a proportion (one greedy generation per problem), a seeded
  percentile bootstrap over problems for pass@k means and for paired differences between modes.
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
# Unicode minus signs (U+2212 minus, small and fullwidth hyphen-minus) read as "-" everywhere; the
# dashes (hyphens, figure, en and em dash) only as a sign: before a digit, after no letter or digit
# (so "−3" and "–3" are -3, while a range "3–5" keeps its 5).
MINUS_SIGNS = re.compile("[\u2212\ufe63\uff0d]")
SIGN_DASHES = re.compile(r"(?<![\w.])[\u2010\u2011\u2012\u2013\u2014](?=\.?\d)")
Z95 = 1.959963984540054


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def extract(text: str, rule: dict[str, Any]) -> str | None:
    """The answer in `text` by `rule` (see the module docstring), stripped; None if there is none."""
    kind = rule["kind"]
    if kind == "text":
        found = text
    elif kind == "last_number":
        numbers = NUMBER.findall(ascii_minus(text))
        found = numbers[-1] if numbers else None
    elif kind == "regex":
        matches = list(re.finditer(rule["pattern"], text))
        found = (matches[-1].group(1) if matches[-1].re.groups else matches[-1].group(0)) if matches else None
    elif kind == "after_marker":
        found = text.rsplit(rule["marker"], 1)[1] if rule["marker"] in text else None
    else:
        found = _last_boxed(text)
    return None if found is None else found.strip()


def ascii_minus(text: str) -> str:
    """`text` with Unicode minus signs, and dashes used as signs, written as an ASCII "-"."""
    return SIGN_DASHES.sub("-", MINUS_SIGNS.sub("-", text))


def _number(text: str) -> float | None:
    try:
        return float(ascii_minus(text).replace(",", "").replace("$", "").rstrip(".").strip())
    except ValueError:
        return None


def normalize(text: str) -> str:
    """Whitespace collapsed, surrounding `$`/spaces and a final period removed (exact comparison)."""
    return " ".join(text.split()).strip("$ ").rstrip(".")


def same_answer(predicted: str | None, gold: str, compare: str) -> bool:
    """Whether an extracted answer equals the gold one (`exact` after normalising, or `numeric`)."""
    if predicted is None:
        return False
    if compare == "numeric":
        a, b = _number(predicted), _number(gold)
        if a is None or b is None:
            return normalize(predicted) == normalize(gold)
        return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)
    return normalize(predicted) == normalize(gold)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem with n samples, c of them correct (needs n >= k)."""
    if n < k:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def wilson(successes: float, trials: int) -> tuple[float, float]:
    """95% Wilson score interval of a proportion, containing it: exactly 0 at 0 successes and 1 at
    all (in floating point centre − half lands a few ulps off, e.g. 5.6e-17 above 0 at 0 of 3, which
    made the plot's error bars negative)."""
    if trials == 0:
        return (float("nan"), float("nan"))
    p = successes / trials
    denominator = 1 + Z95**2 / trials
    centre = (p + Z95**2 / (2 * trials)) / denominator
    half = Z95 * math.sqrt(p * (1 - p) / trials + Z95**2 / (4 * trials**2)) / denominator
    low, high = (0.0 if successes <= 0 else centre - half), (1.0 if successes >= trials else centre + half)
    return (min(p, max(0.0, low)), max(p, min(1.0, high)))


def resamples(n: int, seed: int = 0, count: int = 2000) -> np.ndarray:
    """`count` bootstrap draws of n items' indices (seeded: the same draws for the same n and seed)."""
    return np.random.default_rng(seed).integers(0, n, (count, n))


def percentile_interval(statistics: Any, point: float) -> tuple[float, float]:
    """The 95% percentile interval of a statistic's bootstrap values, containing its `point` (equal
    values resample to statistics an ulp off the point)."""
    low, high = np.percentile(np.asarray(statistics, np.float64), [2.5, 97.5])
    return (min(float(low), point), max(float(high), point))


def bootstrap(values: np.ndarray, seed: int = 0, count: int = 2000) -> tuple[float, float]:
    """95% percentile bootstrap interval of the mean of per-problem values (seeded)."""
    values = np.asarray(values, np.float64)
    if len(values) == 0:
        return (float("nan"), float("nan"))
    means = values[resamples(len(values), seed, count)].mean(axis=1)
    return percentile_interval(means, float(values.mean()))


def summarize(
    correct_by_problem: dict[str, list[bool]], tokens: list[int], ks: tuple[int, ...], seed: int = 0
) -> dict[str, Any]:
    """A task × mode row: pass@k for each k (accuracy when one sample), its interval, answer length."""
    problems = sorted(correct_by_problem)
    row: dict[str, Any] = {"problems": len(problems), "generations": len(tokens)}
    for k in ks:
        per_problem = np.array([pass_at_k(len(correct_by_problem[p]), sum(correct_by_problem[p]), k) for p in problems])
        row[f"pass@{k}"] = float(per_problem.mean())
        single = all(len(correct_by_problem[p]) == 1 for p in problems)
        interval = wilson(per_problem.sum(), len(problems)) if single else bootstrap(per_problem, seed)
        row[f"pass@{k}_ci"] = list(interval)
    row["mean_tokens"] = float(np.mean(tokens)) if tokens else float("nan")
    row["median_tokens"] = float(np.median(tokens)) if tokens else float("nan")
    return row


def paired(
    mode: dict[str, list[bool]], standard: dict[str, list[bool]], k: int, seed: int = 0
) -> dict[str, float | list[float]]:
    """pass@k of a mode minus standard's on the problems both decoded, with its bootstrap interval."""
    common = sorted(set(mode) & set(standard))
    diff = np.array(
        [pass_at_k(len(mode[p]), sum(mode[p]), k) - pass_at_k(len(standard[p]), sum(standard[p]), k) for p in common]
    )
    return {"problems": len(common), "difference": float(diff.mean()) if len(diff) else float("nan"),
            "ci": list(bootstrap(diff, seed))}  # fmt: skip
