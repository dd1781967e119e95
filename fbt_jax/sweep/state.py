"""A sweep's directory, and what it says about each job.

    sweep.json            the spec's path and digest, the runs and the job tree
    jobs/<name>.py|.json  each job's full run config (fbt-train --config=jobs/<name>.py)
    logs/<name>.log|.exit each job's output and, once it ended, its exit code
    trunks/<name>/        trunk workdirs;  runs/<name>/: one workdir per run
    results.csv, results.md, plots/   written by `fbt-sweep report`

A directory belongs to one spec: running another spec in it is refused (nothing is overwritten).
"""

from __future__ import annotations

import dataclasses
import fcntl
import glob
import json
import os
from typing import Any

from fbt_jax.config import config_from_dict, default_config
from fbt_jax.errors import ConfigError, describe
from fbt_jax.sweep.plan import Job, job_record
from fbt_jax.sweep.spec import Run, Sweep, digest

JOB_FILE = '''"""Written by fbt-sweep: job {name} of sweep {sweep}. Its config is {name}.json beside this file."""

import json
import pathlib

from fbt_jax.config import config_from_dict, default_config


def get_config():
    return config_from_dict(json.loads(pathlib.Path(__file__).with_suffix(".json").read_text()))
'''


# What `SweepDirectory.load` reads from sweep.json (`write` records them all).
RECORD_FIELDS = ("name", "spec", "digest", "runs", "jobs")
JOB_FIELDS = ("name", "kind", "start", "end", "parent", "members")
RUN_FIELDS = ("name", "labels", "overrides")


@dataclasses.dataclass(frozen=True)
class JobStatus:
    state: str  # pending | running | done | failed
    detail: str = ""  # the step it resumes from, or the failure's last line


class SweepDirectory:
    def __init__(self, directory: str, name: str):
        self.directory, self.name = os.path.abspath(directory), name

    def path(self, *parts: str) -> str:
        return os.path.join(self.directory, *parts)

    def job_file(self, job: Job) -> str:
        return self.path("jobs", f"{job.name}.py")

    def log_file(self, name: str) -> str:
        return self.path("logs", f"{name}.log")

    def write(self, sweep: Sweep, jobs: list[Job]) -> None:
        """Record the sweep and write every job's config; refuses a directory of another spec."""
        self.check_same_spec(sweep)
        for sub in ("jobs", "logs", "slurm"):
            os.makedirs(self.path(sub), exist_ok=True)
        for job in jobs:
            with open(self.path("jobs", f"{job.name}.json"), "w", encoding="utf-8") as f:
                f.write(job.config.to_json_best_effort(indent=2))
            with open(self.job_file(job), "w", encoding="utf-8") as f:
                f.write(JOB_FILE.format(name=job.name, sweep=sweep.name))
        record = {
            "name": sweep.name,
            "spec": sweep.spec_path,
            "digest": sweep.digest,
            "runs": [{"name": r.name, "labels": r.labels, "overrides": r.overrides} for r in sweep.runs],
            "jobs": [job_record(j) for j in jobs],
        }
        with open(self.path("sweep.json"), "w", encoding="utf-8") as f:
            json.dump(record, f, indent=2, default=str)

    def check_same_spec(self, sweep: Sweep) -> None:
        recorded = self.record()
        if recorded is None or recorded.get("digest") == sweep.digest:
            return
        if "digest" not in recorded:  # whose sweep this is cannot be told: nothing may be written over it
            raise ConfigError(self._no_digest())
        if recorded.get("digest") == self._digest_on_known_fields(sweep):  # written before fields were added
            return
        raise ConfigError(
            f"sweep directory {self.directory} holds sweep {recorded.get('name')!r} of another spec "
            f"({recorded.get('spec')}); use another --dir, or the spec it was made with (nothing was changed)"
        )

    def _digest_on_known_fields(self, sweep: Sweep) -> str | None:
        """The digest an earlier fbt-jax, before config fields were added, wrote for this spec: these
        runs' configs on the fields it knew (a recorded job's config has them all); None where a field
        added since is not at its default (then it is another spec)."""
        recorded_jobs = sorted(glob.glob(self.path("jobs", "*.json")))
        if not recorded_jobs:
            return None
        with open(recorded_jobs[0], encoding="utf-8") as f:
            known = json.load(f)
        defaults = json.loads(default_config().to_json_best_effort())
        restricted = []
        for run in sweep.runs:
            kept = _on_known_fields(json.loads(run.config.to_json_best_effort()), known, defaults)
            if kept is None:
                return None
            restricted.append((run.name, kept))
        return digest(restricted)

    def record(self) -> dict[str, Any] | None:
        path = self.path("sweep.json")
        if not os.path.exists(path):
            return None
        try:
            with open(path, encoding="utf-8") as f:
                record = json.load(f)
        except (OSError, ValueError) as err:
            raise ConfigError(
                f"{path} cannot be read ({err}); it is not a sweep directory written by fbt-sweep"
            ) from None
        if not isinstance(record, dict):
            shown = json.dumps(record)
            raise ConfigError(
                f"{path} holds {shown if len(shown) <= 40 else shown[:37] + '...'}, not a sweep record; "
                "it is not a sweep directory written by fbt-sweep: give another --dir"
            )
        return record

    def load(self) -> tuple[Sweep, list[Job]]:
        """The sweep and its jobs as recorded here (no spec file needed: status and report)."""
        record = self.record()
        if record is None:
            raise ConfigError(f"{self.directory} holds no sweep.json; start the sweep with: fbt-sweep run SPEC")
        self._check_record(record)
        configs = {job["name"]: self._job_config(job["name"]) for job in record["jobs"]}
        jobs = [
            Job(j["name"], j["kind"], j["start"], j["end"], j["parent"], tuple(j["members"]), configs[j["name"]])
            for j in record["jobs"]
        ]
        runs = [Run(r["name"], r["overrides"], r["labels"], configs[r["name"]]) for r in record["runs"]]
        return Sweep(record["name"], record["spec"], runs, record["digest"]), jobs

    def _check_record(self, record: dict[str, Any]) -> None:
        """ConfigError naming the first field `load` needs that sweep.json lacks (a file cut short
        or edited by hand): `fbt-sweep run` with the sweep's spec writes it anew."""
        rewrite = f"run the sweep's spec again (fbt-sweep run SPEC --dir={self.directory}) to write it anew"
        path = self.path("sweep.json")
        if "digest" not in record:  # `run` cannot tell whether the spec is its own: it will not rewrite it
            raise ConfigError(self._no_digest())
        missing = [field for field in RECORD_FIELDS if field not in record]
        if missing:
            raise ConfigError(f"{path} has no {missing[0]!r}; {rewrite}")
        for field, entry_fields in (("jobs", JOB_FIELDS), ("runs", RUN_FIELDS)):
            if not isinstance(record[field], list):
                raise ConfigError(f"{path}: {field!r} is not a list; {rewrite}")
            for i, entry in enumerate(record[field]):
                if not isinstance(entry, dict):
                    raise ConfigError(f"{path}: {field}[{i}] is not a record; {rewrite}")
                lacking = [key for key in entry_fields if key not in entry]
                if lacking:
                    raise ConfigError(f"{path}: {field}[{i}] has no {lacking[0]!r}; {rewrite}")
        jobs = {job["name"] for job in record["jobs"]}
        for run in record["runs"]:
            if run["name"] not in jobs:  # every run is a job of its own name (plan.py)
                raise ConfigError(f"{path}: run {run['name']!r} has no job of its name in 'jobs'; {rewrite}")

    def _no_digest(self) -> str:
        return (
            f"{self.path('sweep.json')} has no 'digest', so which spec made this sweep cannot be told; "
            "restore the file, or start the sweep in another --dir (nothing was changed)"
        )

    def _job_config(self, name: str) -> Any:
        path = self.path("jobs", f"{name}.json")
        try:
            with open(path, encoding="utf-8") as f:
                return config_from_dict(json.load(f))
        except FileNotFoundError:
            raise ConfigError(
                f"{path} is missing; run the sweep's spec again (fbt-sweep run SPEC --dir={self.directory}) "
                "to write every job's config anew"
            ) from None
        except (OSError, ValueError, TypeError, AttributeError) as err:
            raise ConfigError(
                f"{path} cannot be read as a job's config ({describe(err)}); run the sweep's spec again "
                f"(fbt-sweep run SPEC --dir={self.directory}) to write it anew"
            ) from None

    def record_exit(self, name: str, code: int, seconds: float) -> None:
        """A job's exit code (`logs/<name>.exit`), and its attempt's wall time (`.attempts`)."""
        with open(self.path("logs", f"{name}.exit"), "w", encoding="utf-8") as f:
            f.write(f"{code} {seconds:.1f}\n")
        with open(self.path("logs", f"{name}.attempts"), "a", encoding="utf-8") as f:
            f.write(f"{code} {seconds:.1f}\n")

    def job_seconds(self, name: str) -> float | None:
        """Wall time a job took, summed over its attempts (interrupted ones too); None if unknown."""
        path = self.path("logs", f"{name}.attempts")
        if not os.path.exists(path):
            return None
        with open(path, encoding="utf-8") as f:
            return sum(float(line.split()[1]) for line in f if len(line.split()) == 2)

    def clear_exit(self, name: str) -> None:
        if os.path.exists(self.path("logs", f"{name}.exit")):
            os.remove(self.path("logs", f"{name}.exit"))

    def status(self, job: Job) -> JobStatus:
        summary = read_json(os.path.join(job.workdir, "summary.json"))
        if summary is not None and summary.get("steps") == job.end:
            return JobStatus("done")
        if _locked(os.path.join(job.workdir, ".fbt-train.lock")):
            return JobStatus("running")
        exit_path = self.path("logs", f"{job.name}.exit")
        if os.path.exists(exit_path):
            code = (open(exit_path, encoding="utf-8").read().split() or ["?"])[0]
            if code != "0":
                return JobStatus("failed", f"exit {code}: {last_error_line(self.log_file(job.name))}")
        saved = _saved_steps(os.path.join(job.workdir, "checkpoints"))
        return JobStatus("pending", f"resumes from step {saved[-1]}" if saved else "")


def last_error_line(log_path: str) -> str:
    """The job's own one-line error (`fbt-train: ...`), else its last line."""
    try:
        with open(log_path, encoding="utf-8", errors="replace") as f:
            lines = [line.strip() for line in f if line.strip()]
    except OSError:
        return "(no log)"
    ours = [line for line in lines if line.startswith("fbt-train:")]
    return (ours or lines or ["(empty log)"])[-1]


def read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _locked(path: str) -> bool:
    """Whether a live fbt-train holds this workdir lock (see workdir.RunDirectory.lock)."""
    if not os.path.exists(path):
        return False
    with open(path, "a+", encoding="utf-8") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return True
        fcntl.flock(handle, fcntl.LOCK_UN)
        return False


def _saved_steps(directory: str) -> list[int]:
    if not os.path.isdir(directory):
        return []
    return sorted(int(name) for name in os.listdir(directory) if name.isdigit())


def _on_known_fields(values: dict, known: dict, defaults: dict) -> dict | None:
    """`values` restricted to the fields `known` has (nested), or None where a field it lacks is
    not at its default (a new field set: another spec)."""
    out = {}
    for key, value in values.items():
        if key not in known:
            if value != defaults.get(key):
                return None
        elif isinstance(value, dict) and isinstance(known[key], dict):
            inner = _on_known_fields(value, known[key], defaults.get(key) or {})
            if inner is None:
                return None
            out[key] = inner
        else:
            out[key] = value
    return out
