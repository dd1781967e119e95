"""The contraction monitor: does the feedback map settle when run for more passes than trained?

Pass k's states Hᵏ = F(fuse(E, shift(Hᵏ⁻¹))) iterate one map. A model trained on passes {1, 2}
only may learn a map that drifts or diverges beyond them; with some 3-pass batches the paper
finds a map that contracts to a fixed point (docs/method.md §6). The monitor measures the
relative per-pass change cₖ = ‖Hᵏ − Hᵏ⁻¹‖ / ‖Hᵏ‖ for the passes just beyond the trained K on
held-out rows, and from it

- the contraction rate (c_last / c_first)^(1/(n−1)): the factor by which the change shrinks
  per pass (a geometric fit through the end points);
- a verdict: contracting when that rate is below 1 *and* the last change is below 1. The second
  condition matters: a chaotic map moves the states by about √2 of their norm every pass
  (successive states are unrelated), which is saturated, not shrinking, whatever the rate says.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp


def monitored_passes(trained_max_passes: int, contraction_passes: int) -> tuple[int, int]:
    """The first and last pass the monitor measures: the `contraction_passes` passes after the
    largest K the schedule trains."""
    first = trained_max_passes + 1
    return first, first + contraction_passes - 1


def pass_change_sums(
    states: Sequence[jax.Array], first: int, last: int, fuse_from_B: jax.Array, positions_BT: jax.Array
) -> dict[str, jax.Array]:
    """For passes `first` … `last` (states[k − 1] is pass k): the sums ‖Hᵏ − Hᵏ⁻¹‖² and ‖Hᵏ‖² in
    fp32, keyed `change_sq_{k}` and `state_sq_{k}`, so that batches and hosts combine exactly.

    Only positions that pass k can still change count. Before position p + k − 2 the states of
    pass k − 1 are already exact (the exactness property, docs/method.md §5): counting those
    zeros would make any map look as if it contracted as k grows.
    """
    out = {}
    for k in range(max(first, 2), last + 1):
        out[f"change_sq_{k}"], out[f"state_sq_{k}"] = change_sums(
            states[k - 1], states[k - 2], k, fuse_from_B, positions_BT
        )
    return out


def change_sums(
    h_BTD: jax.Array, h_prev_BTD: jax.Array, k: int | jax.Array, fuse_from_B: jax.Array, positions_BT: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """‖Hᵏ − Hᵏ⁻¹‖² and ‖Hᵏ‖² (fp32) over the positions pass k can still change, t ≥ p + k − 2."""
    open_BT1 = (positions_BT >= fuse_from_B[:, None] + k - 2)[..., None]
    h_BTD, h_prev_BTD = h_BTD.astype(jnp.float32), h_prev_BTD.astype(jnp.float32)
    change_sq = jnp.sum(jnp.where(open_BT1, jnp.square(h_BTD - h_prev_BTD), 0.0))
    return change_sq, jnp.sum(jnp.where(open_BT1, jnp.square(h_BTD), 0.0))


def contraction_rate(changes: Sequence[float]) -> float:
    """(cₙ / c₁)^(1/(n−1)) over successive passes' changes; 0 when the states stopped changing."""
    if len(changes) < 2:
        raise ValueError(f"a contraction rate needs the change of at least 2 passes, got {len(changes)}")
    first, last = changes[0], changes[-1]
    if first <= 0.0:
        return 0.0
    return float((last / first) ** (1.0 / (len(changes) - 1)))


def is_contracting(changes: Sequence[float]) -> bool:
    """Shrinking change (rate < 1) that is not saturated (last change < 1)."""
    return contraction_rate(changes) < 1.0 and changes[-1] < 1.0


def summarize(totals: Mapping[str, float], first: int, last: int) -> dict[str, float]:
    """The monitor's metrics from summed `pass_change_sums`: `pass_change_K{k}` for each pass,
    `contraction_rate`, and `contracting` (1.0 or 0.0, so that it plots)."""
    changes = [
        math.sqrt(totals[f"change_sq_{k}"] / max(totals[f"state_sq_{k}"], 1e-30)) for k in range(first, last + 1)
    ]
    out = {f"pass_change_K{k}": c for k, c in zip(range(first, last + 1), changes)}
    out["contraction_rate"] = contraction_rate(changes)
    out["contracting"] = float(is_contracting(changes))
    return out


def changes_of(metrics: Mapping[str, float]) -> dict[int, float]:
    """The per-pass changes in a metrics record, by pass."""
    return {int(key.removeprefix("pass_change_K")): v for key, v in metrics.items() if key.startswith("pass_change_K")}


def describe(metrics: Mapping[str, float]) -> str:
    """One line: 'passes 4–7: change 0.21 → 0.11, ×0.81 per pass (contracting)'."""
    changes = changes_of(metrics)
    first, last = min(changes), max(changes)
    verdict = "contracting" if metrics["contracting"] else "NOT contracting"
    return (
        f"passes {first}–{last}: per-pass change {changes[first]:.3g} → {changes[last]:.3g}, "
        f"×{metrics['contraction_rate']:.3f} per pass ({verdict})"
    )


def warning(metrics: Mapping[str, float], step: int, feedback_trained: bool) -> str | None:
    """The warning a run logs when the feedback map it trained does not contract, else None.

    Before any step has trained a feedback pass (K ≥ 2; `feedback_trained` False) the map is its
    initialisation: whatever the monitor measures then says nothing about training, so no warning.
    """
    if not feedback_trained or "contracting" not in metrics or metrics["contracting"]:
        return None
    return (
        f"warning: at step {step} the feedback map is not contracting ({describe(metrics)}); "
        "decoding with more feedback passes than trained may drift or diverge"
    )
