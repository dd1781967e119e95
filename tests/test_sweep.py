"""fbt-sweep: specs expand to stably named runs, runs that share a schedule prefix share trunks,
bad specs are one line, a killed sweep resumes to the same numbers without retraining what was
done, and the report gathers every run (issue #11)."""

import csv
import glob
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import ROOT, cpu_env, read_jsonl

from fbt_jax.errors import ConfigError
from fbt_jax.sweep import executors
from fbt_jax.sweep.plan import pass_counts, plan
from fbt_jax.sweep.spec import load_sweep
from fbt_jax.sweep.state import SweepDirectory

TINY_MIXTURES = os.path.join(ROOT, "configs", "sweeps", "tiny_mixtures.py")
# Three mixtures for 24 steps; a test adds spec keys as Python text (`extra`).
SMALL = {
    "base": os.path.join(ROOT, "configs", "tiny.py"),
    "overrides": {
        "train.steps": 24,
        "train.log_every": 4,
        "train.batch_size": 8,
        "checkpoint.every_steps": 4,
        "eval.every_steps": 8,
        "eval.num_batches": 1,
        "eval.batch_size": 8,
        "optimizer.warmup_steps": 2,
    },
    "grid": {"passes.schedule": {"k1": "0:1", "k12": "0:1; 0.5:2", "heavy": "0:1; 0.25:2=0.5,3=0.5"}},
}


def write_spec(tmp_path, name="small", extra=""):
    path = tmp_path / f"{name}.py"
    path.write_text(f"def get_sweep():\n    return {{{repr(SMALL)[1:-1]}, {extra}}}\n")
    return str(path)


def sweep_command(*args):
    return [sys.executable, "-m", "fbt_jax.sweep.cli", *args], cpu_env(1)


def test_a_spec_expands_to_every_combination_with_stable_names():
    sweep = load_sweep(TINY_MIXTURES)
    names = [run.name for run in sweep.runs]
    assert len(names) == 8 and len(set(names)) == 8
    assert "schedule=paper,seed=1" in names
    paper = next(r for r in sweep.runs if r.name == "schedule=paper,seed=1")
    assert paper.config.passes.schedule == "0:1; 0.75:2=0.88,3=0.12" and paper.config.seed == 1
    assert paper.config.train.steps == 2000  # the spec's common overrides
    assert load_sweep(TINY_MIXTURES).digest == sweep.digest


def test_runs_share_trunks_up_to_the_step_where_their_passes_differ(tmp_path):
    sweep = load_sweep(TINY_MIXTURES)
    jobs = plan(sweep, str(tmp_path))
    by_name = {job.name: job for job in jobs}
    trunks = [job for job in jobs if job.kind == "trunk"]
    assert len(trunks) == 4  # per seed: [0, 1000) for all four, [1000, 1500) for the three that wait
    for run in sweep.runs:
        chain, job = [], by_name[run.name]
        while job.parent:
            job = by_name[job.parent]
            chain.append(job)
        ks = pass_counts(run.config)
        for trunk in chain:  # a run's trunks drew exactly its K at every step they trained
            assert np.array_equal(pass_counts(trunk.config)[: trunk.end], ks[: trunk.end])
            assert trunk.config.train.stop_at_step == trunk.end
        assert by_name[run.name].start == (chain[0].end if chain else 0)
    assert [j.parent for j in jobs].index(None) == 0 and all(
        jobs.index(by_name[j.parent]) < jobs.index(j) for j in jobs if j.parent
    )
    steps_trained = sum(job.end - job.start for job in jobs)
    assert steps_trained == 2 * (1000 + 500 + 3 * 500 + 1000)  # vs 8 × 2000 without sharing


def sweep_main(argv, capsys):
    """fbt-sweep in this process: its exit code and stderr (a refusal is cheap, no command to start)."""
    from fbt_jax.sweep.cli import main

    with pytest.raises(SystemExit) as stopped:
        main(argv)
    return stopped.value.code, capsys.readouterr().err


def assert_one_line(code, stderr, pattern):
    assert code == 2 and "Traceback" not in stderr, stderr
    assert len(stderr.strip().splitlines()) == 1 and stderr.startswith("fbt-sweep: "), stderr
    assert re.search(pattern, stderr), stderr


@pytest.mark.parametrize(
    "extra, pattern",
    [
        ('"seeds": [0], "oops": 1', r"unknown field\(s\) \['oops'\]"),
        ('"seeds": [0], "runs": [{"name": "a", "train.stepz": 3}]', r"unknown config field 'train.stepz'"),
        ('"seeds": [0], "runs": [{"name": "a"}, {"name": "a"}]', r"occur twice"),
        # A field of the wrong shape: a scalar, or a string iterated character by character.
        ('"grid": {"optimizer.learning_rate": 0.001}', r"grid field 'optimizer.learning_rate' must be a list"),
        ('"grid": {"optimizer.learning_rate": "0.001"}', r"grid field 'optimizer.learning_rate' must be a list"),
        ('"grid": {"passes.schedule": "0:1"}', r"grid field 'passes.schedule' must be a list"),
        ('"grid": {"passes.schedule": {1: "0:1"}}', r"grid field 'passes.schedule': label 1 must be a string"),
        ('"grid": {3: [1]}', r"grid field 3 must be a config field's dotted name"),
        ('"grid": ["passes.schedule"]', r'"grid" must be a dict'),
        ('"seeds": 3', r'"seeds" must be a list of integers'),
        ('"seeds": "12"', r'"seeds" must be a list of integers'),
        ('"seeds": [0, "1"]', r'"seeds" must be a list of integers'),
        ('"runs": ["wide", "base"]', r'"runs" must be a list of dicts'),
        ('"runs": {"wide": {"model.embed_dim": 64}}', r'"runs" must be a list of dicts'),
        ('"runs": [{"name": 3}]', r"runs\[0\]: its name must be a string"),
        ('"runs": [{"name": "a", 3: 1}]', r"runs\[0\] field 3 must be a config field's dotted name"),
        ('"overrides": ["train.steps=10"]', r'"overrides" must be a dict'),
        ('"overrides": {("train", "steps"): 10}', r"overrides field \('train', 'steps'\) must be a config"),
        ('"base": 3', r'"base" must be the path of the run config'),
        ('"base": None', r'"base" must be the path of the run config'),
        ('"name": 3', r'"name" must be a string'),
        ('"name": ".."', r"sweep name '..' may not start with '.'"),
        # A label or run name that cannot be part of one directory name.
        ('"grid": {"passes.schedule": {"a/b": "0:1"}}', r"label 'a/b' .*'/'"),
        ('"grid": {"passes.schedule": {"": "0:1"}}', r"label '' is empty"),
        ('"seeds": [0], "runs": [{"name": "wide/x"}]', r"run name 'wide/x' .*'/'"),
        (r'"seeds": [0], "runs": [{"name": "a\\b"}]', r"run name 'a\\\\b' .*'\\\\'"),
        (r'"seeds": [0], "runs": [{"name": "a\x00b"}]', r"run name 'a\\x00b' .*a control character"),
        ('"seeds": [0], "runs": [{"name": ""}]', r"run name '' is empty"),
        ('"seeds": [0], "runs": [{"name": "w" * 300}]', r"run 'run=w+\.\.\.' has a name of \d+ bytes"),
    ],
)
def test_a_bad_spec_is_one_clear_error(tmp_path, capsys, extra, pattern):
    spec = write_spec(tmp_path, extra=extra)
    with pytest.raises(ConfigError, match=pattern):
        load_sweep(spec)
    sweep_dir = tmp_path / "sweep"  # the command says so in one line, before it writes anything
    assert_one_line(*sweep_main(["print", spec, f"--dir={sweep_dir}"], capsys), r"^fbt-sweep: config error: ")
    assert not sweep_dir.exists()


@pytest.mark.parametrize("steps", ["-1", "0"])
def test_a_trunk_shorter_than_one_step_is_refused(tmp_path, capsys, steps):
    """0 or less would make a trunk of no steps, which trains its whole run (stop_at_step=0)."""
    spec = write_spec(tmp_path, extra='"grid": {"passes.schedule": ["0:1", "0:2"]}')
    code, stderr = sweep_main(["print", spec, f"--dir={tmp_path / 'sweep'}", f"--min-shared-steps={steps}"], capsys)
    assert_one_line(code, stderr, rf"--min-shared-steps={steps} must be at least 1")
    assert not (tmp_path / "sweep").exists()


def test_a_spec_may_give_its_lists_as_tuples_or_ranges(tmp_path):
    spec = write_spec(tmp_path, extra='"seeds": range(2), "runs": ({"name": "a"},)')
    assert len(load_sweep(spec).runs) == 6


def test_a_mixture_that_does_not_sum_to_one_names_the_run(tmp_path):
    spec = tmp_path / "mixture.py"
    base = os.path.join(ROOT, "configs", "tiny.py")
    spec.write_text(
        f"def get_sweep():\n    return {{'base': {base!r}, 'seeds': [0], "
        "'runs': [{'name': 'bad', 'passes.schedule': '0:1=0.5,2=0.4'}]}\n"
    )
    with pytest.raises(ConfigError, match=r"sweep run run=bad,seed=0: .*passes.schedule"):
        load_sweep(str(spec))


def test_a_run_that_sets_a_swept_field_is_refused(tmp_path):
    spec = write_spec(tmp_path, extra='"runs": [{"name": "a", "passes.schedule": "0:1"}]')
    with pytest.raises(ConfigError, match=r"run 'a' sets \['passes.schedule'\], which the grid sweeps"):
        load_sweep(spec)


def test_an_empty_grid_is_refused(tmp_path):
    spec = tmp_path / "empty.py"
    spec.write_text(
        f"def get_sweep():\n    return {{'base': {os.path.join(ROOT, 'configs', 'tiny.py')!r}, 'grid': {{}}}}\n"
    )
    with pytest.raises(ConfigError, match="empty grid"):
        load_sweep(str(spec))


def test_a_sweep_directory_of_another_spec_is_refused_and_left_alone(tmp_path):
    sweep = load_sweep(write_spec(tmp_path, extra='"seeds": [0]'))
    directory = SweepDirectory(str(tmp_path / "dir"), sweep.name)
    directory.write(sweep, plan(sweep, directory.directory))
    before = open(directory.path("sweep.json")).read()
    other = load_sweep(write_spec(tmp_path, name="small", extra='"seeds": [1]'))
    command, env = sweep_command("run", write_spec(tmp_path, extra='"seeds": [1]'), f"--dir={directory.directory}")
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("fbt-sweep: config error: sweep directory")
    assert "Traceback" not in result.stderr and open(directory.path("sweep.json")).read() == before
    with pytest.raises(ConfigError, match="of another spec"):
        directory.check_same_spec(other)


def test_a_sweep_directory_written_before_config_fields_were_added_is_still_its_spec(tmp_path):
    """An upgrade that adds config fields (at their defaults) keeps existing sweep directories: one
    written without eval.harness_num_fewshot continues; the same spec setting that field is another spec."""
    from fbt_jax.sweep.spec import digest

    def without_new_field(config: dict) -> dict:
        config = json.loads(json.dumps(config))
        del config["eval"]["harness_num_fewshot"]
        return config

    spec = write_spec(tmp_path, extra='"seeds": [0]')
    sweep = load_sweep(spec)
    directory = SweepDirectory(str(tmp_path / "dir"), sweep.name)
    directory.write(sweep, plan(sweep, directory.directory))
    for path in glob.glob(directory.path("jobs", "*.json")):  # as an fbt-jax without the field wrote them
        with open(path) as f:
            old = without_new_field(json.load(f))
        with open(path, "w") as f:
            json.dump(old, f)
    record = json.load(open(directory.path("sweep.json")))
    record["digest"] = digest([(r.name, without_new_field(json.loads(r.config.to_json_best_effort())))
                               for r in sweep.runs])  # fmt: skip
    json.dump(record, open(directory.path("sweep.json"), "w"))
    assert record["digest"] != sweep.digest
    directory.check_same_spec(sweep)  # the same spec: the new field is at its default
    changed = load_sweep(spec, {"eval.harness_num_fewshot": 5})
    with pytest.raises(ConfigError, match="of another spec"):
        directory.check_same_spec(changed)


def test_print_lists_parents_first_and_slurm_chains_levels(tmp_path):
    sweep = load_sweep(write_spec(tmp_path, extra='"seeds": [0]'))
    directory = SweepDirectory(str(tmp_path / "dir"), sweep.name)
    jobs = plan(sweep, directory.directory)
    directory.write(sweep, jobs)
    text = executors.print_commands(directory, jobs, "tpu_pod", ("my-tpu", "us-east5-a"))
    commands = [line for line in text.splitlines() if not line.startswith("#")]
    assert len(commands) == len(jobs) and all("launch/tpu_pod.sh my-tpu us-east5-a --config=" in c for c in commands)
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "sbatch").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/sbatch.log\necho $$\n')
    os.chmod(fake / "sbatch", 0o755)
    old_path = os.environ["PATH"]
    os.environ["PATH"] = f"{fake}:{old_path}"
    try:
        scripts = executors.write_slurm(directory, jobs, ("--partition=gpu",), submit=True, log=lambda *_: None)
    finally:
        os.environ["PATH"] = old_path
    assert len(scripts) == len(executors.levels(jobs)) >= 2
    calls = (tmp_path / "sbatch.log").read_text().splitlines()
    assert len(calls) == len(scripts) and "--dependency" not in calls[0]
    assert all("--dependency=afterok:" in call and "--partition=gpu" in call for call in calls[1:])
    assert "#SBATCH --array=0-" in open(scripts[0]).read()


def test_jobs_sharing_a_gpu_get_no_preallocated_pool_and_the_users_memory_settings_stay(tmp_path, monkeypatch):
    """JAX preallocates 75% of a GPU per process: with --parallel=2 and no device groups, the second
    job would fail at its first allocation. Jobs given device groups, and memory settings the user
    made, are left as they are."""
    sweep = load_sweep(write_spec(tmp_path, extra='"seeds": [0]'))
    directory = SweepDirectory(str(tmp_path / "dir"), sweep.name)
    jobs = plan(sweep, directory.directory)
    directory.write(sweep, jobs)
    started = []

    def fake_start(sweep_dir, job, env):
        started.append(env)
        return subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])

    monkeypatch.setattr(executors, "_start", fake_start)
    for name in executors.MEMORY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    executors.run_local(directory, jobs, parallel=2, log=lambda *_: None)
    assert started and all(env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false" for env in started)
    started.clear()
    executors.run_local(directory, jobs, parallel=2, device_groups=["0", "1"], log=lambda *_: None)
    assert {env["CUDA_VISIBLE_DEVICES"] for env in started} <= {"0", "1"}
    assert started and not any("XLA_PYTHON_CLIENT_PREALLOCATE" in env for env in started)
    environ = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.3"}
    assert executors.job_environment(environ, None, shared=True) == environ
    assert "XLA_PYTHON_CLIENT_PREALLOCATE" not in executors.job_environment({}, None, shared=False)


def eval_lines(directory, run):
    return read_jsonl(os.path.join(directory, "runs", run), "eval.jsonl")


@pytest.mark.slow
def test_a_killed_sweep_resumes_to_the_same_numbers_and_reports(tmp_path):
    # Two of SMALL's mixtures (a shared trunk and two forks: three jobs per sweep).
    grid = {"passes.schedule": {k: SMALL["grid"]["passes.schedule"][k] for k in ("k12", "heavy")}}
    spec = write_spec(tmp_path, extra=f'"seeds": [0], "grid": {grid!r}')
    command, env = sweep_command("run", spec, f"--dir={tmp_path / 'whole'}")
    assert subprocess.run(command, env=env, capture_output=True, text=True, timeout=900).returncode == 0

    interrupted = tmp_path / "killed"
    command, env = sweep_command("run", spec, f"--dir={interrupted}")
    driver = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    deadline = time.time() + 600
    while time.time() < deadline:  # kill everything once the first fork is under way
        logs = [p for p in os.listdir(interrupted / "logs")] if (interrupted / "logs").exists() else []
        if any(name.startswith("schedule=") and name.endswith(".log") for name in logs):
            time.sleep(4)
            break
        time.sleep(0.5)
    os.killpg(driver.pid, signal.SIGKILL)  # the driver and every job it started, without warning
    driver.wait()
    trunk_attempts = {
        p: open(interrupted / "logs" / p).read() for p in os.listdir(interrupted / "logs") if p.endswith(".attempts")
    }
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    for name, attempts in trunk_attempts.items():  # finished jobs were not run again
        assert open(interrupted / "logs" / name).read() == attempts
    for run in ("schedule=k12,seed=0", "schedule=heavy,seed=0"):
        assert eval_lines(interrupted, run) == eval_lines(tmp_path / "whole", run)  # every eval, to the last bit

    # One run was evaluated with fbt-eval --tasks (its scores.json as evals/report.py writes it).
    from fbt_jax.evals.report import tables

    records = [{"task": "word_problem", "id": str(i), "mode": m, "sample": 0, "tokens": 1, "correct": i < c}
               for m, c in (("standard", 2), ("soft", 3)) for i in range(4)]  # fmt: skip
    scored = interrupted / "runs" / "schedule=heavy,seed=0" / "generative"
    scored.mkdir()
    (scored / "scores.json").write_text(json.dumps(tables(records, ("standard", "soft"), (1,), {})))
    # Another with fbt-eval --harness (its harness.json as evals/harness_run.py writes it).
    from fbt_jax.evals.harness_run import tables as harness_tables

    per_mode = {mode: {"results": {"tiny_mc": {"acc,none": acc, "acc_stderr,none": 0.25}},
                       "samples": {"tiny_mc": [{"doc_id": i, "acc": float(i < 4 * acc)} for i in range(4)]}}
                for mode, acc in (("standard", 0.25), ("soft", 0.5))}  # fmt: skip
    harnessed = interrupted / "runs" / "schedule=k12,seed=0" / "generative"
    harnessed.mkdir()
    (harnessed / "harness.json").write_text(json.dumps(harness_tables(per_mode, ("standard", "soft"))))
    command, env = sweep_command("report", f"--dir={interrupted}", "--scores=generative")
    report = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert report.returncode == 0, report.stderr
    with open(interrupted / "results.csv") as f:
        rows = {row["run"]: row for row in csv.DictReader(f)}
    scores = {run: row["final_word_problem/soft/pass@1"] for run, row in rows.items()}
    assert scores == {"schedule=k12,seed=0": "", "schedule=heavy,seed=0": "0.75"}  # a run without scores: blank
    assert (
        rows["schedule=k12,seed=0"]["final_tiny_mc/soft/acc"] == "0.5"
        and rows["schedule=heavy,seed=0"]["final_tiny_mc/soft/acc"] == ""
    )
    rows = open(interrupted / "results.csv").read().splitlines()
    assert len(rows) == 3 and rows[0].startswith("run,label.schedule")
    with open(interrupted / "results.csv") as f:
        for row in csv.DictReader(f):  # time over every attempt of the run's (interrupted) jobs
            assert 0 < float(row["goodput"]) < 1 and float(row["wall_seconds"]) > float(row["seconds"]) / 10
    table = open(interrupted / "results.md").read()
    assert "| schedule=heavy | 1 |" in table and "loss_K3" in table
    for plot in ("loss_vs_tokens.png", "final_vs_mixture.png"):
        assert open(interrupted / "plots" / plot, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert len(os.listdir(interrupted / "tensorboard")) == 2


def test_status_names_each_jobs_state_and_a_failures_last_line(tmp_path):
    sweep = load_sweep(write_spec(tmp_path, extra='"seeds": [0]'))
    directory = SweepDirectory(str(tmp_path / "dir"), sweep.name)
    jobs = plan(sweep, directory.directory)
    directory.write(sweep, jobs)
    trunk, failed, resumable = jobs[0], jobs[1], jobs[-1]
    os.makedirs(trunk.workdir)
    with open(os.path.join(trunk.workdir, "summary.json"), "w") as f:
        json.dump({"steps": trunk.end}, f)
    with open(directory.log_file(failed.name), "w") as f:
        f.write(
            "compiled train step K=1\nfbt-train: checkpoint error: saving checkpoint 8 failed (OSError: disk full)\n"
        )
    directory.record_exit(failed.name, 5, 12.5)
    os.makedirs(os.path.join(resumable.workdir, "checkpoints", "8"))
    states = {job.name: directory.status(job) for job in jobs}
    assert states[trunk.name].state == "done"
    assert states[failed.name].state == "failed"
    assert (
        states[failed.name].detail
        == "exit 5: fbt-train: checkpoint error: saving checkpoint 8 failed (OSError: disk full)"
    )
    assert states[resumable.name] == type(states[resumable.name])("pending", "resumes from step 8")
    assert directory.job_seconds(failed.name) == 12.5


def without_jobs(record):
    del record["jobs"]


def without_a_job_file(record):
    os.remove(os.path.join(os.path.dirname(record["spec"]), "sweep", "jobs", "schedule=k1,seed=0.json"))


def without_a_jobs_parent(record):
    del record["jobs"][0]["parent"]


def without_its_name(record):
    del record["name"]


@pytest.mark.parametrize(
    "damage, pattern",
    [
        (without_jobs, r"sweep\.json has no 'jobs'; run the sweep's spec again"),
        (without_a_job_file, r"jobs/schedule=k1,seed=0\.json is missing; run the sweep's spec again"),
        (without_a_jobs_parent, r"sweep\.json: jobs\[0\] has no 'parent'; run the sweep's spec again"),
        (without_its_name, r"sweep\.json has no 'name'; run the sweep's spec again"),
    ],
)
@pytest.mark.parametrize("command", ["status", "report"])
def test_a_damaged_sweep_directory_is_one_line_and_its_spec_rewrites_it(tmp_path, capsys, damage, pattern, command):
    spec = write_spec(tmp_path, extra='"seeds": [0]')
    sweep = load_sweep(spec)
    directory = SweepDirectory(str(tmp_path / "sweep"), sweep.name)
    directory.write(sweep, plan(sweep, directory.directory))
    with open(directory.path("sweep.json")) as f:
        record = json.load(f)
    damage(record)
    with open(directory.path("sweep.json"), "w") as f:
        json.dump(record, f)
    assert_one_line(*sweep_main([command, f"--dir={directory.directory}"], capsys), pattern)
    assert sweep_main(["print", spec, f"--dir={directory.directory}"], capsys)[0] == 0  # as the line says
    assert sweep_main(["status", f"--dir={directory.directory}"], capsys)[0] == 0


@pytest.mark.parametrize(
    "text, pattern",
    [
        ("[1, 2]", r"sweep\.json holds \[1, 2\], not a sweep record"),
        ('{"name": "small", "spec": "small.py", "runs": [], "jobs": []}', r"sweep\.json has no 'digest'"),
    ],
)
def test_a_sweep_json_of_unknown_spec_is_one_line_and_left_alone(tmp_path, capsys, text, pattern):
    (tmp_path / "sweep").mkdir()
    (tmp_path / "sweep" / "sweep.json").write_text(text)
    assert_one_line(*sweep_main(["status", f"--dir={tmp_path / 'sweep'}"], capsys), pattern)
    spec = write_spec(tmp_path, extra='"seeds": [0]')  # run refuses it too, and writes nothing there
    assert_one_line(*sweep_main(["print", spec, f"--dir={tmp_path / 'sweep'}"], capsys), pattern)
    assert (tmp_path / "sweep" / "sweep.json").read_text() == text and os.listdir(tmp_path / "sweep") == ["sweep.json"]
