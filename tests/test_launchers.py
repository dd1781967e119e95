"""The launchers keep a run going after a preemption without a person.

launch/local.sh supervises its processes (--max-restarts, --restart-delay), launch/slurm_gpu.sbatch
requeues its job on exit 75, launch/tpu_pod.sh relaunches on every host; all three stop at once on
a status that a restart cannot fix. fbt-train exits 75 on a SIGTERM at any moment, start-up
included. The launchers' logic runs here against stand-ins for fbt-train, srun, scontrol and
gcloud (scripts first on PATH that follow a plan and record their calls); one slow test runs the
real thing: a supervised run SIGTERMed three times ends bitwise identical to an uninterrupted one.
"""

import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import (
    RESUME_ARGS,
    RESUME_STEPS,
    ROOT,
    assert_same_state,
    checkpointed_config,
    cpu_env,
    last_line,
    losses,
    read_jsonl,
    run_command,
    start_command,
    wait_for,
)

# --- stand-ins ---------------------------------------------------------------------------------------------

# fbt-train for local.sh: process I's n-th start follows line n of $FAKE_DIR/plan.I: `exit S` (one
# line on stderr, then status S), `kill SIG` (dies by that signal) or `wait` (runs until SIGTERM,
# then says it was preempted and exits 75). Every start is one line of $FAKE_DIR/starts. As the
# real processes meet in jax.distributed's start-up, each one acts only once all have started (a
# process stopped by the launcher before it recorded its start would lose its place in the plan).
FAKE_TRAIN = r"""#!/usr/bin/env bash
trap 'echo "fbt-train: preempted: stopped on request" >&2; exit 75' TERM
id=0; processes=1
for arg in "$@"; do case "$arg" in
  --config.distributed.process_id=*) id=${arg#*=} ;; --config.distributed.num_processes=*) processes=${arg#*=} ;;
esac; done
started() { local c; c=$(cat "$FAKE_DIR/count.$1" 2>/dev/null); echo "${c:-0}"; }
n=$(( $(started "$id") + 1 ))
echo "$(date +%s.%N) $id $n $*" >> "$FAKE_DIR/starts"; echo "$n" > "$FAKE_DIR/count.$id.new"
mv "$FAKE_DIR/count.$id.new" "$FAKE_DIR/count.$id"
for (( other = 0; other < processes; other++ )); do
  for (( tries = 0; tries < 200 && $(started "$other") < n; tries++ )); do sleep 0.05; done
done
plan=($(sed -n "${n}p" "$FAKE_DIR/plan.$id"))
case "${plan[0]}" in
  exit) echo "fbt-train: start $n of process $id ends with status ${plan[1]}" >&2; exit "${plan[1]}" ;;
  kill) kill "-${plan[1]}" $$ ;;
  wait) trap 'kill $! 2>/dev/null; echo "fbt-train: preempted: stopped on request" >&2; exit 75' TERM
        echo "process $id waiting"; sleep 60 & wait ;;
esac
"""

# srun for slurm_gpu.sbatch: records its arguments, then exits $FAKE_SRUN_STATUS, or with `wait`
# runs until SIGTERM (then exits 75, as fbt-train's processes do).
FAKE_SRUN = r"""#!/usr/bin/env bash
echo "$*" >> "$FAKE_DIR/srun.calls"
if [[ "$FAKE_SRUN_STATUS" == wait ]]; then
  trap 'kill $! 2>/dev/null; exit 75' TERM; echo "srun running"; sleep 60 & wait
fi
exit "$FAKE_SRUN_STATUS"
"""
FAKE_SCONTROL = r"""#!/usr/bin/env bash
echo "$*" >> "$FAKE_DIR/scontrol.calls"
exit "${FAKE_SCONTROL_STATUS:-0}"
"""

# gcloud for tpu_pod.sh: records every call; `tpu-vm scp` and the set-up's pip install succeed; the
# n-th run follows line n of $FAKE_DIR/ssh.plan: `lost` (ssh cannot reach a host: 255) or
# `workers S1 S2 ...` (runs the remote command once per worker, as bash would on the host, with
# FAKE_EXIT=Si for the program, and exits 0, as gcloud does for several workers whatever they did).
FAKE_GCLOUD = r"""#!/usr/bin/env bash
echo "$(date +%s.%N) $*" >> "$FAKE_DIR/gcloud.calls"
command=""; previous=""
for arg in "$@"; do [[ "$previous" == --command ]] && command="$arg"; previous="$arg"; done
if [[ "$*" == *"tpu-vm scp"* || "$command" == *"pip install"* ]]; then exit 0; fi
n=$(( $(cat "$FAKE_DIR/ssh.count" 2>/dev/null || echo 0) + 1 )); echo "$n" > "$FAKE_DIR/ssh.count"
plan=($(sed -n "${n}p" "$FAKE_DIR/ssh.plan"))
if [[ "${plan[0]}" == lost ]]; then echo "ssh: connect to host 10.0.0.3 port 22: Connection refused" >&2; exit 255; fi
for status in "${plan[@]:1}"; do FAKE_EXIT=$status bash -c "$command"; done
exit 0
"""
# The program on a TPU host: records where it runs and its arguments, exits $FAKE_EXIT.
FAKE_WORKER_TRAIN = r"""#!/usr/bin/env bash
echo "$PWD $*" >> "$FAKE_DIR/worker.calls"
exit "$FAKE_EXIT"
"""


def stand_ins(tmp_path, **scripts: str) -> tuple[str, dict[str, str]]:
    """A directory of executable `scripts` (name → text) and an environment with it first on PATH."""
    fake_dir = tmp_path / "fake"
    bin_dir = fake_dir / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name, text in scripts.items():
        path = bin_dir / name
        path.write_text(text)
        path.chmod(0o755)
    env = {**os.environ, "FAKE_DIR": str(fake_dir), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    return str(fake_dir), env


def plan(fake_dir: str, name: str, *lines: str) -> None:
    with open(os.path.join(fake_dir, name), "w") as f:
        f.write("".join(f"{line}\n" for line in lines))


def read_lines(path: str) -> list[str]:
    return open(path).read().splitlines() if os.path.exists(path) else []


RESTART = re.compile(r"^local\.sh: attempt (\d+)/(\d+) ended with status (\d+) \((.*)\); restarting in ([0-9.]+) s$")


def restart_lines(stderr: str) -> list[tuple[int, int, int, str, float]]:
    found = [RESTART.match(line) for line in re.split(r"[\r\n]", stderr)]
    return [(int(m[1]), int(m[2]), int(m[3]), m[4], float(m[5])) for m in found if m]


# --- launch/local.sh: the supervisor -----------------------------------------------------------------------


def test_local_supervisor_restarts_preemptions_and_crashes_with_a_growing_backoff(tmp_path):
    fake_dir, env = stand_ins(tmp_path, **{"fbt-train": FAKE_TRAIN})
    # Process 0 is preempted, then killed by SIGKILL (an OOM kill), then crashes, then succeeds;
    # process 1 runs until the launcher stops it in each failed attempt.
    plan(fake_dir, "plan.0", "exit 75", "kill KILL", "exit 1", "exit 0")
    plan(fake_dir, "plan.1", "wait", "wait", "wait", "exit 0")
    command = ["launch/local.sh", "--max-restarts=4", "--restart-delay=0.2", "2", "--config=configs/tiny.py"]
    began = time.time()
    result = run_command(command, env, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    restarts = restart_lines(result.stderr)
    assert [(a, n, s) for a, n, s, _, _ in restarts] == [(1, 5, 75), (2, 5, 137), (3, 5, 1)]
    assert [delay for *_, delay in restarts] == [0.2, 0.4, 0.8]  # doubled at every restart
    reasons = [why for _, _, _, why, _ in restarts]
    assert reasons[0] == "process 0 preempted: fbt-train: start 1 of process 0 ends with status 75"
    assert reasons[1].startswith("process 0 killed by SIGKILL")
    assert reasons[2] == "process 0 status 1: fbt-train: start 3 of process 0 ends with status 1"
    # Every attempt started both processes, with the same arguments, after the back-off.
    starts = [line.split(" ", 3) for line in read_lines(os.path.join(fake_dir, "starts"))]
    assert sorted((int(s[1]), int(s[2])) for s in starts) == [(p, n) for p in (0, 1) for n in (1, 2, 3, 4)]
    first = {int(s[2]): float(s[0]) for s in starts if s[1] == "0"}
    for n, delay in zip((1, 2, 3), (0.2, 0.4, 0.8)):
        assert first[n + 1] - first[n] >= delay
    assert all("--config=configs/tiny.py" in s[3] and "--config.distributed.num_processes=2" in s[3] for s in starts)
    # The launcher stopped process 1 in each failed attempt (alone, it runs for a minute).
    assert time.time() - began < 30
    assert result.stdout.count("[local.sh] process 1: ") == 4  # every attempt prints its commands


@pytest.mark.parametrize("status", [2, 3, 4, 5, 6, 130])
def test_local_supervisor_stops_at_once_on_a_status_a_restart_cannot_fix(tmp_path, status):
    fake_dir, env = stand_ins(tmp_path, **{"fbt-train": FAKE_TRAIN})
    plan(fake_dir, "plan.0", f"exit {status}", "exit 0")
    result = run_command(["launch/local.sh", "--max-restarts=3", "--restart-delay=0", "1", "--x"], env, timeout=60)
    assert result.returncode == status
    assert len(read_lines(os.path.join(fake_dir, "starts"))) == 1
    assert not restart_lines(result.stderr)
    assert last_line(result.stderr) == (
        f"local.sh: process 0 exited with status {status}: fbt-train: start 1 of process 0 ends with status "
        f"{status}; stopped the others (attempt 1/4: status {status} is not retried)"
    )


def test_local_supervisor_gives_up_after_max_restarts_and_without_it_runs_once(tmp_path):
    fake_dir, env = stand_ins(tmp_path, **{"fbt-train": FAKE_TRAIN})
    plan(fake_dir, "plan.0", *["exit 75"] * 5)
    result = run_command(["launch/local.sh", "--max-restarts", "2", "--restart-delay", "0", "1", "--x"], env)
    assert result.returncode == 75
    assert len(read_lines(os.path.join(fake_dir, "starts"))) == 3
    assert [a for a, *_ in restart_lines(result.stderr)] == [1, 2]
    assert last_line(result.stderr).endswith("stopped the others (attempt 3/3: no restarts left)")
    # Without --max-restarts: today's behaviour, one attempt and the one-line report as before.
    os.remove(os.path.join(fake_dir, "starts"))
    result = run_command(["launch/local.sh", "1", "--x"], env)
    assert result.returncode == 75 and len(read_lines(os.path.join(fake_dir, "starts"))) == 1
    assert not restart_lines(result.stderr)
    assert last_line(result.stderr) == (
        "local.sh: process 0 exited with status 75: fbt-train: start 4 of process 0 ends with status 75; "
        "stopped the others"
    )


@pytest.mark.parametrize("moment", ["running", "backoff"])
def test_sigterm_to_the_supervisor_stops_everything_without_a_restart(tmp_path, moment):
    fake_dir, env = stand_ins(tmp_path, **{"fbt-train": FAKE_TRAIN})
    plan(fake_dir, "plan.0", "wait" if moment == "running" else "exit 75", "exit 0")
    errors = tmp_path / "stderr"
    with open(errors, "w") as err:
        proc = start_command(
            ["launch/local.sh", "--max-restarts=3", "--restart-delay=60", "1", "--x"],
            env,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
        if moment == "running":
            wait_for(lambda: read_lines(os.path.join(fake_dir, "starts")), timeout=60)
        else:  # in the 60 s back-off before the first restart
            wait_for(lambda: restart_lines(errors.read_text()), timeout=60)
        stopped = time.time()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert time.time() - stopped < 10  # at once, not after the back-off
    assert proc.returncode != 0
    assert len(read_lines(os.path.join(fake_dir, "starts"))) == 1  # never restarted
    assert last_line(errors.read_text()).startswith("local.sh: interrupted; stopped the processes")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--max-restarts=-1", "1", "--x"], "--max-restarts needs a non-negative integer (got '-1')"),
        (["--max-restarts", "two", "1", "--x"], "--max-restarts needs a non-negative integer (got 'two')"),
        (["--restart-delay=soon", "1", "--x"], "--restart-delay needs a number of seconds, 0 or more (got 'soon')"),
        (["--restart-delay"], "--restart-delay needs a value"),
    ],
)
def test_local_supervisor_refuses_bad_flags_in_one_line(argv, message):
    result = run_command(["launch/local.sh", *argv])
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and result.stderr.startswith(f"local.sh: {message}; usage: launch/local.sh")


def test_config_error_stops_the_real_supervised_run_after_one_attempt(tmp_path):
    result = run_command(
        [
            "launch/local.sh",
            "--max-restarts=3",
            "--restart-delay=0",
            "--devices-per-process",
            "1",
            "1",
            "--config=configs/tiny.py",
            f"--config.workdir={tmp_path / 'run'}",
            "--config.train.steps=0",
        ],
        cpu_env(1),
        timeout=300,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stdout.count("[local.sh] process 0: ") == 1  # one attempt
    assert not restart_lines(result.stderr)
    assert re.fullmatch(
        r"local\.sh: process 0 exited with status 2: fbt-train: config error: .*train\.steps.*; stopped the others "
        r"\(attempt 1/4: status 2 is not retried\)",
        last_line(result.stderr),
    )


# --- fbt-train: SIGTERM during start-up is a preemption ------------------------------------------------------


def test_sigterm_during_start_up_exits_75_with_one_line(tmp_path):
    proc = start_command(
        [
            "fbt-train",
            "--config=configs/tiny.py",
            f"--config.workdir={tmp_path / 'run'}",
            "--config.train.steps=20",
            "--config.optimizer.warmup_steps=2",
            "--config.eval.num_batches=0",
        ],
        cpu_env(1, PYTHONUNBUFFERED="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    for line in proc.stdout:
        if line.startswith("model: "):  # printed before the programs compile, long before step 1
            proc.send_signal(signal.SIGTERM)
            break
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 75, err[-2000:]
    assert err.strip().splitlines() == [
        "fbt-train: preempted: stopped by SIGTERM outside the training loop (while starting up or finishing); "
        "every checkpoint saved so far is intact: run the same command again to resume"
    ]
    assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")  # no step ran


def test_sigterm_outside_the_loop_keeps_a_final_error_and_restores_the_handler():
    from fbt_jax.errors import ConfigError, Preempted
    from fbt_jax.train.cli import sigterm_is_a_preemption

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Preempted, match="stopped by SIGTERM outside the training loop"):
        with sigterm_is_a_preemption():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises at once
    assert signal.getsignal(signal.SIGTERM) is before
    # A launcher stopping the processes of a failed run: the error on its way out stands (exit 2,
    # not retried), it is not turned into a preemption.
    with pytest.raises(ConfigError, match="bad value"):
        with sigterm_is_a_preemption():
            try:
                raise ConfigError("bad value")
            finally:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_sigterm_landing_in_a_garbage_collection_still_stops_start_up():
    """Python ignores an exception raised inside `__del__` or a gc callback (jax has one): a SIGTERM
    whose handler ran there was lost, and the run trained on to the end (CI saw it, rarely)."""
    from fbt_jax.errors import Preempted
    from fbt_jax.train.cli import sigterm_is_a_preemption

    class SignalledWhileCollected:
        def __del__(self):
            signal.raise_signal(signal.SIGTERM)
            sum(range(100))  # Python-level code: the handler runs here and its exception is ignored

    before = sys.unraisablehook
    with pytest.raises(Preempted, match="stopped by SIGTERM outside the training loop"):
        with sigterm_is_a_preemption():
            SignalledWhileCollected()  # collected at once
            time.sleep(5)  # the signal sent again interrupts this
    assert sys.unraisablehook is before


def test_a_hook_installed_during_start_up_outlives_the_sigterm_block(tmp_path):
    """fbt-train diverts storage noise (an "Event loop is closed" from a tensorstore callback at
    exit) inside the block; the block's exit put the previous hook back over it, and the noise
    printed a traceback after a damaged checkpoint's one-line error (CI saw it, rarely)."""
    log = tmp_path / "cmd.log"
    code = (
        "import sys\n"
        "from fbt_jax.errors import divert_library_noise\n"
        "from fbt_jax.train.cli import sigterm_is_a_preemption\n"
        "with sigterm_is_a_preemption():\n"
        "    divert_library_noise(sys.argv[1])\n"
        "    diverting = sys.unraisablehook\n"
        "assert sys.unraisablehook is diverting\n"
        "class Callback:\n"  # a storage callback that finds its loop closed, reported as unraisable
        "    def __del__(self): raise RuntimeError('Event loop is closed')\n"
        "Callback()\n"
        "print('fbt-train: checkpoint error: one line', file=sys.stderr)\n"
    )
    result = subprocess.run([sys.executable, "-c", code, str(log)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == ["fbt-train: checkpoint error: one line"]
    assert "RuntimeError: Event loop is closed" in log.read_text()


@pytest.mark.slow
def test_sigterm_during_a_restore_sets_no_checkpoint_aside(tmp_path, monkeypatch):
    """A SIGTERM while the newest checkpoint is being read must not pass for damage to it (the
    restore sets a checkpoint aside when it fails and an older one restores)."""
    from fbt_jax.checkpoint import Checkpointer
    from fbt_jax.errors import Preempted
    from fbt_jax.train.cli import sigterm_is_a_preemption
    from fbt_jax.train.trainer import Trainer

    config = checkpointed_config(tmp_path, steps=4)
    trainer = Trainer(config, log=lambda *_: None)
    trainer.init_state()
    directory = str(tmp_path / "checkpoints")
    checkpointer = Checkpointer(directory, config.checkpoint, log=lambda *_: None)
    for step in (2, 4):
        checkpointer.save(step, trainer.state, config, force=True)
        checkpointer.wait()
    restore_step = Checkpointer._restore_step

    def stopped_while_reading(self, step, *args):
        if step == 4:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises here
        return restore_step(self, step, *args)

    monkeypatch.setattr(Checkpointer, "_restore_step", stopped_while_reading)
    with pytest.raises(Preempted):
        with sigterm_is_a_preemption():
            checkpointer.restore_latest(trainer.programs.sharded_abstract_state(), config)
    checkpointer.close()
    assert sorted(os.listdir(directory)) == ["2", "4"]


# --- the real supervised run ------------------------------------------------------------------------------

STEPS, TRAIN = RESUME_STEPS, RESUME_ARGS
LOCAL = ["launch/local.sh", "--devices-per-process", "1"]


def train_processes(root: int) -> list[int]:
    """The pids of the fbt-train processes (process 0) that the launcher `root` runs now: its
    descendants whose own argument list holds the process id flag (not the shells that exec them)."""
    children: dict[int, list[tuple[int, list[bytes]]]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append((int(entry), argv))
    found, stack = [], [root]
    while stack:
        for pid, argv in children.get(stack.pop(), []):
            stack.append(pid)
            if b"--config.distributed.process_id=0" in argv and os.path.basename(argv[0]) not in (b"bash", b"env"):
                found.append(pid)
    return found


def logged_steps(workdir) -> int:
    path = os.path.join(workdir, "metrics.jsonl")
    return len(open(path).readlines()) if os.path.exists(path) else 0


class Collected:
    """A pipe's text, read by a thread as it comes."""

    def __init__(self, pipe):
        self.text = ""
        self.thread = threading.Thread(target=self._read, args=(pipe,), daemon=True)
        self.thread.start()

    def _read(self, pipe):
        for chunk in iter(lambda: pipe.read(1), ""):
            self.text += chunk


@pytest.mark.slow
def test_supervised_run_sigtermed_three_times_ends_as_if_never_stopped(tmp_path, resume_reference):
    env = cpu_env(1, PYTHONUNBUFFERED="1")
    reference = resume_reference  # the same run, uninterrupted, without the launcher
    workdir = str(tmp_path / "supervised")
    rng = random.Random(20261221)
    # SIGTERM fbt-train (not the launcher) after a seeded number of logged steps in the first and
    # the third attempt, and in the second while it starts up: after it has restored the
    # checkpoint the first one saved, before its first step.
    moments = sorted(rng.sample(range(3, STEPS - 20), 2))
    moments.insert(1, "start-up")
    proc = start_command(
        [*LOCAL, "--max-restarts=5", "--restart-delay=0.2", "1", *TRAIN, f"--config.workdir={workdir}"],
        env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out, err = Collected(proc.stdout), Collected(proc.stderr)
    stopped: list[int] = []
    try:
        for moment in moments:
            start = logged_steps(workdir)
            wait_for(lambda: [p for p in train_processes(proc.pid) if p not in stopped], timeout=300)
            (pid,) = [p for p in train_processes(proc.pid) if p not in stopped]
            if moment == "start-up":
                attempt = len(stopped) + 1
                wait_for(lambda a=attempt: out.text.count("\nmodel: ") >= a, timeout=300)
            else:
                wait_for(lambda m=moment, s=start: logged_steps(workdir) >= max(m, s + 1), timeout=300)
            os.kill(pid, signal.SIGTERM)
            stopped.append(pid)
            count = len(stopped)
            wait_for(lambda n=count: len(restart_lines(err.text)) >= n, timeout=300)
        assert proc.wait(timeout=600) == 0, err.text[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    out.thread.join(timeout=10)
    err.thread.join(timeout=10)
    restarts = restart_lines(err.text)
    assert [(a, n, s) for a, n, s, _, _ in restarts] == [(1, 6, 75), (2, 6, 75), (3, 6, 75)], err.text[-3000:]
    # Each stop was one line of fbt-train's; the one during start-up came from the start-up handler.
    preempted = [line for line in re.split(r"[\r\n]", err.text) if line.startswith("fbt-train: preempted: ")]
    assert len(preempted) == 3
    assert "stopped by SIGTERM outside the training loop" in preempted[1]
    assert "on request" in preempted[0] and "on request" in preempted[2]
    assert out.text.count("resuming from checkpoint") == 3
    names = os.listdir(os.path.join(workdir, "checkpoints"))
    assert not [n for n in names if "damaged" in n], f"a valid checkpoint was set aside: {names}"
    assert [r["step"] for r in read_jsonl(workdir)] == list(range(1, STEPS + 1))  # every step logged once
    assert losses(workdir) == losses(reference)  # bitwise
    assert_same_state(f"{reference}/checkpoints/{STEPS}", f"{workdir}/checkpoints/{STEPS}")
    print(f"SIGTERM moments (logged steps): {moments}")


# --- launch/slurm_gpu.sbatch -------------------------------------------------------------------------------

SBATCH = "launch/slurm_gpu.sbatch"


def test_slurm_script_asks_for_requeue_append_and_a_warning_signal():
    header = [line for line in open(os.path.join(ROOT, SBATCH)) if line.startswith("#SBATCH")]
    assert "#SBATCH --requeue\n" in header and "#SBATCH --open-mode=append\n" in header
    assert any(re.fullmatch(r"#SBATCH --signal=TERM@\d+\n", line) for line in header)  # to the job steps, not B:


@pytest.mark.parametrize(
    "status, restart_count, requeued",
    [
        (75, None, True),  # preempted: requeue
        (75, "2", True),
        (75, "3", False),  # MAX_REQUEUES=3 reached
        (2, None, False),  # config error: a restart cannot fix it
        (137, None, False),  # a crash: not a preemption
        (0, None, False),
    ],
)
def test_slurm_script_requeues_a_preempted_run_within_its_bound(tmp_path, status, restart_count, requeued):
    fake_dir, env = stand_ins(tmp_path, srun=FAKE_SRUN, scontrol=FAKE_SCONTROL)
    env |= {"SLURM_JOB_ID": "4242", "MAX_REQUEUES": "3", "FAKE_SRUN_STATUS": str(status)}
    if restart_count is not None:
        env["SLURM_RESTART_COUNT"] = restart_count
    result = run_command(["bash", SBATCH, "--config=configs/fbt_1b.py"], env, timeout=60)
    assert result.returncode == status
    assert read_lines(os.path.join(fake_dir, "srun.calls")) == [
        "--kill-on-bad-exit=1 fbt-train --config=configs/fbt_1b.py --config.distributed.mode=always"
    ]
    assert read_lines(os.path.join(fake_dir, "scontrol.calls")) == (["requeue 4242"] if requeued else [])
    if requeued:
        assert "requeued job 4242" in result.stderr
    elif status == 75:
        assert "the most MAX_REQUEUES=3 allows" in result.stderr
    elif status:
        assert f"exited with status {status}; not requeued" in result.stderr


def test_slurm_script_failed_requeue_cancel_and_dry_run(tmp_path):
    fake_dir, env = stand_ins(tmp_path, srun=FAKE_SRUN, scontrol=FAKE_SCONTROL)
    env |= {"SLURM_JOB_ID": "7", "FAKE_SRUN_STATUS": "75", "FAKE_SCONTROL_STATUS": "1"}
    result = run_command(["bash", SBATCH, "--config=configs/fbt_1b.py"], env, timeout=60)
    assert result.returncode == 75 and "'scontrol requeue 7' failed" in result.stderr
    # scancel signals the script and the run: the run's 75 then means "stopped", no requeue.
    os.remove(os.path.join(fake_dir, "scontrol.calls"))
    proc = start_command(
        ["bash", SBATCH, "--config=configs/fbt_1b.py"],
        {**env, "FAKE_SRUN_STATUS": "wait", "FAKE_SCONTROL_STATUS": "0"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    for line in proc.stdout:
        if line.startswith("srun running"):  # the stand-in has set its trap
            break
    os.killpg(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 75 and "after the job was cancelled; not requeued" in err
    assert not os.path.exists(os.path.join(fake_dir, "scontrol.calls"))
    # DRY_RUN=1 still prints the command and runs nothing.
    os.remove(os.path.join(fake_dir, "srun.calls"))
    dry = run_command(["bash", SBATCH, "--config=configs/fbt_1b.py"], {**env, "DRY_RUN": "1"}, timeout=60)
    assert dry.returncode == 0
    assert (
        "srun --kill-on-bad-exit=1 fbt-train --config=configs/fbt_1b.py --config.distributed.mode=always" in dry.stdout
    )
    assert not os.path.exists(os.path.join(fake_dir, "srun.calls"))
    bad = run_command(["bash", SBATCH, "--config=configs/fbt_1b.py"], {**env, "MAX_REQUEUES": "many"}, timeout=60)
    assert bad.returncode == 2 and bad.stderr.startswith("slurm_gpu.sbatch: MAX_REQUEUES must be")


# --- launch/tpu_pod.sh -------------------------------------------------------------------------------------

TPU = ["launch/tpu_pod.sh", "my-tpu", "us-east5-a", "--config=configs/fbt_1b.py", "--config.passes.schedule=0:1; 0.5:2"]
RELAUNCH = re.compile(
    r"^tpu_pod\.sh: attempt (\d+)/(\d+) ended with status (\d+) \((.*)\); relaunching in ([0-9.]+) s$"
)


def tpu_env(tmp_path, *ssh_plan: str, **extra: str) -> tuple[str, dict[str, str]]:
    fake_dir, env = stand_ins(tmp_path, gcloud=FAKE_GCLOUD, **{"fbt-train": FAKE_WORKER_TRAIN})
    plan(fake_dir, "ssh.plan", *ssh_plan)
    remote = tmp_path / "remote"
    remote.mkdir(exist_ok=True)
    return fake_dir, env | {"REMOTE_DIR": str(remote)} | extra


def ssh_runs(fake_dir: str) -> list[tuple[float, str]]:
    calls = [line.split(" ", 1) for line in read_lines(os.path.join(fake_dir, "gcloud.calls"))]
    return [(float(t), args) for t, args in calls if "tpu-vm ssh" in args and "pip install" not in args]


def test_tpu_pod_relaunches_after_preemption_and_a_lost_host_with_backoff(tmp_path):
    fake_dir, env = tpu_env(tmp_path, "workers 75 75", "lost", "workers 0 0", MAX_RESTARTS="3", RESTART_DELAY="0.2")
    result = run_command(TPU, env, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    relaunches = [RELAUNCH.match(line) for line in result.stderr.splitlines()]
    relaunches = [m for m in relaunches if m]
    assert [(m[1], m[2], m[3], m[5]) for m in relaunches] == [("1", "4", "75", "0.2"), ("2", "4", "255", "0.4")]
    assert relaunches[0][4].endswith(": preempted") and "a host went away" in relaunches[1][4]
    runs = ssh_runs(fake_dir)
    assert len(runs) == 3
    assert runs[1][0] - runs[0][0] >= 0.2 and runs[2][0] - runs[1][0] >= 0.4
    # Every worker of every attempt ran the same command, in REMOTE_DIR, the arguments intact.
    worker_calls = read_lines(os.path.join(fake_dir, "worker.calls"))
    assert worker_calls == [f"{tmp_path / 'remote'} --config=configs/fbt_1b.py --config.passes.schedule=0:1; 0.5:2"] * 4
    assert result.stdout.count("exited with status 75") == 2 and result.stdout.count("exited with status 0") == 2


def test_tpu_pod_stops_at_once_on_a_final_status_and_bounds_relaunches(tmp_path):
    # One worker diverged (3), another was preempted: 3 wins, no relaunch.
    fake_dir, env = tpu_env(tmp_path, "workers 75 3", "workers 0 0", MAX_RESTARTS="5", RESTART_DELAY="0")
    result = run_command(TPU, env, timeout=60)
    assert result.returncode == 3 and len(ssh_runs(fake_dir)) == 1
    assert "not relaunched: a relaunch cannot fix it" in result.stderr.splitlines()[-1]
    # Preempted every time: MAX_RESTARTS relaunches, then its status.
    fake_dir, env = tpu_env(tmp_path / "bound", *["workers 75 75"] * 4, MAX_RESTARTS="1", RESTART_DELAY="0")
    result = run_command(TPU, env, timeout=60)
    assert result.returncode == 75 and len(ssh_runs(fake_dir)) == 2
    assert "no relaunches left (MAX_RESTARTS=1)" in result.stderr.splitlines()[-1]
    # Without MAX_RESTARTS: one run, as before.
    fake_dir, env = tpu_env(tmp_path / "once", "workers 75 75", "workers 0 0")
    result = run_command(TPU, env, timeout=60)
    assert result.returncode == 75 and len(ssh_runs(fake_dir)) == 1


def test_tpu_pod_relaunch_runs_the_hook_and_the_setup_again(tmp_path):
    hook_log = tmp_path / "hook.log"
    fake_dir, env = tpu_env(
        tmp_path,
        "lost",
        "workers 0 0",
        MAX_RESTARTS="2",
        RESTART_DELAY="0",
        BEFORE_RELAUNCH=f'echo "recreate after $FAKE_DIR" >> {hook_log}',
    )
    result = run_command([TPU[0], "--setup", *TPU[1:]], env, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    assert read_lines(str(hook_log)) == [f"recreate after {fake_dir}"]  # before the relaunch only
    calls = read_lines(os.path.join(fake_dir, "gcloud.calls"))
    assert sum("tpu-vm scp" in c for c in calls) == 2 and sum("pip install" in c for c in calls) == 2


def test_tpu_pod_dry_run_prints_and_runs_nothing(tmp_path):
    fake_dir, env = tpu_env(tmp_path, "workers 0 0", MAX_RESTARTS="3")
    result = run_command([TPU[0], "--dry-run", "--setup", *TPU[1:]], env, timeout=60)
    assert result.returncode == 0
    assert "gcloud compute tpus tpu-vm ssh my-tpu --zone us-east5-a --worker=all --command" in result.stdout
    assert "gcloud compute tpus tpu-vm scp --recurse" in result.stdout and "fbt-train" in result.stdout
    assert not os.path.exists(os.path.join(fake_dir, "gcloud.calls"))
    bad = run_command(TPU, {**env, "MAX_RESTARTS": "-2"}, timeout=60)
    assert bad.returncode == 2 and bad.stderr.startswith("tpu_pod.sh: MAX_RESTARTS must be")
