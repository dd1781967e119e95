"""The Weights & Biases sink (`metrics.wandb=True`), offline: what wandb records is what
metrics.jsonl and eval.jsonl record, with the run config and the summary; a resumed run continues
the same wandb run; only process 0 logs; a missing wandb is a one-line ConfigError. Nothing here
contacts wandb's servers: every wandb run is offline and its files stay under tmp_path."""

import glob
import json
import os
import shutil
import struct
import subprocess
import sys
import time

import jax
import pytest
from conftest import ROOT, checkpointed_config, read_jsonl
from test_train_cli import read_event_scalars

from fbt_jax import metrics
from fbt_jax.errors import ConfigError
from fbt_jax.metrics import MetricsWriter, check_metrics_config
from fbt_jax.train import goodput


@pytest.fixture
def offline_wandb(tmp_path):
    """wandb offline, its global files under tmp_path, and the environment and wandb's process-wide
    state (which reads the environment once) as they were before the test."""
    import wandb  # a test dependency: missing, the test fails rather than skips

    saved = dict(os.environ)
    wandb.teardown()
    os.environ.update(
        WANDB_MODE="offline",
        WANDB_CONSOLE="off",
        WANDB_SILENT="true",
        **{
            name: str(tmp_path / "wandb-home" / name)
            for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR")
        },
    )
    yield
    wandb.teardown()
    os.environ.clear()
    os.environ.update(saved)


# --- reading what wandb wrote offline ------------------------------------------------------------------


def wandb_records(path):
    """The records of a `.wandb` transaction log (a LevelDB-style log of `wandb_internal_pb2.Record`
    messages: a 7-byte header, then 32 KiB blocks of chunks, each with a 7-byte header: CRC,
    length, type FULL=1 / FIRST=2 / MIDDLE=3 / LAST=4). wandb 0.31 ships no Python reader."""
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    assert data[:4] == b":W&B", data[:7]
    pos, block, chunks = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            break
        chunks += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            yield record
            chunks = b""


def _items(updates):
    return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in updates}


def wandb_segments(workdir, wait_seconds=20.0):
    """What each life of the run logged to wandb, in the order they started: run id, config,
    history rows (wandb's own `_` keys left out) and summary. wandb's service process writes an
    offline run's file on its own time (a loaded CI machine once read one that did not yet hold
    its run record after `finish()` returned), so the files are read again until every one holds
    it, for up to `wait_seconds`."""
    deadline = time.monotonic() + wait_seconds
    while True:
        segments = _read_segments(workdir)
        if all(s["id"] is not None for s in segments) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    segments.sort(key=lambda segment: segment.pop("start", 0))
    return segments


def _read_segments(workdir):
    segments = []
    for path in glob.glob(os.path.join(workdir, "wandb", "offline-run-*", "*.wandb")):
        segment = {"id": None, "config": {}, "history": [], "summary": {}}
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                segment["id"], segment["start"] = record.run.run_id, record.run.start_time.ToNanoseconds()
                segment["config"].update(_items(record.run.config.update))
            elif kind == "config":
                segment["config"].update(_items(record.config.update))
            elif kind == "history":
                row = _items(record.history.item)
                segment["history"].append({k: v for k, v in row.items() if not k.startswith("_")})
            elif kind == "summary":
                segment["summary"].update(_items(record.summary.update))
        segment["config"].pop("_wandb", None)
        segments.append(segment)
    return segments


def expected_rows(rows, prefix=""):
    """The wandb rows of metrics.jsonl / eval.jsonl rows: the numbers TensorBoard gets, the step as train_step."""
    return [
        {"train_step": row["step"]}
        | {f"{prefix}{k}": v for k, v in row.items() if k != "step" and isinstance(v, (int, float))}
        for row in rows
    ]


# --- tests -------------------------------------------------------------------------------------------------


def wandb_config(tmp_path, steps=6):
    config = checkpointed_config(tmp_path, steps=steps)
    config.metrics.wandb = True
    config.eval.num_batches, config.eval.batch_size, config.eval.every_steps = 1, 16, 3
    config.eval.num_passes, config.eval.contraction_passes = (1, 2), 0  # fewer programs to compile
    return config


@pytest.mark.slow
def test_wandb_records_the_metrics_config_and_eval_and_a_resume_continues_its_run(tmp_path, offline_wandb):
    from fbt_jax.train.trainer import Trainer

    config = wandb_config(tmp_path, steps=6)
    workdir = config.workdir
    run = Trainer(config, log=lambda *_: None, devices=jax.devices()[:1]).train(progress=False)
    first_train, first_eval = read_jsonl(workdir), read_jsonl(workdir, "eval.jsonl")
    run_id = open(os.path.join(workdir, metrics.WANDB_RUN_ID_FILE)).read().strip()
    [first] = wandb_segments(workdir)
    assert first["id"] == run_id
    assert first["config"] == json.loads(config.to_json_best_effort())
    assert [r["step"] for r in first_train] == [1, 2, 3, 4, 5, 6] and [r["step"] for r in first_eval] == [3, 6]
    assert first["history"] == sorted(
        expected_rows(first_train) + expected_rows(first_eval, "eval/"), key=lambda r: r["train_step"]
    )  # eval rows come after the train row of their step
    assert first["summary"]["eval/loss_K1"] == first_eval[-1]["loss_K1"]
    figures = goodput.flat(run["goodput"])  # what the trainer gives write_summary
    assert first["summary"].items() >= figures.items()
    tensorboard = read_event_scalars(os.path.join(workdir, "tensorboard"))
    assert {k: tensorboard[f"summary/{k}"] for k in figures} == {k: [(6, pytest.approx(v))] for k, v in figures.items()}

    # A run killed after step 6 whose newest checkpoint is step 4: the next life resumes from
    # step 4 and logs steps 5 and 6 again, into the same wandb run.
    shutil.rmtree(os.path.join(workdir, "checkpoints", "6"))
    config.checkpoint.max_to_keep = 4  # a change a resume allows, seen in the resumed run's wandb config
    summary = Trainer(config, log=lambda *_: None, devices=jax.devices()[:1]).train(progress=False)
    assert summary["start_step"] == 4
    _, second = wandb_segments(workdir)
    assert second["id"] == run_id
    assert second["config"] == json.loads(config.to_json_best_effort())
    train, evals = read_jsonl(workdir), read_jsonl(workdir, "eval.jsonl")
    assert [r["step"] for r in train] == list(range(1, 7)) and [r["step"] for r in evals] == [3, 6]
    assert second["history"] == expected_rows(train[4:]) + expected_rows(evals[1:], "eval/")
    # wandb keeps the killed life's rows of steps 5 and 6 beside the resumed life's (metrics.jsonl
    # only the resumed life's): wandb's history holds those steps twice.
    logged = [row["train_step"] for segment in (first, second) for row in segment["history"] if "loss" in row]
    assert logged == [1, 2, 3, 4, 5, 6, 5, 6]


def test_wandb_summary_gets_write_summary_and_a_new_run_gets_a_new_wandb_run(tmp_path, offline_wandb):
    config = wandb_config(tmp_path)
    workdir = config.workdir
    writer = MetricsWriter.for_run(config, workdir)
    writer.write(1, {"loss": 2.5})
    writer.write_summary({"goodput": 0.75, "seconds/compile": 1.5})
    writer.close()
    first_id = open(os.path.join(workdir, metrics.WANDB_RUN_ID_FILE)).read().strip()
    MetricsWriter.for_run(config, workdir, resume_step=0).close()  # step 0: a new run
    second_id = open(os.path.join(workdir, metrics.WANDB_RUN_ID_FILE)).read().strip()
    MetricsWriter.for_run(config, workdir, resume_step=3).close()  # a resume continues the last one
    segments = wandb_segments(workdir)
    assert first_id != second_id
    assert [s["id"] for s in segments] == [first_id, second_id, second_id]
    assert segments[0]["history"] == [{"train_step": 1, "loss": 2.5}]
    assert segments[0]["summary"]["goodput"] == 0.75 and segments[0]["summary"]["seconds/compile"] == 1.5
    assert segments[0]["config"]["metrics"]["wandb"] is True


def test_wandb_logs_only_on_process_0(tmp_path, monkeypatch):
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    monkeypatch.setitem(sys.modules, "wandb", None)  # any import of wandb would fail
    config = wandb_config(tmp_path)
    writer = MetricsWriter.for_run(config, config.workdir, resume_step=2)
    writer.write(3, {"loss": 1.0})
    writer.write_summary({"goodput": 1.0})
    writer.close()
    assert not os.path.exists(config.workdir)


def test_wandb_missing_is_a_one_line_config_error(tmp_path, monkeypatch):
    config = wandb_config(tmp_path)
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with pytest.raises(ConfigError) as err:
        check_metrics_config(config)
    message = str(err.value)
    assert "\n" not in message and "metrics.wandb=True" in message
    assert "pip install 'fbt-jax[wandb]'" in message and "--config.metrics.wandb=False" in message
    config.metrics.wandb = False
    check_metrics_config(config)  # nothing asked for, nothing needed


def test_wandb_that_cannot_start_is_a_one_line_config_error(tmp_path, offline_wandb, monkeypatch):
    import wandb

    def no_login(**kwargs):
        raise wandb.errors.UsageError("No API key configured.\nUse `wandb login` to log in.")

    monkeypatch.setattr(wandb, "init", no_login)
    config = wandb_config(tmp_path)
    with pytest.raises(ConfigError) as err:
        MetricsWriter.for_run(config, config.workdir)
    message = str(err.value)
    assert "\n" not in message and "No API key configured" in message and "WANDB_MODE=offline" in message


def test_importing_metrics_does_not_import_wandb():
    code = "import sys, fbt_jax.metrics, fbt_jax.train.trainer; assert 'wandb' not in sys.modules"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
