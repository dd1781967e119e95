"""The run directory: one live run per workdir (a lock that goes with its holder), and a fresh run
never overwrites an earlier run's logs."""

import glob
import os
import signal
import subprocess

import pytest
from conftest import checkpointed_config, cpu_env, run_command, run_config, start_command, train_argv, wait_for

from fbt_jax.errors import WorkdirBusy
from fbt_jax.train.trainer import Trainer
from fbt_jax.workdir import RunDirectory


def test_a_second_run_on_a_live_workdir_fails_at_once(tmp_path):
    holder = RunDirectory(str(tmp_path / "run"))
    holder.lock()
    config = checkpointed_config(tmp_path, steps=2)
    with pytest.raises(WorkdirBusy, match=rf"in use by a live fbt-train \(pid {os.getpid()} on host "):
        Trainer(config, log=lambda *_: None).train(progress=False)
    assert not os.path.exists(os.path.join(config.workdir, "checkpoints"))
    holder.unlock()  # the lock goes with its holder: a later run proceeds
    Trainer(config, log=lambda *_: None).train(progress=False)


@pytest.mark.slow
def test_a_killed_runs_lock_is_not_in_the_way(tmp_path):
    workdir = str(tmp_path / "run")
    proc = start_command(
        train_argv(workdir, "--config.train.steps=100000"),
        cpu_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    wait_for(lambda: os.path.exists(os.path.join(workdir, "metrics.jsonl")))
    second = run_command(train_argv(workdir, "--config.train.steps=4"), cpu_env())
    assert second.returncode == 6 and "in use by a live fbt-train" in second.stderr, second.stderr[-1000:]
    assert "Traceback" not in second.stderr
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    again = RunDirectory(workdir)
    again.lock()  # the kernel released the dead process's lock
    again.unlock()


@pytest.mark.slow
def test_a_second_run_keeps_the_first_runs_logs(tmp_path):
    config = run_config(tmp_path, "same", steps=2, schedule="0:2")
    config.checkpoint.every_steps = 0  # no checkpoint to resume from: the second run starts afresh
    for _ in range(2):
        Trainer(config, log=lambda *_: None).train(progress=False)
    kept = glob.glob(os.path.join(config.workdir, "previous-*-metrics.jsonl"))
    assert len(kept) == 1 and len(open(kept[0]).readlines()) == 2
    assert len(open(os.path.join(config.workdir, "metrics.jsonl")).readlines()) == 2
