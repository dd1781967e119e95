"""The `fbt-train` command end to end: metrics, evaluation and TensorBoard logs, one-line errors."""

import glob
import os
import struct

import numpy as np
import pytest
from conftest import read_jsonl, run_command

REQUIRED_KEYS = {"step", "loss", "num_passes", "grad_norm", "learning_rate", "tokens_per_second", "loss_pass_1"}


def read_event_scalars(directory):
    """Scalars from TensorBoard event files (TFRecord framing around Event protos)."""
    from tensorboardX.proto import event_pb2

    scalars = {}
    for path in glob.glob(os.path.join(directory, "events.out.tfevents.*")):
        with open(path, "rb") as f:
            data = f.read()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset : offset + 8])
            event = event_pb2.Event.FromString(data[offset + 12 : offset + 12 + length])
            offset += 12 + length + 4
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("run") / "tiny")
    result = run_command(
        [
            "fbt-train",
            "--config=configs/tiny.py",
            f"--config.workdir={workdir}",
            "--config.train.steps=150",
            "--config.train.log_every=4",
            "--config.optimizer.warmup_steps=4",
            "--config.eval.num_batches=2",
            "--config.eval.every_steps=75",
            "--config.eval.contraction_every_steps=60",
        ],
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return workdir, result


@pytest.mark.slow
def test_cli_writes_metrics_with_every_required_key(cli_run):
    workdir, result = cli_run
    rows = read_jsonl(workdir)
    assert [r["step"] for r in rows] == [*range(4, 150, 4), 150]
    for row in rows:
        assert REQUIRED_KEYS <= row.keys()
        assert {f"loss_pass_{k}" for k in range(1, row["num_passes"] + 1)} <= row.keys()
        assert "loss_pass_4" not in row  # the schedule never draws K > 3
        assert 1 <= row["mean_num_passes"] <= 3
        assert np.isfinite(row["loss"]) and row["tokens_per_second"] > 0
    assert {r["num_passes"] for r in rows[-3:]} & {2, 3}  # the late feedback phase ran
    for line in ("compiled train step K=1", "compiled train step K=2", "compiled train step K=3"):
        assert line in result.stdout
    assert f"outputs in {workdir}" in result.stdout


@pytest.mark.slow
def test_cli_loss_goes_down_on_the_builtin_task(cli_run):
    workdir, _ = cli_run
    rows = read_jsonl(workdir)
    first, last = rows[0]["loss"], np.mean([r["loss_pass_1"] for r in rows[-3:]])
    chance = np.log(6)  # S3 has 6 elements
    assert last < first - 0.5 and last < chance - 0.1, (first, last, chance)
    evals = read_jsonl(workdir, "eval.jsonl")
    assert evals[-1]["accuracy_K1"] > 1 / 6 + 0.05  # learned something beyond chance on held-out data


@pytest.mark.slow
def test_cli_writes_eval_and_tensorboard(cli_run):
    workdir, result = cli_run
    evals = read_jsonl(workdir, "eval.jsonl")
    assert [e["step"] for e in evals] == [75, 150]
    assert {"loss_K1", "loss_K2", "loss_K3", "accuracy_K3"} <= evals[-1].keys()
    assert "K=3: loss" in result.stdout
    scalars = read_event_scalars(os.path.join(workdir, "tensorboard"))
    assert [step for step, _ in scalars["loss"]] == [*range(4, 150, 4), 150]
    rows = read_jsonl(workdir)
    assert np.allclose([v for _, v in scalars["loss"]], [r["loss"] for r in rows], rtol=1e-6)
    eval_scalars = scalars
    assert "eval/loss_K2" in eval_scalars


@pytest.mark.slow
def test_cli_logs_the_contraction_monitor_beyond_the_trained_passes(cli_run):
    """The schedule trains up to K = 3: the monitor measures passes 4..7 every 60 steps (and at the
    last) into metrics.jsonl and TensorBoard, at every eval into eval.jsonl, and in the summary."""
    workdir, result = cli_run
    monitored = {f"pass_change_K{k}" for k in range(4, 8)} | {"contraction_rate", "contracting"}
    rows = {r["step"]: r for r in read_jsonl(workdir)}
    assert [step for step, r in rows.items() if "contraction_rate" in r] == [60, 120, 150]
    for step in (60, 120, 150):
        assert monitored <= rows[step].keys()
        assert "pass_change_K3" not in rows[step] and "pass_change_K8" not in rows[step]
        changes = [rows[step][f"pass_change_K{k}"] for k in range(4, 8)]
        assert all(np.isfinite(changes)) and min(changes) > 0
        rate = (changes[-1] / changes[0]) ** (1 / 3)
        assert rows[step]["contraction_rate"] == pytest.approx(rate)
        assert rows[step]["contracting"] == float(rate < 1 and changes[-1] < 1)
    evals = read_jsonl(workdir, "eval.jsonl")
    assert all(monitored <= e.keys() for e in evals)
    scalars = read_event_scalars(os.path.join(workdir, "tensorboard"))
    assert [step for step, _ in scalars["contraction_rate"]] == [60, 120, 150]
    assert "eval/contraction_rate" in scalars
    assert "contraction monitor, passes 4–7: per-pass change" in result.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--config=configs/tiny.py", "--config.train.step=5"], "Did you mean"),
        (["--config=configs/nope.py"], "configs/nope.py"),
    ],
)
def test_cli_flag_errors_are_one_line(args, message):
    result = run_command(["fbt-train", *args], timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fbt-train: ") and message in lines[0], result.stderr


def test_cli_reports_a_bad_config_as_one_line_before_compiling():
    result = run_command(["fbt-train", "--config=configs/tiny.py", "--config.model.num_heads=5"], timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "fbt-train: config error: model.num_heads=5 does not divide model.embed_dim=64; "
        "choose heads so that embed_dim % num_heads == 0, or set model.head_dim"
    ]
    assert "compiled" not in result.stdout
