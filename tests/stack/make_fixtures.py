"""Makes this stack's fixtures for tests/test_stack.py, the checks that the two ends of the supported
JAX stack (.ci/lowest.txt and the newest versions pyproject.toml allows) read each other's work:

- `checkpoint-jax<version>/`: a tiny run (configs/tiny.py, narrowed) checkpointed at step 2 of 4,
  with `expected.json`: the losses of steps 3 and 4 and the digests of the parameters after step 4
  that this stack computed without stopping.
- with `--schedule`: `schedule_bits-jax<version>.json`, the digests of our learning-rate schedule
  under jit for every length, warm-up, rate and ratio that tests/test_learning_rate.py checks. Run
  it where the bits change: under the lowest stack (jax 0.11.2, where they are also optax's: the
  script refuses otherwise) and under a jax whose XLA:CPU computes them otherwise (0.12.1, whose
  `cos` rounds some arguments by one ulp otherwise: docs/platform-notes.md). A jax reads the file
  of the newest version at or below its own.

Run from the repository root, in each venv (`--schedule` writes the schedule's file only):

    python tests/stack/make_fixtures.py [--schedule]

Last run: Python 3.12.1; jax/jaxlib 0.11.2, flax 0.12.10, orbax-checkpoint 0.12.4 (lowest, with
--schedule), jax/jaxlib 0.12.0.1, flax 0.12.12, orbax-checkpoint 0.12.8 (newest that `jax[tpu]`
resolves) and 0.12.1 (--schedule only).
"""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import json
import os
import shutil
import sys
import tempfile

# As tests/conftest.py sets it: under jax 0.11.2 the CPU's bits depend on how many devices the
# process has (8 host devices round a step otherwise than 1, even on one of them).
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

from fbt_jax.train.trainer import Trainer  # noqa: E402

# The fixture's run: the first checkpoint is restored, the second is what must come out.
STEPS, SAVED_AT = 4, 2
# Every case tests/test_learning_rate.py checks: (train.steps, warm-up, peak rate, end ratio).
SCHEDULES = [
    case
    for case in itertools.product([4, 60, 300, 3000, 15000], [0, 1, 50, 100], [3e-3, 6e-4, 0.1], [0.0, 0.1])
    if case[1] < case[0]
]


def load_config(name: str):
    """configs/<name>.py's config. Not tests/conftest.py's: importing it turns most of XLA's
    optimisations off in this process, and the fixtures hold the bits a user's run computes."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "configs", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def fixture_config(workdir: str):
    """A 4-step run with K drawn from {1, 2} and a checkpoint every 2 steps, narrowed so that its
    checkpoint stays small in the repository."""
    config = load_config("tiny")
    config.workdir = workdir
    config.train.steps, config.train.log_every, config.optimizer.warmup_steps = STEPS, 1, 1
    config.passes.schedule = "0:1=0.5,2=0.5"
    config.eval.num_batches = 0
    config.checkpoint.every_steps = SAVED_AT
    config.model.embed_dim, config.model.mlp_dim = 32, 64
    return config


def losses(workdir: str) -> dict[int, float]:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return {record["step"]: record["loss"] for record in map(json.loads, f) if "loss" in record}


def digest(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def param_digests(state) -> dict[str, str]:
    """Per parameter, by its path of names and indices (a Flax release may wrap a leaf otherwise)."""
    leaves = jax.tree_util.tree_flatten_with_path(jax.tree.map(np.asarray, state.params))[0]
    return {"/".join(_name(key) for key in path if _name(key) != "value"): digest(leaf) for path, leaf in leaves}


def _name(key) -> str:
    for field in ("key", "idx", "name"):
        if hasattr(key, field):
            return str(getattr(key, field))
    return str(key)


def stack() -> str:
    return f"jax{jax.__version__}"


def make_checkpoint() -> str:
    out = os.path.join(HERE, f"checkpoint-{stack()}")
    with tempfile.TemporaryDirectory() as tmp:
        config = fixture_config(os.path.join(tmp, "run"))
        trainer = Trainer(config, log=lambda *_: None, devices=jax.devices()[:1])
        trainer.train(progress=False)
        by_step = losses(config.workdir)
        expected = {
            "jax": jax.__version__,
            "losses": {str(step): by_step[step] for step in range(SAVED_AT + 1, STEPS + 1)},
            "params": param_digests(trainer.state),
        }
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        shutil.copytree(
            os.path.join(config.workdir, "checkpoints", str(SAVED_AT)), os.path.join(out, "checkpoints", str(SAVED_AT))
        )
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1, sort_keys=True)
    return out


def schedule_digests() -> dict[str, str]:
    """Our schedule's bits under jit, one step at a time (as the train step computes it), per case;
    on jax 0.11.2 checked to be optax's (jax 0.12's XLA no longer folds optax's constants, so there
    tests/test_learning_rate.py checks them against optax's unfolded order instead)."""
    import jax.numpy as jnp
    import optax

    from fbt_jax.train.learning_rate import learning_rate, schedule_constants

    ours = jax.jit(lambda steps_S, constants: jax.lax.map(lambda step: learning_rate(step, constants), steps_S))
    digests = {}
    for steps, warmup, peak, ratio in SCHEDULES:
        steps_S = jnp.arange(0, steps + 3, dtype=jnp.int32)
        reference = optax.warmup_cosine_decay_schedule(0.0, peak, warmup, steps, end_value=peak * ratio)
        expected = np.asarray(jax.jit(lambda s, reference=reference: jax.lax.map(reference, s))(steps_S))
        config = load_config("tiny")
        config.train.steps, config.optimizer.warmup_steps = steps, warmup
        config.optimizer.learning_rate, config.optimizer.min_learning_rate_ratio = peak, ratio
        constants = {k: jnp.asarray(v) for k, v in schedule_constants(config).items()}
        got = np.asarray(ours(steps_S, constants))
        if jax.__version__ == "0.11.2" and not np.array_equal(got.view(np.int32), expected.view(np.int32)):
            sys.exit(f"make_fixtures.py: on {stack()} our schedule is not optax's for {steps, warmup, peak, ratio}")
        digests[f"{steps},{warmup},{peak},{ratio}"] = digest(got)
    return digests


if __name__ == "__main__":
    if sys.argv[1:] not in ([], ["--schedule"]):
        sys.exit("usage: python tests/stack/make_fixtures.py [--schedule]")
    if "--schedule" in sys.argv[1:]:
        path = os.path.join(HERE, f"schedule_bits-jax{jax.__version__}.json")
        with open(path, "w") as f:
            json.dump({"jax": jax.__version__, "digests": schedule_digests()}, f, indent=1)
        print("wrote", path)
    else:
        print("wrote", make_checkpoint())
