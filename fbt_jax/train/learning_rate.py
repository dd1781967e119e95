"""The learning-rate schedule, as data: a linear warm-up from 0 to `optimizer.learning_rate`, then a
cosine decay to `min_learning_rate_ratio` × that at `train.steps` — optax's
`warmup_cosine_decay_schedule`, value for value (tests/test_learning_rate.py compares them bitwise).

Its constants are arguments of the compiled train step, not numbers baked into it: runs that
differ only in their length, warm-up or learning rate share their compiled programs, also across
processes through the persistent compilation cache — a run resumed with more steps, a ladder's
rungs, a sweep's jobs of other lengths.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

# The cosine's exponent: 1, as in optax's default (a Python number, as there: `x ** 1.0`).
EXPONENT = 1.0


def schedule_constants(config: ml_collections.ConfigDict) -> dict[str, np.ndarray]:
    """The schedule of `config` as the scalars the train step takes. Each is the value optax's
    schedule computes in Python before tracing (`1 - alpha` included), rounded to float32 as a
    Python number in a traced computation is."""
    o = config.optimizer
    warmup, total = int(o.warmup_steps), int(config.train.steps)
    peak = float(o.learning_rate)
    alpha = 0.0 if peak == 0.0 else peak * float(o.min_learning_rate_ratio) / peak
    if not total - warmup > 0:  # validation says so first, in its own words; optax raises here too
        raise ValueError(f"the cosine decay needs train.steps > optimizer.warmup_steps, got {total} and {warmup}")
    return {
        "warmup_steps": np.int32(warmup),
        # Likewise optax's warm-up `count / transition_steps` becomes `count * (1 / transition_steps)`.
        "inverse_warmup": np.float32(1) / np.float32(max(warmup, 1)),
        "decay_steps": np.float32(float(total - warmup)),
        # XLA's simplifier turns optax's `pi * count / decay_steps`, its divisor a constant there,
        # into `count * (pi * (1 / decay_steps))`, each step rounded to float32: so is this.
        "pi_over_decay": np.float32(np.pi) * (np.float32(1) / np.float32(total - warmup)),
        "peak": np.float32(peak),
        "alpha": np.float32(alpha),
        "one_minus_alpha": np.float32(1 - alpha),
    }


def learning_rate(step: jax.Array, constants: dict[str, jax.Array]) -> jax.Array:
    """The learning rate at `step` (int32): the same operations on the same float32 values as
    optax's schedule, so the same bits."""
    c = constants
    # Warm-up: optax's linear (polynomial, power 1) schedule from 0 to the peak.
    count = jnp.clip(step, 0, c["warmup_steps"])
    frac = 1 - count * c["inverse_warmup"]  # without a warm-up: never selected below
    warm = (0.0 - c["peak"]) * (frac**1) + c["peak"]
    # Then optax's cosine decay, counted from the end of the warm-up.
    count = jnp.minimum(step - c["warmup_steps"], c["decay_steps"])
    cosine_decay = 0.5 * (1 + jnp.cos(count * c["pi_over_decay"]))
    decayed = c["one_minus_alpha"] * cosine_decay**EXPONENT + c["alpha"]
    return jnp.where(step < c["warmup_steps"], warm, c["peak"] * decayed)


def schedule_of(config: ml_collections.ConfigDict) -> optax.Schedule:
    """`config`'s schedule as a function of the step, outside a compiled step (its constants
    fixed): for the optimizer's state layout, reports and tests."""
    constants = {k: jnp.asarray(v) for k, v in schedule_constants(config).items()}
    return functools.partial(_at, constants=constants)


def _at(step: jax.typing.ArrayLike, constants: dict[str, jax.Array]) -> jax.Array:
    return learning_rate(jnp.asarray(step, jnp.int32), constants)
