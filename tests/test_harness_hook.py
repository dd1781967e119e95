"""lm-evaluation-harness during training (`eval.harness_tasks`, train/harness_hook.py): the end of a
run is never lost to its evaluation. The step an evaluation acts on is checkpointed (and its
metrics line written) first; an evaluation that fails is one line with exit 7, one stopped by
SIGTERM exits 75 after its current batch, and the same command run again evaluates that step only.
What the harness would refuse about a task is refused before anything compiles or is written."""

import json
import os
import signal
import subprocess
import time

import pytest
from conftest import HARNESS_TASKS, ROOT, cpu_env, last_line, read_jsonl, run_command, start_command, tear_last_line

from fbt_jax.config import default_config
from fbt_jax.errors import ConfigError
from fbt_jax.train import harness_hook

STEPS = 6


def text_args(prepared, workdir, tasks_dir, *extra: str) -> list[str]:
    return [
        "fbt-train",
        f"--config={ROOT}/configs/tiny.py",
        f"--config.workdir={workdir}",
        "--config.data.source=text",
        f"--config.data.path={prepared[1]}",
        "--config.data.seq_len=32",
        "--config.model.vocab_size=257",
        f"--config.train.steps={STEPS}",
        "--config.optimizer.warmup_steps=1",
        "--config.eval.num_batches=0",
        "--config.eval.contraction_passes=0",
        "--config.passes.schedule=0:1",
        "--config.checkpoint.every_steps=100",  # more than train.steps: only the final checkpoint
        "--config.eval.harness_tasks=tiny_mc",
        "--config.eval.harness_modes=standard",
        "--config.eval.harness_batch_size=8",
        f"--config.eval.harness_include={tasks_dir}",
        *extra,
    ]


def task_copy(directory, documents: list[dict]) -> str:
    """tiny_mc with its data in `directory` (an absolute data_files path) holding `documents`."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(HARNESS_TASKS, "tiny_mc.yaml"), encoding="utf-8") as f:
        text = f.read().replace("tests/harness/tiny_mc.jsonl", os.path.join(directory, "tiny_mc.jsonl"))
    with open(os.path.join(directory, "tiny_mc.yaml"), "w", encoding="utf-8") as f:
        f.write(text)
    with open(os.path.join(directory, "tiny_mc.jsonl"), "w", encoding="utf-8") as f:
        f.writelines(json.dumps(d) + "\n" for d in documents)
    return str(directory)


def tiny_mc() -> list[dict]:
    with open(os.path.join(HARNESS_TASKS, "tiny_mc.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def harness_records(workdir) -> dict[int, dict]:
    return {r["step"]: r for r in read_jsonl(workdir, "eval.jsonl") if "harness/seconds" in r}


@pytest.mark.slow
def test_the_last_step_is_saved_before_its_evaluation_which_a_rerun_does_alone(tmp_path, prepared):
    workdir = tmp_path / "run"
    # A continuation longer than the context: found only when the requests are built, at the end.
    documents = tiny_mc()
    documents[0] = {**documents[0], "choices": [" " + "iota " * 10, *documents[0]["choices"][1:]]}
    tasks = task_copy(tmp_path / "tasks", documents)
    argv = text_args(prepared, workdir, tasks)
    env = cpu_env(1, PYTHONUNBUFFERED="1")

    failed = run_command(argv, env)
    assert failed.returncode == 7, failed.stderr[-2000:]
    assert failed.stderr.strip().count("\n") == 0, failed.stderr  # one line
    line = last_line(failed.stderr)
    assert line.startswith("fbt-train: evaluation failed: the lm-evaluation-harness evaluation at step 6 failed")
    assert "does not fit the model's context" in line and "checkpoint 6 is saved" in line
    assert os.listdir(workdir / "checkpoints") == [str(STEPS)]  # the run is not lost
    assert read_jsonl(workdir)[-1]["step"] == STEPS and not harness_records(workdir)  # the final metrics line

    task_copy(tmp_path / "tasks", tiny_mc())  # the cause fixed; the same command, stopped during the evaluation
    process = start_command(argv, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    for out in process.stdout:
        if out.startswith("harness: evaluating step 6"):
            break
    process.send_signal(signal.SIGTERM)
    stopped = time.perf_counter()
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 75, stderr[-2000:]
    assert time.perf_counter() - stopped < 30  # after its current batch, not at the evaluation's end
    assert last_line(stderr).startswith("fbt-train: preempted: stopped on request during the lm-evaluation")
    assert not harness_records(workdir)

    # A torn last line in each log (a kill or a full disk mid-write) is dropped, not a traceback.
    for log in ("metrics.jsonl", "eval.jsonl"):
        tear_last_line(workdir / log)
    done = run_command(argv, env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"resuming from checkpoint {workdir}/checkpoints/{STEPS}" in done.stdout
    for log in ("metrics.jsonl", "eval.jsonl"):
        assert f"{workdir / log}: dropped line" in done.stdout, done.stdout
    assert "compiled train step" not in done.stdout  # nothing trained: the evaluation only
    records = harness_records(workdir)
    assert list(records) == [STEPS] and records[STEPS]["harness/tiny_mc/acc/standard"] >= 0
    assert os.listdir(workdir / "checkpoints") == [str(STEPS)] and read_jsonl(workdir)[-1]["step"] == STEPS
    # Done: a rerun finds the record and evaluates nothing more (the catch-up's test, without the run).
    assert harness_hook.done_at(str(workdir / "eval.jsonl"), STEPS) and not harness_hook.done_at(
        str(workdir / "eval.jsonl"), STEPS - 1
    )


@pytest.mark.slow
def test_a_refused_task_leaves_an_existing_run_as_it_was_and_compiles_nothing(tmp_path, prepared):
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "config.json").write_text('{"written": "by an earlier run"}')
    # Relative data files from another directory: not on this machine as the task names them.
    result = run_command(text_args(prepared, workdir, HARNESS_TASKS), cpu_env(1), cwd=tmp_path)
    assert result.returncode == 2 and "task 'tiny_mc': its data is not on this machine" in last_line(result.stderr)
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert "compiled" not in result.stdout and os.listdir(workdir) == ["config.json"]
    assert (workdir / "config.json").read_text() == '{"written": "by an earlier run"}'


def config_for(prepared, **harness) -> object:
    config = default_config()
    config.data.source, config.data.path, config.data.seq_len = "text", prepared[1], 16
    config.model.vocab_size = 257
    config.eval.harness_tasks, config.eval.harness_include = "tiny_mc", HARNESS_TASKS
    for key, value in harness.items():
        setattr(config.eval, f"harness_{key}", value)
    return config


@pytest.mark.parametrize(
    "harness, message",
    [
        ({"tasks": "tiny_gen", "modes": "standard"}, "task 'tiny_gen' generates up to 8 tokens (its max_gen_toks)"),
        ({"batch_size": 0}, "--config.eval.harness_batch_size=0 must be at least 1"),
        ({"modes": "standard,soft"}, "asks for soft or fused, but passes.schedule draws no feedback pass"),
        ({"tasks": " , "}, "--config.eval.harness_tasks names no task"),
    ],
)
def test_what_the_backend_would_refuse_is_refused_before_the_run_builds_anything(
    prepared, monkeypatch, harness, message
):
    from fbt_jax.data.plan import plan_data
    from fbt_jax.validation import validate_config

    monkeypatch.chdir(ROOT)  # the tasks' relative data files
    config = config_for(prepared, **harness)
    config.data.seq_len = 8
    config.passes.schedule = "0:1"
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate_config(config)
        harness_hook.check(config, plan_data(config))
