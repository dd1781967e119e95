"""`fbt-sweep`: run, watch and report a sweep of run configs that share their trunks.

    fbt-sweep run configs/sweeps/tiny_mixtures.py            # trains every run, sharing trunks
    fbt-sweep status                                          # pending / running / done / failed
    fbt-sweep report                                          # results.csv, results.md, plots

Rerunning `run` skips finished jobs and resumes interrupted ones from their checkpoints.
`status` and `report` take the sweep's spec or --dir; without either, the newest sweep under
runs/sweeps/.
"""

from __future__ import annotations

import glob
import os
import shlex
import sys

from fbt_jax import paths
from fbt_jax.errors import PREEMPTED_EXIT_CODE, ArgumentParser, ConfigError, reported
from fbt_jax.sweep import executors
from fbt_jax.sweep.plan import plan
from fbt_jax.sweep.report import write_report
from fbt_jax.sweep.spec import load_sweep, parse_override
from fbt_jax.sweep.state import SweepDirectory

PROG = "fbt-sweep"
DEFAULT_ROOT = os.path.join("runs", "sweeps")


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("run", "status", "report", "print"), help="what to do")
    parser.add_argument("spec", nargs="?", help="the sweep spec (a Python file with get_sweep())")
    parser.add_argument("--dir", help=f"the sweep directory (default: {DEFAULT_ROOT}/<sweep name>)")
    parser.add_argument("--executor", default="local", choices=("local", "slurm", "print"), help="for run")
    parser.add_argument("--parallel", type=int, default=1, help="local: jobs at once")
    parser.add_argument("--devices", default="", help="local: device groups, e.g. '0,1;2,3' (CUDA_VISIBLE_DEVICES)")
    parser.add_argument("--launcher", default="none", choices=executors.LAUNCHERS, help="print: wrap commands")
    parser.add_argument("--launcher-args", default="", help="print: the launcher's own arguments")
    parser.add_argument("--sbatch-args", default="", help="slurm: extra sbatch arguments (resources)")
    parser.add_argument("--no-submit", action="store_true", help="slurm: write the scripts only")
    parser.add_argument(
        "--override", action="append", default=[], help="FIELD=VALUE for every run (repeatable), e.g. train.steps=100"
    )
    parser.add_argument(
        "--min-shared-steps",
        type=int,
        default=None,
        help="shortest trunk worth a job, at least 1 (default: 5%% of the run)",
    )
    parser.add_argument(
        "--scores",
        default="",
        help="report: each run's `fbt-eval --tasks` or `--harness` output, relative to its workdir",
    )
    with reported(PROG):
        args = parser.parse_args(argv)
        if args.parallel < 1:
            raise ConfigError(f"--parallel={args.parallel} must be at least 1")
        if args.min_shared_steps is not None and args.min_shared_steps < 1:  # a trunk of 0 steps trains it all
            raise ConfigError(
                f"--min-shared-steps={args.min_shared_steps} must be at least 1 (a trunk trains at least one step); "
                "leave it out for the default, 5% of the run"
            )
        if args.command in ("run", "print"):
            code = run(args)
        else:
            code = inspect(args)
    sys.exit(code)


def run(args) -> int:
    if not args.spec:
        raise ConfigError(f"{args.command} needs the sweep spec: fbt-sweep {args.command} configs/sweeps/<name>.py")
    sweep = load_sweep(paths.resolve(args.spec, "spec"), dict(parse_override(o) for o in args.override))
    sweep_dir = SweepDirectory(paths.resolve(args.dir or os.path.join(DEFAULT_ROOT, sweep.name), "--dir"), sweep.name)
    sweep_dir.check_same_spec(sweep)  # before anything is written
    jobs = plan(sweep, sweep_dir.directory, args.min_shared_steps)
    sweep_dir.write(sweep, jobs)
    trunks = sum(j.kind == "trunk" for j in jobs)
    print(
        f"sweep {sweep.name}: {len(sweep.runs)} runs, {len(jobs)} jobs ({trunks} shared trunks) in {sweep_dir.directory}"
    )
    executor = "print" if args.command == "print" else args.executor
    if executor == "print":
        print(executors.print_commands(sweep_dir, jobs, args.launcher, tuple(shlex.split(args.launcher_args))))
        return 0
    if executor == "slurm":
        executors.write_slurm(sweep_dir, jobs, tuple(shlex.split(args.sbatch_args)), submit=not args.no_submit)
        return 0
    groups = [g for g in args.devices.split(";") if g] or None
    codes = executors.run_local(sweep_dir, jobs, len(groups) if groups else args.parallel, groups)
    print(status_table(sweep_dir, jobs))
    if "(sweep)" in codes:
        print(f"{PROG}: stopped on request; run the same command again to resume", file=sys.stderr)
        return PREEMPTED_EXIT_CODE
    failed = [name for name, code in codes.items() if code != 0]
    if failed:
        print(f"{PROG}: {len(failed)} job(s) failed ({', '.join(failed)}); see fbt-sweep status", file=sys.stderr)
        return 1
    print(f"done; next: fbt-sweep report --dir={sweep_dir.directory}")
    return 0


def inspect(args) -> int:
    if args.dir:
        directory = paths.resolve(args.dir, "--dir")
    elif args.spec:
        directory = os.path.abspath(os.path.join(DEFAULT_ROOT, load_sweep(paths.resolve(args.spec, "spec")).name))
    else:
        found = sorted(glob.glob(os.path.join(DEFAULT_ROOT, "*", "sweep.json")), key=os.path.getmtime)
        if not found:
            raise ConfigError(f"no sweep under {DEFAULT_ROOT}/; give the spec or --dir")
        directory = os.path.dirname(os.path.abspath(found[-1]))
    sweep_dir = SweepDirectory(directory, os.path.basename(directory))
    sweep, jobs = sweep_dir.load()
    if args.command == "status":
        print(status_table(sweep_dir, jobs))
        return 0
    written = write_report(sweep_dir, sweep, jobs, args.scores)
    if not written:
        print(
            f"{PROG}: no run of {sweep.name} has finished yet; see fbt-sweep status --dir={directory}", file=sys.stderr
        )
        return 1
    with open(written["md"], encoding="utf-8") as f:
        print(f.read().rstrip())
    print("wrote " + ", ".join(written.values()))
    print(f"browse in TensorBoard: tensorboard --logdir {sweep_dir.path('tensorboard')}")
    return 0


def status_table(sweep_dir: SweepDirectory, jobs) -> str:
    lines = [f"{'job':<44} {'kind':<6} {'steps':<13} state"]
    for job in jobs:
        status = sweep_dir.status(job)
        state = f"{status.state} ({status.detail})" if status.detail else status.state
        lines.append(f"{job.name:<44} {job.kind:<6} {f'{job.start}..{job.end}':<13} {state}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
