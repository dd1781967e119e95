"""Forking a run from a trunk (`fork_from`, `train.stop_at_step`): the basis of sweeps that share
their K = 1 phase. A fork continues the trunk's whole train state, so it ends bitwise identical
to the same config trained alone from step 0."""

import os

import jax
import numpy as np
import pytest
from conftest import load_config
from flax import nnx

from fbt_jax.errors import ConfigError
from fbt_jax.train.trainer import Trainer
from fbt_jax.trained import load_model

STEPS = 12
FORK = 6


def config(workdir, schedule="0:1; 0.5:2=0.5,3=0.5", **overrides):
    c = load_config("tiny")
    c.workdir = str(workdir)
    c.train.steps = STEPS
    c.train.log_every = 1
    c.train.batch_size = 8
    c.optimizer.warmup_steps = 2
    c.passes.schedule = schedule
    c.checkpoint.every_steps = 100
    c.eval.num_batches = 0
    for key, value in overrides.items():
        section, field = key.split("__") if "__" in key else (None, key)
        (c[section] if section else c)[field] = value
    return c


def params_of(trainer):
    return [np.asarray(x) for x in jax.tree.leaves(trainer.state.params)]


def train(cfg):
    trainer = Trainer(cfg, log=lambda *_: None, devices=jax.devices()[:1])
    summary = trainer.train(progress=False)
    return trainer, summary


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fork")
    alone, _ = train(config(root / "alone"))
    trunk, trunk_summary = train(config(root / "trunk", train__stop_at_step=FORK))
    return root, alone, trunk_summary


@pytest.mark.slow
def test_a_fork_ends_bitwise_identical_to_the_run_trained_alone(runs):
    root, alone, trunk_summary = runs
    assert trunk_summary["steps"] == FORK and os.path.isdir(root / "trunk" / "checkpoints" / str(FORK))
    fork, summary = train(config(root / "fork", fork_from=str(root / "trunk")))
    assert summary["start_step"] == FORK
    assert all(np.array_equal(a, b) for a, b in zip(params_of(alone), params_of(fork), strict=True))
    assert int(fork.state.step) == STEPS


@pytest.mark.slow
def test_a_fork_of_a_trunk_that_already_ends_there_gets_its_own_checkpoint(runs):
    """A sweep run whose schedule draws the trunk's K to the last step trains nothing after the
    fork, but decoding and evaluation read its workdir: it holds the trunk's final state."""
    root, alone, _ = runs
    fork, summary = train(config(root / "same", fork_from=str(root / "alone")))
    assert summary["start_step"] == STEPS
    assert os.path.isfile(root / "same" / "checkpoints" / str(STEPS) / "commit_success.txt")
    model, _ = load_model(str(root / "same"), log=lambda *_: None)
    restored = [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]
    assert all(np.array_equal(a, b) for a, b in zip(params_of(alone), restored, strict=True))


@pytest.mark.slow
def test_a_fork_whose_schedule_drew_other_passes_before_the_fork_is_refused(runs):
    root, _, _ = runs
    with pytest.raises(ConfigError, match=r"ran K=1 at step \d, where this run's passes.schedule draws K=[23]"):
        train(config(root / "early", schedule="0:1; 0.25:2=0.5,3=0.5", fork_from=str(root / "trunk")))


@pytest.mark.slow
def test_a_fork_that_changes_training_is_refused(runs):
    root, _, _ = runs
    with pytest.raises(ConfigError, match=r"differs in optimizer.learning_rate"):
        train(config(root / "other_lr", optimizer__learning_rate=1e-3, fork_from=str(root / "trunk")))
