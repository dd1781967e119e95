"""Run-time services: the time ledger of a run over its attempts (goodput.py) and the profiler
window (hooks.Profiler). The compilation cache is tested through restarts in tests/test_bucket.py
and benchmarks/restart_cost.py."""

import glob
import gzip
import json
import os
import time

import jax
import ml_collections
import pytest
from conftest import cpu_env, run_command, train_argv

from fbt_jax.errors import ConfigError
from fbt_jax.run_services import parse_profile_steps
from fbt_jax.train import goodput
from fbt_jax.train.hooks import Profiler
from fbt_jax.train.loop import StepEnd


def test_ledger_accounts_each_attempt_and_recomputed_steps_pro_rata(tmp_path):
    first = goodput.Ledger(str(tmp_path), start_step=0, started=time.time() - 20.0)
    first.add("compile", 3.0)
    first.add("data_wait", 1.0)
    first.step = 50  # killed after step 50, with checkpoint 40 saved
    first.close_loop(11.0)  # 11 s in the loop, 1 s of it waiting for data
    first.write(force=True)
    assert first.seconds["steps"] == pytest.approx(10.0) and first.seconds["recomputed"] == 0.0

    second = goodput.Ledger(str(tmp_path), start_step=40, started=time.time() - 30.0)
    assert second.furthest == 50  # from the first attempt's line
    second.add("checkpoint", 2.0)
    second.step = 100
    second.close_loop(14.0)  # 12 s of steps: 10 of the 60 steps were run before
    assert second.seconds["recomputed"] == pytest.approx(2.0) and second.seconds["steps"] == pytest.approx(10.0)
    second.write(force=True)

    lines = goodput.read_ledger(os.path.join(tmp_path, goodput.LEDGER_NAME))
    assert [a["attempt"] for a in lines] == [1, 2] and [a["end_step"] for a in lines] == [50, 100]
    summary = second.summary()
    assert summary["attempts"] == 2
    assert summary["seconds"]["steps"] == pytest.approx(20.0)
    assert summary["wall_seconds"] == pytest.approx(50.0, abs=0.5)  # each attempt from its own start
    assert summary["goodput"] == pytest.approx(20.0 / summary["wall_seconds"])
    for attempt in lines:  # every second of an attempt is in exactly one category
        assert sum(attempt["seconds"].values()) == pytest.approx(attempt["wall_seconds"], rel=1e-6)
    assert set(goodput.flat(summary)) >= {"goodput", "wall_seconds", "seconds/recomputed"}


@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_profile_window_is_none(value):
    assert parse_profile_steps(value, 10) is None


@pytest.mark.parametrize("value", ["0:2", "3:2", "5:11", "a:b", "4"])
def test_a_bad_profile_window_is_refused(value):
    with pytest.raises(ConfigError, match="train.profile_steps"):
        parse_profile_steps(value, 10)


class RecordingSaver:
    """Stands for the checkpoint hook: records when the profiler lets its save land."""

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def settle(self) -> None:
        self.calls.append("save landed")


@pytest.mark.parametrize("profile_python", [False, True])
def test_the_trace_stops_after_the_windows_save_has_landed_and_traces_python_only_on_request(
    monkeypatch, tmp_path, profile_python
):
    # Stopping jax's profiler while checkpoint threads started or ended crashed runs (SIGSEGV in
    # stop_trace, issue #58): the window's save lands first, and Python is traced only on request.
    calls = []
    monkeypatch.setattr(jax.profiler, "start_trace", lambda d, **kw: calls.append(kw["profiler_options"]))
    monkeypatch.setattr(jax.profiler, "stop_trace", lambda: calls.append("trace stopped"))
    train = ml_collections.ConfigDict({"profile_steps": "3:4", "steps": 6, "profile_python": profile_python})
    profiler = Profiler.for_run(train, str(tmp_path), start_step=0, log=lambda line: None, saver=RecordingSaver(calls))
    profiler.on_step(StepEnd(step=2, num_passes=1, last=False, stopping=False))
    assert calls[0].python_tracer_level == int(profile_python) and calls[0].host_tracer_level == 2
    assert not profiler.wants(StepEnd(step=3, num_passes=1, last=False, stopping=False))
    end = StepEnd(step=4, num_passes=1, last=False, stopping=False)
    assert profiler.wants(end)
    profiler.on_interval(end, {}, state=None)
    assert calls[1:] == ["save landed", "trace stopped"]


@pytest.mark.slow
def test_profile_window_traces_its_steps_and_a_resume_past_it_traces_nothing(tmp_path):
    # In its own process: a profiler session in the test process would outlive the run's threads.
    workdir = str(tmp_path / "run")
    argv = train_argv(workdir, "--config.train.steps=6", "--config.checkpoint.every_steps=2")
    result = run_command([*argv, "--config.train.profile_steps=3:4"], cpu_env(1))
    assert result.returncode == 0, result.stderr[-2000:]
    traces = glob.glob(os.path.join(workdir, "profile", "plugins", "profile", "*", "perfetto_trace.json.gz"))
    assert len(traces) == 1, result.stdout
    with gzip.open(traces[0]) as f:
        events = json.load(f)["traceEvents"]
    steps = [e for e in events if e.get("name") == "PjitFunction(jit(train_step))"]
    assert 2 <= len(steps) <= 4, len(steps)  # the window's two steps (a dispatch may show as two nested events)
    assert not [e for e in events if str(e.get("name")).startswith("$")]  # no Python tracer unless asked for
    assert "profile: tracing steps 3–4" in result.stdout
    with open(os.path.join(workdir, "summary.json")) as f:
        time_summary = json.load(f)["goodput"]
    assert time_summary["attempts"] == 1 and 0 < time_summary["goodput"] < 1

    resumed = run_command([*argv, "--config.train.steps=8", "--config.train.profile_steps=3:4"], cpu_env(1))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "ran before this run resumed at step 6; not traced" in resumed.stdout
    assert len(glob.glob(os.path.join(workdir, "profile", "plugins", "profile", "*"))) == 1
