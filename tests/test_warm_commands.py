"""The warm commands of the tests (tests/warm_commands.py) are the commands: the same output, exit
code and files as the script started cold; signals reach the command; a killed shim takes its
command with it; an environment the warm process was not imported with runs cold."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess

import pytest
import warm_commands
from conftest import BIN, ROOT, cpu_env, losses, train_argv, wait_for, warm_bin


def run(head: str, argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([head, *argv[1:]], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_an_environment_read_at_import_runs_cold():
    base = {"PATH": "/bin", "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    imported = {"TF_CPP_MIN_LOG_LEVEL": "1"}  # what the server's own imports set
    same = lambda **changes: warm_commands.differs_at_import({**base, **changes}, base, imported)  # noqa: E731
    assert same(XLA_FLAGS="", PATH="/usr/bin", PYTHON="/usr/bin/python3", FBT_JAX_CACHE="/tmp/c") == []
    assert same(JAX_PLATFORMS="cpu,cuda") == ["JAX_PLATFORMS"]
    assert same(JAX_ENABLE_X64="1", PYTHONUNBUFFERED="1") == ["JAX_ENABLE_X64", "PYTHONUNBUFFERED"]
    assert same(TF_CPP_MIN_LOG_LEVEL="3", HOME="/elsewhere") == ["HOME", "TF_CPP_MIN_LOG_LEVEL"]


@pytest.mark.slow
def test_a_warm_command_gives_the_cold_commands_output_exit_code_and_numbers(tmp_path):
    shims = warm_bin()
    if shims is None:
        pytest.skip("FBT_TEST_COLD is set: no warm commands to compare")
    bad = ["fbt-train", "--config=configs/tiny.py", "--config.train.steps=0"]
    warm, cold = (run(os.path.join(head, "fbt-train"), bad, cpu_env(1)) for head in (shims, BIN))
    assert (warm.returncode, warm.stdout, warm.stderr) == (cold.returncode, cold.stdout, cold.stderr)
    assert warm.returncode == 2 and warm.stderr.startswith("fbt-train: ")
    for head in (shims, BIN):  # one device here, although the warm process was started with 8
        workdir = str(tmp_path / os.path.basename(os.path.dirname(head)))
        argv = train_argv(workdir, "--config.train.steps=4")
        result = run(os.path.join(head, "fbt-train"), argv, cpu_env(1))
        assert result.returncode == 0 and "over 1 devices" in result.stdout, result.stderr[-2000:]
    runs = sorted(os.listdir(tmp_path))
    assert losses(str(tmp_path / runs[0])) == losses(str(tmp_path / runs[1]))


@pytest.mark.slow
def test_signals_reach_the_warm_command_and_a_killed_shim_takes_it_along(tmp_path):
    shims = warm_bin()
    if shims is None:
        pytest.skip("FBT_TEST_COLD is set: no warm commands to compare")
    shim = os.path.join(shims, "fbt-train")
    for number, name in ((signal.SIGTERM, "terminated"), (signal.SIGKILL, "killed")):
        workdir = str(tmp_path / name)
        argv = train_argv(workdir, "--config.train.steps=100000", "--config.checkpoint.every_steps=1000")
        proc = subprocess.Popen(
            [shim, *argv[1:]], cwd=ROOT, env=cpu_env(1), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        wait_for(lambda w=workdir: os.path.exists(os.path.join(w, "metrics.jsonl")) and len(losses(w)) > 3)
        proc.send_signal(number)
        _, err = proc.communicate(timeout=120)
        lock = os.path.join(workdir, ".fbt-train.lock")
        if number == signal.SIGTERM:  # the run's own handler: it saves its step and exits 75
            assert proc.returncode == 75, err[-2000:]
            stopped = int(err.split("stopped at step ")[1].split(" ")[0])
            assert os.path.exists(os.path.join(workdir, "checkpoints", str(stopped), "commit_success.txt"))
        else:  # the shim died at once; the command follows it: its workdir lock is released
            assert proc.returncode == -signal.SIGKILL
            wait_for(lambda path=lock: lock_is_free(path), timeout=10)


def lock_is_free(path: str) -> bool:
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True
