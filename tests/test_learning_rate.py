"""The learning-rate schedule as data (fbt_jax/train/learning_rate.py): the bits of optax's
`warmup_cosine_decay_schedule` as the train step used to compile it (constants baked in), and one
compiled train program for runs that differ only in their schedule."""

from __future__ import annotations

import glob
import hashlib
import itertools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import load_config, optimised_programs, run_config

from fbt_jax.train.learning_rate import learning_rate, schedule_constants, schedule_of
from fbt_jax.train.trainer import Trainer


def schedule_config(steps: int, warmup: int, peak: float, ratio: float):
    config = load_config("tiny")
    config.train.steps, config.optimizer.warmup_steps = steps, warmup
    config.optimizer.learning_rate, config.optimizer.min_learning_rate_ratio = peak, ratio
    return config


def test_the_schedule_has_optaxs_bits_under_jit_for_every_length_warmup_and_rate():
    """Compiled as fbt-train compiles the train step, with XLA's full optimisation: its simplifier
    rewrites optax's divisions by constants into multiplications by their reciprocals, which most
    optimisations off (this suite's default) leaves alone. The bits compared are those a run gets."""
    with optimised_programs():
        check_every_schedule()


def version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


# The digests of our schedule per jax whose XLA:CPU computes it otherwise (tests/stack/make_fixtures.py):
# 0.11.2's, which are optax's too, and 0.12.1's, whose `cos` rounds some arguments by one ulp
# otherwise. A jax reads those of the newest version at or below its own.
SCHEDULE_BITS = {
    bits["jax"]: bits
    for bits in (
        json.load(open(path))
        for path in glob.glob(os.path.join(os.path.dirname(__file__), "stack", "schedule_bits-jax*.json"))
    )
}
OURS = SCHEDULE_BITS[max((v for v in SCHEDULE_BITS if version(v) <= version(jax.__version__)), key=version)]


def check_every_schedule() -> None:
    """Our schedule's bits are optax's as jax 0.11.2 compiled it, on every stack up to 0.12.0.1 (both
    ends CI tests): its constants are arguments, which no XLA refolds; on 0.12.1 they are those of
    its own `cos`. optax's own, its constants baked in, are those bits where XLA
    folds `pi * count / decay_steps` into `count * (pi * (1 / decay_steps))` (jax ≤ 0.11), and
    `(count * pi) * (1 / decay_steps)`'s where it no longer does (jax 0.12): either, whole."""
    # One step at a time, as the train step computes it (a vmapped schedule compiles to other bits).
    compiled = jax.jit(lambda steps_S, constants: jax.lax.map(lambda step: learning_rate(step, constants), steps_S))
    unfolded = jax.jit(lambda steps_S, constants: jax.lax.map(lambda step: unfolded_rate(step, constants), steps_S))
    checked, folds = 0, set()
    for steps, warmup, peak, ratio in itertools.product(
        [4, 60, 300, 3000, 15000], [0, 1, 50, 100], [3e-3, 6e-4, 0.1], [0.0, 0.1]
    ):
        if warmup >= steps:
            continue
        steps_S = jnp.arange(0, steps + 3, dtype=jnp.int32)
        reference = optax.warmup_cosine_decay_schedule(0.0, peak, warmup, steps, end_value=peak * ratio)
        expected = np.asarray(jax.jit(lambda steps_S, reference=reference: jax.lax.map(reference, steps_S))(steps_S))
        config = schedule_config(steps, warmup, peak, ratio)
        constants = {k: jnp.asarray(v) for k, v in schedule_constants(config).items()}
        got = np.asarray(compiled(steps_S, constants))
        assert digest(got) == OURS["digests"][f"{steps},{warmup},{peak},{ratio}"], (
            OURS["jax"],
            steps,
            warmup,
            peak,
            ratio,
        )
        if np.array_equal(got.view(np.int32), expected.view(np.int32)):
            folds.add("folded")
        else:
            constants["pi"], constants["inverse_decay"] = jnp.float32(np.pi), jnp.float32(1) / (steps - warmup)
            assert np.array_equal(np.asarray(unfolded(steps_S, constants)).view(np.int32), expected.view(np.int32))
            folds.add("unfolded")
        checked += 1
    assert checked == 102
    # One XLA's way for all: jax 0.11.2 folds every schedule, 0.12.0.1 leaves 90 of 102 unfolded.
    assert folds == {"folded"} or "unfolded" in folds
    lr = schedule_of(schedule_config(300, 50, 3e-3, 0.1))  # outside a compiled step too
    assert float(lr(0)) == 0.0 and float(lr(50)) == pytest.approx(3e-3) and float(lr(300)) == pytest.approx(3e-4)


def unfolded_rate(step: jax.Array, c: dict[str, jax.Array]) -> jax.Array:
    """learning_rate() with optax's cosine argument as jax 0.12's XLA computes it: `(count * pi) *
    (1 / decay_steps)`, each product rounded to float32."""
    count = jnp.minimum(step - c["warmup_steps"], c["decay_steps"])
    cosine_decay = 0.5 * (1 + jnp.cos((count * c["pi"]) * c["inverse_decay"]))
    decayed = c["one_minus_alpha"] * cosine_decay + c["alpha"]
    return jnp.where(step < c["warmup_steps"], learning_rate(step, c), c["peak"] * decayed)


def digest(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


@pytest.mark.slow
def test_runs_that_differ_only_in_their_schedule_or_seed_share_a_compiled_train_program(tmp_path):
    """The second run's train step is the first's, loaded from the persistent compilation cache
    (tests/conftest.py gives the session one), although its length, warm-up, rate and seed differ
    (step.step_constants: arguments of the step, not constants in it)."""
    assert jax.config.jax_compilation_cache_dir
    reports = {}
    for name, steps, warmup, peak, seed in (("short", 7, 1, 3e-3, 0), ("long", 345, 50, 1e-3, 1)):
        config = run_config(tmp_path, name, steps=steps, schedule="0:1")
        config.optimizer.warmup_steps, config.optimizer.learning_rate = warmup, peak
        config.seed = seed
        config.model.mlp_dim = 48  # a program no other test compiles
        trainer = Trainer(config, log=lambda *_: None, devices=jax.devices()[:1])
        reports[name] = trainer.programs.compile(pass_counts=(1,))["train_K1"]
    assert reports["long"]["cache_hit"] == 1.0  # with the schedule or seed baked in, a new program: a miss
