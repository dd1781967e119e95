"""Which jobs a sweep runs: runs that agree on everything but their pass schedule share trunks.

Two runs train identically for as long as their configs agree on every field that changes the
trained numbers (`workdir.trajectory_fields`) and their schedules draw the same K at each step
(K is a function of (seed, step)). The planner splits each such group recursively at the first
step where its members' K differ: the shared steps become a trunk job (stopping there with a
checkpoint, `train.stop_at_step`), and each part continues from it (`fork_from`), down to one job
per run. A trunk shorter than `min_shared_steps` is not worth a process and a compile: its
members then start where its parent ended.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any

import ml_collections
import numpy as np

from fbt_jax.schedule import PassSchedule
from fbt_jax.sweep.spec import Sweep
from fbt_jax.workdir import trajectory_fields


@dataclasses.dataclass(frozen=True)
class Job:
    name: str
    kind: str  # "trunk" or "run"
    start: int  # the step it continues from (its parent's end), 0 without a parent
    end: int  # the step it stops at
    parent: str | None  # the job it forks from
    members: tuple[str, ...]  # the runs whose steps [start, end) it trains
    config: ml_collections.ConfigDict

    @property
    def workdir(self) -> str:
        return self.config.workdir


def pass_counts(config: ml_collections.ConfigDict) -> np.ndarray:
    """K at every step of a run."""
    schedule = PassSchedule.parse(config.passes.schedule, config.train.steps, config.seed)
    return np.array([schedule.num_passes(step) for step in range(config.train.steps)], np.int32)


def plan(sweep: Sweep, directory: str, min_shared_steps: int | None = None) -> list[Job]:
    """Every job of the sweep, parents before children. Workdirs: <directory>/{trunks,runs}/<name>."""
    groups: dict[str, list[int]] = {}
    for i, run in enumerate(sweep.runs):
        key = json.dumps(trajectory_fields(json.loads(run.config.to_json_best_effort())), sort_keys=True)
        groups.setdefault(key, []).append(i)
    jobs: list[Job] = []
    for members in groups.values():
        ks = np.stack([pass_counts(sweep.runs[i].config) for i in members])
        steps = ks.shape[1]
        minimum = max(1, steps // 20) if min_shared_steps is None else min_shared_steps
        _split(sweep, directory, dict(zip(members, ks)), 0, None, minimum, jobs)
    return jobs


def _split(
    sweep: Sweep, directory: str, ks: dict[int, np.ndarray], start: int, parent: Job | None, minimum: int, jobs: list
) -> None:
    """Jobs for the runs `ks` (index → K per step), which agree on every step before `start`."""
    members = sorted(ks)
    if len(members) == 1:
        run = sweep.runs[members[0]]
        jobs.append(_job(run.name, "run", start, run.config.train.steps, parent, (run.name,), run.config, directory))
        return
    end = len(ks[members[0]])
    agree = np.all(np.stack([ks[i][start:] for i in members]) == ks[members[0]][start:], axis=0)
    split_at = start + int(np.argmin(agree)) if not agree.all() else end  # the first step they differ
    if split_at - start >= minimum:
        names = tuple(sweep.runs[i].name for i in members)
        digest = hashlib.blake2b("\n".join(names).encode(), digest_size=4).hexdigest()
        first = sweep.runs[members[0]].config
        parent = _job(f"trunk-{split_at}-{digest}", "trunk", start, split_at, parent, names, first, directory)
        jobs.append(parent)
        start = split_at
    if split_at == end:  # identical to the end: each run still gets its own job (and outputs)
        classes = [{i: ks[i]} for i in members]
    else:  # the members that draw the same K at split_at stay together
        by_k: dict[int, dict[int, np.ndarray]] = {}
        for i in members:
            by_k.setdefault(int(ks[i][split_at]), {})[i] = ks[i]
        classes = list(by_k.values())
    for cls in classes:
        _split(sweep, directory, cls, start, parent, minimum, jobs)


def _job(
    name: str,
    kind: str,
    start: int,
    end: int,
    parent: Job | None,
    members: tuple[str, ...],
    base: ml_collections.ConfigDict,
    directory: str,
) -> Job:
    config = base.copy_and_resolve_references()
    config.workdir = os.path.join(directory, "trunks" if kind == "trunk" else "runs", name)
    config.checkpoint.dir = ""
    config.fork_from = parent.workdir if parent is not None else ""
    config.train.stop_at_step = end if kind == "trunk" else 0
    if kind == "trunk" and config.checkpoint.every_steps == 0:
        config.checkpoint.every_steps = end  # a trunk must leave its state for its forks
    return Job(name, kind, start, end, parent.name if parent else None, members, config)


def job_record(job: Job) -> dict[str, Any]:
    return {
        "name": job.name,
        "kind": job.kind,
        "start": job.start,
        "end": job.end,
        "parent": job.parent,
        "members": list(job.members),
        "workdir": job.workdir,
    }
