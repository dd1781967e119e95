"""The Trainer end to end: reproducible runs, and what it refuses to resume from."""

import glob
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import checkpointed_config, read_jsonl, run_config, tree_snapshot

from fbt_jax.checkpoint import Checkpointer
from fbt_jax.errors import CheckpointError, ConfigError
from fbt_jax.train.trainer import Trainer


def test_training_is_reproducible(tmp_path):
    runs = []
    for name in ("a", "b"):
        trainer = Trainer(run_config(tmp_path, name, schedule="0:2"), log=lambda *_: None)
        trainer.train(progress=False)
        runs.append((trainer.state.params, read_jsonl(os.path.join(tmp_path, name))))
    (params_a, rows_a), (params_b, rows_b) = runs
    assert [r["loss"] for r in rows_a] == [r["loss"] for r in rows_b]
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params_a), jax.tree.leaves(params_b)))


def test_a_non_finite_checkpoint_is_refused_and_left_alone(tmp_path):
    config = checkpointed_config(tmp_path, steps=2)
    trainer = Trainer(config, log=lambda *_: None)
    trainer.init_state()
    poisoned = trainer.state.replace(params=jax.tree.map(lambda x: x * jnp.nan, trainer.state.params))
    checkpointer = Checkpointer(os.path.join(config.workdir, "checkpoints"), config.checkpoint)
    checkpointer.save(2, poisoned, config, force=True)
    checkpointer.wait()
    checkpointer.close()
    before = tree_snapshot(config.workdir)
    with pytest.raises(CheckpointError, match="holds non-finite values"):
        Trainer(config, log=lambda *_: None).train(progress=False)
    assert tree_snapshot(config.workdir) == before


@pytest.mark.slow
def test_resume_shows_changes_and_guards_the_data_order(tmp_path):
    config = checkpointed_config(tmp_path, steps=2)
    Trainer(config, log=lambda *_: None).train(progress=False)
    before = tree_snapshot(os.path.join(config.workdir, "checkpoints"))
    config.train.steps, config.train.batch_size, config.seed = 4, 16, 7
    messages = []
    with pytest.raises(ConfigError, match="allow_resume_changes") as err:
        Trainer(config, log=messages.append).train(progress=False)
    assert "\n" not in str(err.value)
    assert "resume: changed train.steps: 2 -> 4" in messages
    assert {"resume: changed seed: 0 -> 7", "resume: changed train.batch_size: 32 -> 16"} <= set(messages)
    assert tree_snapshot(os.path.join(config.workdir, "checkpoints")) == before
    config.checkpoint.allow_resume_changes = True
    summary = Trainer(config, log=messages.append).train(progress=False)
    assert summary["start_step"] == 2
    kept = glob.glob(os.path.join(config.workdir, "config.before-step-2-*.json"))
    assert len(kept) == 1 and json.load(open(kept[0]))["seed"] == 0  # the old config beside the new
    assert json.load(open(os.path.join(config.workdir, "config.json")))["seed"] == 7
