"""Nothing valid is ever discarded: one live run per workdir, no save of a diverged state, a failed
save stops the run with the previous checkpoint intact, SIGINT saves, resume changes are shown."""

import glob
import json
import os
import resource
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_checkpoint import env, losses, small_config, tree_snapshot, wait_for
from test_config import ROOT

from fbt_jax.checkpoint import Checkpointer
from fbt_jax.errors import PREEMPTED_EXIT_CODE, CheckpointError, ConfigError, WorkdirBusy
from fbt_jax.train.trainer import Trainer
from fbt_jax.workdir import RunDirectory

TRAIN = [
    sys.executable,
    "-m",
    "fbt_jax.train",
    "--config=configs/tiny.py",
    "--config.train.log_every=1",
    "--config.optimizer.warmup_steps=1",
    "--config.eval.num_batches=0",
]


def test_a_second_run_on_a_live_workdir_fails_at_once(tmp_path):
    holder = RunDirectory(str(tmp_path / "run"))
    holder.lock()
    config = small_config(tmp_path, steps=2)
    with pytest.raises(WorkdirBusy, match=rf"in use by a live fbt-train \(pid {os.getpid()} on host "):
        Trainer(config, log=lambda *_: None).train(progress=False)
    assert not os.path.exists(os.path.join(config.workdir, "checkpoints"))
    holder.unlock()  # the lock goes with its holder: a later run proceeds
    Trainer(config, log=lambda *_: None).train(progress=False)


def test_a_killed_runs_lock_is_not_in_the_way(tmp_path):
    workdir = str(tmp_path / "run")
    command = [*TRAIN, f"--config.workdir={workdir}", "--config.train.steps=100000"]
    proc = subprocess.Popen(command, cwd=ROOT, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: os.path.exists(os.path.join(workdir, "metrics.jsonl")))
    second = subprocess.run(
        [*command[:-1], "--config.train.steps=4"], cwd=ROOT, env=env(), capture_output=True, text=True
    )
    assert second.returncode == 6 and "in use by a live fbt-train" in second.stderr, second.stderr[-1000:]
    assert "Traceback" not in second.stderr
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    again = RunDirectory(workdir)
    again.lock()  # the kernel released the dead process's lock
    again.unlock()


def test_divergence_stops_before_saving_and_keeps_the_last_finite_checkpoints(tmp_path):
    config = small_config(tmp_path, steps=20)
    config.checkpoint.every_steps = 1
    config.checkpoint.max_to_keep = 2
    config.optimizer.learning_rate = 1e30  # parameters of 1e30 overflow the next forward pass
    with pytest.raises(FloatingPointError, match="nothing after step") as err:
        Trainer(config, log=lambda *_: None).train(progress=False)
    directory = os.path.join(config.workdir, "checkpoints")
    steps = sorted(int(s) for s in os.listdir(directory) if s.isdigit())
    diverged_at = int(str(err.value).split(" at step ")[1].split(" ")[0])
    assert steps and max(steps) < diverged_at  # the diverged step was not saved ...
    for step in steps:  # ... and what was saved is finite
        checkpointer = Checkpointer(directory, config.checkpoint)
        trainer = Trainer(config, log=lambda *_: None)
        restored = checkpointer._restore_step(step, trainer.programs.sharded_abstract_state(), config)
        checkpointer.close()
        assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(restored.state))


def test_a_non_finite_checkpoint_is_refused_and_left_alone(tmp_path):
    config = small_config(tmp_path, steps=2)
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


def test_a_failed_save_stops_the_run_and_the_previous_checkpoint_stays_valid(tmp_path):
    workdir = str(tmp_path / "full")
    command = [*TRAIN, f"--config.workdir={workdir}", "--config.checkpoint.every_steps=2"]
    subprocess.run([*command, "--config.train.steps=2"], cwd=ROOT, env=env(), check=True, capture_output=True)

    def small_disk():  # files may not grow past 100 kB: a checkpoint's data files need more
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))

    full = subprocess.run(
        [*command, "--config.train.steps=200"],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        preexec_fn=small_disk,
    )
    lines = [line for line in full.stderr.splitlines() if line.startswith("fbt-train:")]
    assert full.returncode == 5, full.stderr[-2000:]
    assert "Traceback" not in full.stderr
    assert len(lines) == 1 and "saving checkpoint 4" in lines[0] and "step 2, is intact" in lines[0]
    assert max(losses(workdir)) <= 6  # stopped at the next save, which waits for the failed one
    resumed = subprocess.run([*command, "--config.train.steps=6"], cwd=ROOT, env=env(), capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "(step 2)" in resumed.stdout  # the checkpoint before the failure restored


def test_sigint_saves_and_exits_like_sigterm(tmp_path):
    workdir = str(tmp_path / "interrupted")
    command = [
        *TRAIN,
        f"--config.workdir={workdir}",
        "--config.train.steps=100000",
        "--config.checkpoint.every_steps=0",
    ]
    command[-1] = "--config.checkpoint.every_steps=100000"
    proc = subprocess.Popen(command, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: os.path.exists(os.path.join(workdir, "metrics.jsonl")) and len(losses(workdir)) > 5)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == PREEMPTED_EXIT_CODE, err[-2000:]
    assert "Traceback" not in err
    stopped = int(err.split("stopped at step ")[1].split(" ")[0])
    assert os.path.exists(os.path.join(workdir, "checkpoints", str(stopped), "commit_success.txt"))


def test_resume_shows_changes_and_guards_the_data_order(tmp_path):
    config = small_config(tmp_path, steps=2)
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
