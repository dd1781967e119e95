"""The training loop's hooks: the logger stops a diverged run before anything diverged is saved, a
failed save stops the run with the previous checkpoint intact, SIGINT saves like SIGTERM."""

import fcntl
import math
import os
import pty
import re
import resource
import select
import signal
import struct
import subprocess
import termios
import time

import jax
import numpy as np
import pytest
from conftest import (
    checkpointed_config,
    cpu_env,
    losses,
    read_jsonl,
    run_command,
    run_config,
    start_command,
    train_argv,
    wait_for,
)

from fbt_jax.checkpoint import Checkpointer
from fbt_jax.errors import PREEMPTED_EXIT_CODE
from fbt_jax.train.trainer import Trainer


def run_on_a_terminal(argv: list[str], env: dict[str, str], stdout, timeout: float = 300) -> tuple[int, str]:
    """Run `argv` with its stderr on a pseudo-terminal (so a progress bar is drawn); its exit code
    and what it wrote there, line ends as the program wrote them."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 160, 0, 0))  # rows, columns
    proc = start_command(argv, env, stdout=stdout, stderr=follower)
    os.close(follower)
    written, deadline = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if select.select([leader], [], [], 1.0)[0]:
                try:
                    chunk = os.read(leader, 65536)
                except OSError:  # EIO: nothing holds the terminal any more
                    break
                if not chunk:
                    break
                written += chunk
            elif proc.poll() is not None:
                break
        returncode = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        proc.kill()
        os.close(leader)
    return returncode, written.decode(errors="replace").replace("\r\n", "\n")  # the terminal's own \r\n


@pytest.mark.slow
def test_a_diverged_run_leaves_its_one_line_error_alone_on_the_terminal(tmp_path):
    """fbt-train diverges (exit 3). On a terminal its progress bar is drawn, then cleared: the screen
    keeps the one-line error only (tensorboardX used to warn about each NaN/Inf on stderr, on the
    bar's line, which the clearing then missed); metrics.jsonl keeps the diverged step's record."""
    workdir = str(tmp_path / "diverge")
    overrides = ["--config.passes.schedule=0:2", "--config.optimizer.learning_rate=1e38"]
    argv = train_argv(workdir, "--config.train.steps=6", "--config.optimizer.grad_clip_norm=0.0", *overrides)
    with open(tmp_path / "stdout", "w") as stdout:
        code, stderr = run_on_a_terminal(argv, cpu_env(), stdout)
    screen = [line.rsplit("\r", 1)[-1].rstrip() for line in stderr.split("\n")]  # each line as a terminal shows it
    assert code == 3, stderr[-2000:]
    assert "/6 [" in stderr, "no progress bar drawn: " + stderr[-2000:]
    shown = [line for line in screen if line]
    assert len(shown) == 1 and shown[0].startswith("fbt-train: training diverged: "), stderr[-2000:]
    assert re.search(r"(loss nan|gradient norm nan) at step [0-9]+ \(K=2\)", shown[0]), shown[0]
    last = read_jsonl(workdir)[-1]
    assert not (math.isfinite(last["loss"]) and math.isfinite(last["grad_norm"])), last


@pytest.mark.slow
def test_divergence_stops_before_saving_and_keeps_the_last_finite_checkpoints(tmp_path):
    config = checkpointed_config(tmp_path, steps=20)
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


@pytest.mark.slow
def test_a_failed_save_stops_the_run_and_the_previous_checkpoint_stays_valid(tmp_path):
    workdir = str(tmp_path / "full")
    command = train_argv(workdir, "--config.checkpoint.every_steps=2")
    run_command([*command, "--config.train.steps=2"], cpu_env(), check=True)

    def small_disk():  # files may not grow past 100 kB: a checkpoint's data files need more
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))

    full = run_command([*command, "--config.train.steps=200"], cpu_env(), preexec_fn=small_disk)
    lines = [line for line in full.stderr.splitlines() if line.startswith("fbt-train:")]
    assert full.returncode == 5, full.stderr[-2000:]
    assert "Traceback" not in full.stderr
    assert len(lines) == 1 and "saving checkpoint 4" in lines[0] and "step 2, is intact" in lines[0]
    assert max(losses(workdir)) <= 6  # stopped at the next save, which waits for the failed one
    resumed = run_command([*command, "--config.train.steps=6"], cpu_env())
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "(step 2)" in resumed.stdout  # the checkpoint before the failure restored


@pytest.mark.slow
def test_sigint_saves_and_exits_like_sigterm(tmp_path):
    workdir = str(tmp_path / "interrupted")
    command = train_argv(workdir, "--config.train.steps=100000", "--config.checkpoint.every_steps=100000")
    proc = start_command(command, cpu_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    wait_for(lambda: os.path.exists(os.path.join(workdir, "metrics.jsonl")) and len(losses(workdir)) > 5)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == PREEMPTED_EXIT_CODE, err[-2000:]
    assert "Traceback" not in err
    stopped = int(err.split("stopped at step ")[1].split(" ")[0])
    assert os.path.exists(os.path.join(workdir, "checkpoints", str(stopped), "commit_success.txt"))


def test_throughput_adds_model_flops_and_mfu_from_each_steps_pass_count():
    """Two steps at K=1 then one at K=2, in an interval the loop timed at 30 tokens/s (10 tokens a
    step): 1 s; FLOPs 100 + 100 + 250, against a peak of 900 FLOP/s."""
    from fbt_jax.train.hooks import Throughput
    from fbt_jax.train.loop import StepEnd

    hook = Throughput({1: 100.0, 2: 250.0}.__getitem__, tokens_per_step=10, peak_flops=900.0, when=lambda e: e.last)
    for step, k in ((1, 1), (2, 1), (3, 2)):
        hook.on_step(StepEnd(step=step, num_passes=k, last=step == 3, stopping=False))
    end = StepEnd(step=3, num_passes=2, last=True, stopping=False)
    assert hook.wants(end)
    record = {"loss": 1.0, "tokens_per_second": 30.0}
    hook.on_interval(end, record, state=None)
    assert record["model_flops_per_second"] == pytest.approx(450.0)
    assert record["mfu"] == pytest.approx(0.5)
    hook.on_step(StepEnd(step=4, num_passes=1, last=False, stopping=False))  # the next interval starts afresh
    record = {"tokens_per_second": 10.0}
    hook.on_interval(end, record, state=None)
    assert record["model_flops_per_second"] == pytest.approx(100.0)


@pytest.mark.slow
def test_every_logged_line_has_mfu_against_a_measured_cpu_peak(tmp_path):
    config = run_config(tmp_path, steps=4)
    config.train.log_every = 2
    messages = []
    Trainer(config, log=messages.append, devices=jax.devices()[:1]).train(progress=False)
    assert any(m.startswith("MFU against cpu: ") and "measured" in m for m in messages), messages
    rows = read_jsonl(config.workdir)
    assert [r["step"] for r in rows] == [2, 4]
    for row in rows:
        assert 0 < row["mfu"] < 1.5 and row["model_flops_per_second"] > 0
