"""Running a sweep's jobs: `local` (this machine), `slurm` (job arrays, one per tree level, each
depending on the one before) and `print` (the commands in dependency order, for any scheduler).

Every executor runs the same command per job, `fbt-train --config=<sweep>/jobs/<name>.py`, and
leaves the same traces: `<sweep>/logs/<name>.log` and, once it ends, `<sweep>/logs/<name>.exit`.
Jobs are ordered only by their trunks; multi-host jobs go through the launchers in launch/.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping

from fbt_jax.errors import PREEMPTED_EXIT_CODE, ConfigError
from fbt_jax.sweep.plan import Job
from fbt_jax.sweep.state import SweepDirectory

LAUNCHERS = ("none", "local", "tpu_pod")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # for launch/


def command(
    sweep_dir: SweepDirectory, job: Job, launcher: str = "none", launcher_args: tuple[str, ...] = ()
) -> list[str]:
    """The command that runs `job` (through a launcher from launch/ for multi-host jobs)."""
    train = [f"--config={sweep_dir.job_file(job)}"]
    if launcher == "none":
        return ["fbt-train", *train]
    if launcher == "local":
        return [os.path.join(REPO, "launch", "local.sh"), *launcher_args, *train]
    if launcher == "tpu_pod":
        return [os.path.join(REPO, "launch", "tpu_pod.sh"), *launcher_args, *train]
    raise ConfigError(f"--launcher={launcher!r} is unknown; use one of {LAUNCHERS}")


def levels(jobs: list[Job]) -> list[list[Job]]:
    """Jobs grouped by depth in the trunk tree: every job's parent is in an earlier level."""
    depth: dict[str, int] = {}
    for job in jobs:  # parents come first
        depth[job.name] = depth[job.parent] + 1 if job.parent else 0
    return [[j for j in jobs if depth[j.name] == d] for d in range(max(depth.values(), default=-1) + 1)]


def print_commands(sweep_dir: SweepDirectory, jobs: list[Job], launcher: str, launcher_args: tuple[str, ...]) -> str:
    lines = [f"# sweep {sweep_dir.name}: {len(jobs)} jobs in dependency order (run each after the one it forks from)"]
    for job in jobs:
        after = f", after {job.parent}" if job.parent else ""
        lines.append(f"# {job.name}: {job.kind}, steps {job.start}..{job.end}{after}")
        lines.append(shlex.join(command(sweep_dir, job, launcher, launcher_args)))
    return "\n".join(lines)


def run_local(
    sweep_dir: SweepDirectory,
    jobs: list[Job],
    parallel: int = 1,
    device_groups: list[str] | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, int]:
    """Run every job that is not done, parents first, up to `parallel` at once (each with its own
    `CUDA_VISIBLE_DEVICES` group when `device_groups` is given, else sharing the accelerators
    without preallocated memory pools: `job_environment`). A job another process is running
    (its workdir is locked) is waited for, not started twice; a failed job's descendants are
    skipped. SIGTERM or Ctrl-C stops the running jobs (each saves a checkpoint) and the sweep.
    Returns the exit code of every job started here."""
    by_name = {job.name: job for job in jobs}
    todo = [job for job in jobs if sweep_dir.status(job).state != "done"]
    outcome: dict[str, str] = {}  # decided in this invocation: done | failed | skipped
    owned: dict[str, tuple[subprocess.Popen, str | None, float]] = {}
    codes: dict[str, int] = {}
    free_groups = list(device_groups or [None] * parallel)
    stop = {"requested": False}
    previous = {s: signal.signal(s, lambda *_: stop.update(requested=True)) for s in (signal.SIGTERM, signal.SIGINT)}

    def state(name: str) -> str:
        return outcome.get(name) or ("running" if name in owned else sweep_dir.status(by_name[name]).state)

    try:
        while any(job.name not in outcome for job in todo) and not stop["requested"]:
            for name, (process, group, started) in list(owned.items()):
                if process.poll() is None:
                    continue
                codes[name] = process.returncode
                sweep_dir.record_exit(name, process.returncode, time.time() - started)
                free_groups.append(group)
                del owned[name]
                outcome[name] = "done" if process.returncode == 0 else "failed"
                log(f"{name}: {'done' if process.returncode == 0 else f'failed (exit {process.returncode})'}")
            for job in todo:
                if job.name in outcome or job.name in owned:
                    continue
                current = sweep_dir.status(job).state
                if current in ("done", "running"):  # finished or running elsewhere (another driver, an orphan)
                    outcome.update({job.name: "done"} if current == "done" else {})
                    continue
                parent = state(job.parent) if job.parent else "done"
                if parent in ("failed", "skipped"):
                    outcome[job.name] = "skipped"
                    log(f"{job.name}: skipped ({job.parent} {parent})")
                elif parent == "done" and free_groups and len(owned) < parallel:
                    group = free_groups.pop(0)
                    env = job_environment(os.environ, group, shared=device_groups is None and parallel > 1)
                    owned[job.name] = (_start(sweep_dir, job, env), group, time.time())
                    log(f"{job.name}: started ({job.kind}, steps {job.start}..{job.end})")
            time.sleep(0.2)
        if stop["requested"]:
            for process, _, _ in owned.values():
                process.send_signal(signal.SIGTERM)  # each saves a checkpoint and exits 75
            for name, (process, _, started) in owned.items():
                codes[name] = process.wait()
                sweep_dir.record_exit(name, codes[name], time.time() - started)
            codes["(sweep)"] = PREEMPTED_EXIT_CODE
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return codes


# The variables by which a user sizes JAX's GPU memory pool; any of them set means the user decided.
MEMORY_VARIABLES = ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_ALLOCATOR")


def job_environment(environ: Mapping[str, str], device_group: str | None, shared: bool) -> dict[str, str]:
    """A job's environment: its device group as CUDA_VISIBLE_DEVICES; and where `shared` (several
    jobs at once on the same accelerators), no up-front pool: JAX's default takes 75% of a GPU's
    memory in every process, so the second job on a GPU would fail at its first allocation. Memory
    settings the user made are kept."""
    env = dict(environ)
    if device_group is not None:
        env["CUDA_VISIBLE_DEVICES"] = device_group
    if shared and not any(name in env for name in MEMORY_VARIABLES):
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    return env


def _start(sweep_dir: SweepDirectory, job: Job, env: dict[str, str]) -> subprocess.Popen:
    train = [sys.executable, "-m", "fbt_jax.train", f"--config={sweep_dir.job_file(job)}"]
    sweep_dir.clear_exit(job.name)
    with open(sweep_dir.log_file(job.name), "ab") as log_file:  # appended: a resumed job keeps its history
        return subprocess.Popen(train, stdout=log_file, stderr=subprocess.STDOUT, env=env)


def write_slurm(
    sweep_dir: SweepDirectory, jobs: list[Job], sbatch_args: tuple[str, ...], submit: bool, log: Callable = print
) -> list[str]:
    """One array script per tree level under <sweep>/slurm/, each job of a level one task; with
    `submit`, sbatch them in order, each level after the previous one succeeded (afterok)."""
    scripts = []
    for number, level in enumerate(levels([j for j in jobs if sweep_dir.status(j).state != "done"])):
        names = " ".join(shlex.quote(j.name) for j in level)
        text = f"""#!/usr/bin/env bash
# fbt-sweep {sweep_dir.name}, level {number}: {len(level)} job(s), one per array task.
#SBATCH --job-name=fbt-sweep-{sweep_dir.name}-{number}
#SBATCH --array=0-{len(level) - 1}
#SBATCH --output={sweep_dir.path("logs")}/slurm-%A_%a.out
set -uo pipefail
names=({names})
name=${{names[$SLURM_ARRAY_TASK_ID]}}
bash {shlex.quote(os.path.join(REPO, "launch", "slurm_gpu.sbatch"))} --config={shlex.quote(sweep_dir.path("jobs"))}/$name.py \\
  >> {shlex.quote(sweep_dir.path("logs"))}/$name.log 2>&1
code=$?
echo "$code $SECONDS" > {shlex.quote(sweep_dir.path("logs"))}/$name.exit
echo "$code $SECONDS" >> {shlex.quote(sweep_dir.path("logs"))}/$name.attempts
exit $code
"""
        path = sweep_dir.path("slurm", f"level{number}.sbatch")
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        scripts.append(path)
    if submit:
        previous = None
        for path in scripts:
            dependency = [f"--dependency=afterok:{previous}"] if previous else []
            try:
                result = subprocess.run(
                    ["sbatch", "--parsable", *dependency, *sbatch_args, path], capture_output=True, text=True
                )
            except FileNotFoundError:
                raise ConfigError("sbatch is not on PATH; run on a SLURM login node, or use --executor=print") from None
            if result.returncode != 0:
                raise ConfigError(f"sbatch {path} failed: {' '.join(result.stderr.split())}")
            previous = result.stdout.strip().split(";")[0]
            log(f"submitted {path} as job {previous}")
    return scripts
