"""Pass-count curriculum (docs/method.md §6): which K each training step uses.

A schedule is a list of phases `(start, {K: probability})`. It is written in configs as one
string, easy to override from the command line and to sweep:

    "0.0:1=1.0; 0.75:2=0.88,3=0.12"     (the default: ≈ 75% K=1, 22% K=2, 3% K=3 overall)

Phases are separated by ';'. A start with a decimal point is a fraction of `train.steps` (floored
to a step); an integer is a step. `K` alone means `K=1.0`. The first phase must start at 0.

K for step s is a pure function of (seed, s): a keyed hash, not a stateful RNG, so every host and
every restart draws the same K without communicating, whatever else happened before step s.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from collections import Counter

from fbt_jax.errors import ConfigError

DEFAULT_SCHEDULE = "0.0:1=1.0; 0.75:2=0.88,3=0.12"


@dataclasses.dataclass(frozen=True)
class Phase:
    start_step: int
    mixture: tuple[tuple[int, float], ...]  # ((K, probability), ...) sorted by K

    @property
    def mean_passes(self) -> float:
        return sum(k * p for k, p in self.mixture)


@dataclasses.dataclass(frozen=True)
class PassSchedule:
    phases: tuple[Phase, ...]
    seed: int

    @classmethod
    def parse(cls, spec: str, total_steps: int, seed: int, field: str = "passes.schedule") -> PassSchedule:
        """Parse and validate a schedule string; raises ConfigError naming `field` and the fix."""
        if not isinstance(spec, str) or not spec.strip():
            raise ConfigError(f"{field} must be a non-empty string like {DEFAULT_SCHEDULE!r}")
        phases = []
        for text in (part.strip() for part in spec.split(";")):
            if not text:
                continue
            start_text, sep, mix_text = text.partition(":")
            if not sep:
                raise ConfigError(
                    f"{field}: phase {text!r} lacks 'start:'; write phases as 'START:K=P,K=P', e.g. {DEFAULT_SCHEDULE!r}"
                )
            phases.append(Phase(_parse_start(start_text.strip(), total_steps, field), _parse_mixture(mix_text, field)))
        if phases[-1].start_step >= total_steps and len(phases) > 1:
            raise ConfigError(
                f"{field}: a phase starts at step {phases[-1].start_step}, at or after train.steps={total_steps}, so "
                "it would never run; start it earlier or train longer"
            )
        if phases[0].start_step != 0:
            raise ConfigError(
                f"{field}: the first phase starts at step {phases[0].start_step}; it must start at 0 (write '0.0:...')"
            )
        for prev, nxt in zip(phases, phases[1:]):
            if nxt.start_step <= prev.start_step:
                raise ConfigError(
                    f"{field}: phase starts must increase, got step {nxt.start_step} after {prev.start_step} "
                    f"(fractions are floored to steps of train.steps={total_steps}); order the phases by start "
                    "and keep them at least one step apart"
                )
        return cls(tuple(phases), seed)

    @property
    def pass_counts(self) -> tuple[int, ...]:
        """Every K the schedule can draw (one compiled program each)."""
        return tuple(sorted({k for ph in self.phases for k, _ in ph.mixture}))

    def phase_at(self, step: int) -> Phase:
        current = self.phases[0]
        for phase in self.phases:
            if phase.start_step <= step:
                current = phase
        return current

    def num_passes(self, step: int) -> int:
        """K for `step`, a pure function of (seed, step)."""
        u = _uniform(self.seed, step)
        cumulative = 0.0
        mixture = self.phase_at(step).mixture
        for k, p in mixture:
            cumulative += p
            if u < cumulative:
                return k
        return mixture[-1][0]  # u within rounding of 1.0

    def first_feedback_step(self, total_steps: int) -> int | None:
        """The first step (counted from 0) that trains a feedback pass (K ≥ 2), or None when no
        step before `total_steps` does. Until it has run, the feedback map is its initialisation,
        so nothing said about it (the contraction monitor's warning) is about training."""
        for i, phase in enumerate(self.phases):
            if not any(k >= 2 and p > 0 for k, p in phase.mixture):
                continue
            end = min(self.phases[i + 1].start_step if i + 1 < len(self.phases) else total_steps, total_steps)
            # A phase that can draw K ≥ 2 draws it within a few steps: stop at the first.
            for step in range(phase.start_step, end):
                if self.num_passes(step) >= 2:
                    return step
        return None

    def expected_num_passes(self, total_steps: int) -> float:
        """Mean K over the run: the compute multiplier relative to one-pass training."""
        total = 0.0
        for i, phase in enumerate(self.phases):
            end = self.phases[i + 1].start_step if i + 1 < len(self.phases) else total_steps
            total += max(0, min(end, total_steps) - phase.start_step) * phase.mean_passes
        return total / max(total_steps, 1)

    def expected_mixture(self, total_steps: int) -> dict[int, float]:
        """Fraction of steps per K implied by the phases (the target overall mix)."""
        out: Counter = Counter()
        for i, phase in enumerate(self.phases):
            end = self.phases[i + 1].start_step if i + 1 < len(self.phases) else total_steps
            length = max(0, min(end, total_steps) - phase.start_step)
            for k, p in phase.mixture:
                out[k] += length * p / max(total_steps, 1)
        return dict(sorted(out.items()))

    def realised_mixture(self, start_step: int, end_step: int) -> dict[int, float]:
        """Fraction of steps in [start_step, end_step) that actually draw each K."""
        counts = Counter(self.num_passes(s) for s in range(start_step, end_step))
        n = max(end_step - start_step, 1)
        return {k: counts.get(k, 0) / n for k in self.pass_counts}

    def describe(self, total_steps: int) -> str:
        phases = "; ".join(
            f"from step {ph.start_step}: " + ", ".join(f"K={k} {p:.0%}" for k, p in ph.mixture) for ph in self.phases
        )
        target = ", ".join(f"K={k} {p:.1%}" for k, p in self.expected_mixture(total_steps).items())
        realised = ", ".join(f"K={k} {p:.1%}" for k, p in self.realised_mixture(0, total_steps).items())
        return (
            f"pass schedule: {phases}\n"
            f"  overall target {target}; realised over {total_steps} steps {realised}; "
            f"compute multiplier (mean K) {self.expected_num_passes(total_steps):.3f}"
        )


def _uniform(seed: int, step: int) -> float:
    digest = hashlib.blake2b(struct.pack("<qq", seed, step), digest_size=8, person=b"fbt-passes").digest()
    return (int.from_bytes(digest, "little") >> 11) / float(1 << 53)


def _parse_start(text: str, total_steps: int, field: str) -> int:
    is_fraction = "." in text or "e" in text.lower()
    try:
        value = float(text) if is_fraction else int(text)
    except ValueError:
        raise ConfigError(
            f"{field}: phase start {text!r} is neither a step (int) nor a fraction of the run (e.g. 0.75)"
        ) from None
    if is_fraction:
        if not 0.0 <= value < 1.0:
            raise ConfigError(
                f"{field}: phase start {text} is a fraction of the run and must lie in [0, 1); use a step number for absolute starts"
            )
        return int(value * total_steps)  # floored, so a fraction never lands past the run
    if value < 0:
        raise ConfigError(f"{field}: phase start {value} is negative; steps count from 0")
    return value


def _parse_mixture(text: str, field: str) -> tuple[tuple[int, float], ...]:
    mixture: dict[int, float] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        k_text, sep, p_text = item.partition("=")
        try:
            k = int(k_text)
            p = float(p_text) if sep else 1.0
        except ValueError:
            raise ConfigError(f"{field}: mixture entry {item!r} is not 'K=probability' (e.g. '2=0.88')") from None
        if k < 1:
            raise ConfigError(f"{field}: pass count K={k} is below 1; every batch runs at least one pass")
        if not 0.0 < p <= 1.0:
            raise ConfigError(f"{field}: probability {p} for K={k} must be in (0, 1]; drop the entry to exclude K={k}")
        if k in mixture:
            raise ConfigError(f"{field}: K={k} appears twice in one phase; give each K once")
        mixture[k] = p
    if not mixture:
        raise ConfigError(f"{field}: a phase has an empty mixture; write at least one 'K=P'")
    total = sum(mixture.values())
    if abs(total - 1.0) > 1e-6:
        raise ConfigError(
            f"{field}: probabilities of mixture {text.strip()!r} sum to {total:.6g}, not 1; rescale them so they sum to 1"
        )
    return tuple(sorted(mixture.items()))
