"""Checkpoints: exact resume after SIGKILL, SIGTERM preemption, damaged checkpoints, another mesh,
incompatible configs, and two processes saving and restoring together."""

import glob
import os
import shutil
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import (
    assert_same_state,
    checkpointed_config,
    cpu_env,
    losses,
    read_jsonl,
    run_command,
    start_command,
    tree_snapshot,
    wait_for,
)

from fbt_jax.checkpoint import Checkpointer
from fbt_jax.errors import PREEMPTED_EXIT_CODE, CheckpointError, ConfigError
from fbt_jax.train.trainer import Trainer

XDIST_PARTS = 2  # 11 long tests: two groups, one per worker (tests/scheduling.py)

N = 150  # checkpoint interval; runs go to 2N with K drawn from a mix, so K changes across step N
COMMAND = [
    "fbt-train",
    "--config=configs/tiny.py",
    f"--config.train.steps={2 * N}",
    "--config.train.log_every=1",
    "--config.optimizer.warmup_steps=10",
    "--config.passes.schedule=0:1=0.5,2=0.3,3=0.2",
    f"--config.checkpoint.every_steps={N}",
    "--config.eval.num_batches=0",
]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("ckpt") / "uninterrupted")
    run_command([*COMMAND, f"--config.workdir={workdir}"], cpu_env(), check=True)
    return workdir


@pytest.mark.slow
def test_resume_after_sigkill_is_bitwise_identical(tmp_path, uninterrupted):
    workdir = str(tmp_path / "killed")
    command = [*COMMAND, f"--config.workdir={workdir}"]
    proc = start_command(command, cpu_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(lambda: os.path.exists(os.path.join(workdir, "checkpoints", str(N), "commit_success.txt")))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert max(losses(workdir)) < 2 * N, "the run finished before it could be killed"
    resumed = run_command(command, cpu_env())
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resuming from checkpoint {workdir}/checkpoints/{N} (step {N})" in resumed.stdout
    ks = [r["num_passes"] for r in read_jsonl(workdir)]
    assert len(set(ks[N - 5 : N + 5])) > 1  # K changes around the resume point
    expected, got = losses(uninterrupted), losses(workdir)
    assert sorted(got) == list(range(1, 2 * N + 1))  # each step logged once
    assert [got[s] for s in range(N + 1, 2 * N + 1)] == [expected[s] for s in range(N + 1, 2 * N + 1)]
    assert_same_state(f"{uninterrupted}/checkpoints/{2 * N}", f"{workdir}/checkpoints/{2 * N}")


@pytest.mark.slow
def test_sigterm_saves_the_current_step_and_the_rerun_continues(tmp_path, uninterrupted):
    workdir = str(tmp_path / "preempted")
    command = [*COMMAND, f"--config.workdir={workdir}"]
    proc = start_command(command, cpu_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    wait_for(lambda: os.path.exists(os.path.join(workdir, "metrics.jsonl")) and len(losses(workdir)) > 20)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == PREEMPTED_EXIT_CODE, err[-2000:]
    stopped = int(err.split("stopped at step ")[1].split(" ")[0])
    assert os.path.exists(os.path.join(workdir, "checkpoints", str(stopped), "commit_success.txt"))
    assert max(losses(workdir)) == stopped
    resumed = run_command(command, cpu_env())
    assert resumed.returncode == 0 and f"(step {stopped})" in resumed.stdout
    expected, got = losses(uninterrupted), losses(workdir)
    assert [got[s] for s in range(stopped + 1, 2 * N + 1)] == [expected[s] for s in range(stopped + 1, 2 * N + 1)]


# The aborted read of a damaged checkpoint leaves tensorstore callbacks that fire after orbax has
# closed its event loop ("Event loop is closed"): library noise on a path that is handled.
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path):
    config = checkpointed_config(tmp_path)
    Trainer(config, log=lambda *_: None).train(progress=False)
    directory = os.path.join(config.workdir, "checkpoints")
    assert sorted(os.listdir(directory)) == ["2", "4", "6"]
    manifest = glob.glob(os.path.join(directory, "6", "state", "**", "manifest.ocdbt"), recursive=True)[0]
    os.truncate(manifest, 10)  # a torn write
    messages = []
    config.train.steps = 8
    trainer = Trainer(config, log=messages.append)
    summary = trainer.train(progress=False)
    assert summary["start_step"] == 4
    assert any("checkpoint" in m and "/6 is damaged" in m and "moved it to" in m for m in messages)
    entries = sorted(os.listdir(directory))
    assert any(e.startswith("6.damaged-") for e in entries)  # kept aside, not deleted
    assert {"6", "8"} <= set(entries)  # training went on and saved again


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_garbled_data_file_is_damage_when_an_older_checkpoint_restores(tmp_path):
    config = checkpointed_config(tmp_path, steps=4)
    Trainer(config, log=lambda *_: None).train(progress=False)
    directory = os.path.join(config.workdir, "checkpoints")
    data_files = [p for p in glob.glob(os.path.join(directory, "4", "state", "**", "d", "*"), recursive=True)]
    assert data_files
    for path in data_files:  # bit rot: same size, other bytes
        with open(path, "r+b") as f:
            data = f.read()
            f.seek(0)
            f.write(bytes(255 - b for b in data))
    messages = []
    summary = Trainer(config, log=messages.append).train(progress=False)
    assert summary["start_step"] == 2
    assert any("/4 is damaged" in m and "step 2 restores with the same code" in m for m in messages)
    assert any(e.startswith("4.damaged-") for e in os.listdir(directory))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_no_checkpoint_restoring_touches_nothing_unless_asked_to_restart(tmp_path):
    config = checkpointed_config(tmp_path, steps=2)
    Trainer(config, log=lambda *_: None).train(progress=False)
    directory = os.path.join(config.workdir, "checkpoints")
    shutil.rmtree(os.path.join(directory, "2", "state"))
    before = tree_snapshot(config.workdir)
    with pytest.raises(CheckpointError, match="none of the 1 checkpoint.* restores .*nothing was changed") as err:
        Trainer(config, log=lambda *_: None).train(progress=False)
    assert "\n" not in str(err.value) and "restart_from_scratch" in str(err.value)
    assert tree_snapshot(config.workdir) == before  # no step-0 restart, nothing renamed
    config.checkpoint.restart_from_scratch = True
    summary = Trainer(config, log=lambda *_: None).train(progress=False)
    assert summary["start_step"] == 0
    kept = glob.glob(os.path.join(config.workdir, "checkpoints.unrestored-*"))
    assert len(kept) == 1 and "2" in os.listdir(kept[0])  # the old checkpoints are kept aside
    assert sorted(os.listdir(directory)) == ["2"]


@pytest.mark.slow
def test_restore_on_another_mesh_and_device_count(tmp_path):
    config = checkpointed_config(tmp_path, steps=4, mesh=(2, 2, 2))
    trainer = Trainer(config, log=lambda *_: None)
    trainer.train(progress=False)
    saved = jax.device_get(trainer.state)
    other = checkpointed_config(tmp_path, steps=4, mesh=(4, 1, 1))
    restored = Trainer(other, log=lambda *_: None, devices=jax.devices()[:4])
    checkpointer = Checkpointer(os.path.join(config.workdir, "checkpoints"), other.checkpoint)
    assert restored.restore_or_init(checkpointer)[0] == 4
    checkpointer.close()
    for a, b in zip(jax.tree.leaves(restored.state), jax.tree.leaves(saved)):
        assert np.array_equal(np.asarray(a), b)
    leaf = restored.state.params["blocks"][0]["mlp"]["down_FD"][...]
    assert len(leaf.sharding.device_set) == 4 and dict(leaf.sharding.mesh.shape) == {"data": 4, "fsdp": 1, "tensor": 1}


def test_incompatible_config_is_refused_and_checkpoints_untouched(tmp_path):
    config = checkpointed_config(tmp_path, steps=2)
    Trainer(config, log=lambda *_: None).train(progress=False)
    directory = os.path.join(config.workdir, "checkpoints")
    before = {p: os.path.getmtime(p) for p in glob.glob(f"{directory}/**", recursive=True)}
    config.model.embed_dim = 128
    with pytest.raises(ConfigError, match=r"different model \(model.embed_dim: checkpoint 64, config 128\)") as err:
        Trainer(config, log=lambda *_: None).train(progress=False)
    assert "\n" not in str(err.value)
    assert {p: os.path.getmtime(p) for p in glob.glob(f"{directory}/**", recursive=True)} == before


def test_changed_optimizer_is_refused_not_mistaken_for_damage(tmp_path):
    config = checkpointed_config(tmp_path, steps=2)
    Trainer(config, log=lambda *_: None).train(progress=False)
    directory = os.path.join(config.workdir, "checkpoints")
    config.optimizer.grad_clip_norm = 0.0  # removes the clipping stage: another optimizer-state layout
    with pytest.raises(ConfigError, match=r"another layout \(optimizer.grad_clip_norm: checkpoint 1.0, config 0.0\)"):
        Trainer(config, log=lambda *_: None).train(progress=False)
    assert sorted(os.listdir(directory)) == ["2"]  # nothing set aside, nothing restarted


def test_a_step_is_saved_once_even_when_asked_twice(tmp_path):
    config = checkpointed_config(tmp_path, steps=2)
    trainer = Trainer(config, log=lambda *_: None)
    trainer.init_state()
    checkpointer = Checkpointer(str(tmp_path / "ck"), config.checkpoint)
    assert checkpointer.save(2, trainer.state, config)  # the regular save at a checkpoint step ...
    assert not checkpointer.save(2, trainer.state, config, force=True)  # ... then the preemption save
    checkpointer.wait()
    assert checkpointer.steps() == [2]
    checkpointer.close()


def test_a_storage_coroutine_left_unawaited_goes_to_the_log_not_the_terminal(tmp_path):
    """After a damaged read's one-line error, Python's "coroutine ... was never awaited" warning at
    exit (an aborted storage read) must not become the command's last line."""
    log = tmp_path / "cmd.log"
    code = (
        "import gc, sys, warnings\n"
        "from fbt_jax.errors import divert_library_noise\n"
        "divert_library_noise(sys.argv[1])\n"
        "async def read(): pass\n"
        "pending = read(); del pending; gc.collect()\n"
        "warnings.warn('another warning', RuntimeWarning)\n"
        "print('fbt-decode: checkpoint error: one line', file=sys.stderr)\n"
    )
    result = subprocess.run([sys.executable, "-c", code, str(log)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines()[-1] == "fbt-decode: checkpoint error: one line"
    assert "never awaited" not in result.stderr and "another warning" in result.stderr  # other warnings stand
    assert "coroutine 'read' was never awaited" in log.read_text()
