"""fbt-eval and fbt-decode on a checkpoint written by fbt-train; the probe itself."""

import json
import os
import subprocess

import numpy as np
import pytest
from test_config import ROOT

from fbt_jax.evaluate import linear_probe


def test_probe_recovers_a_planted_signal_and_reports_chance_on_shuffled_labels():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 4, 1200)
    features = rng.normal(size=(1200, 16))
    features[:, 3] += 6.0 * labels  # the label is linearly readable from one direction
    accuracy = linear_probe(features[:800], labels[:800], features[800:], labels[800:])
    assert accuracy > 0.9
    shuffled = rng.permutation(labels[:800])
    chance = linear_probe(features[:800], shuffled, features[800:], labels[800:])
    assert abs(chance - 0.25) < 0.08


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("eval") / "run")
    subprocess.run(
        [
            "fbt-train",
            "--config=configs/tiny.py",
            f"--config.workdir={workdir}",
            "--config.train.steps=40",
            "--config.optimizer.warmup_steps=4",
            "--config.eval.num_batches=0",
            "--config.passes.schedule=0:1;0.5:2=0.9,3=0.1",
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
        env={**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"},
    )
    return workdir


def test_fbt_eval_writes_the_report_and_plots(tmp_path, trained_run):
    output = str(tmp_path / "eval")
    result = subprocess.run(
        [
            "fbt-eval",
            f"--checkpoint={trained_run}",
            f"--output={output}",
            "--max-depth=40",
            "--seq-len=32",
            "--batch-size=16",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.load(open(os.path.join(output, "report.json")))
    depth = report["depth"]
    assert len(depth["loss"]) == 40 and all(np.isfinite(depth["loss"]))
    # Past T passes nothing changes any more (exactness): the change drops to exactly 0.
    assert depth["change"][-1] == 0.0 and depth["change"][1] > 0
    assert len(report["sequential"]["loss"]) == 31 and all(n > 0 for n in report["sequential"]["state_norm"])
    assert set(report["mode_accuracy"]) == {"standard", "soft", "fused"}
    probes = report["probes"]
    assert len(probes["K1"]) == len(probes["K2"]) == 2 and 0 < probes["chance"] < 1
    for name in ("depth.png", "sequential.png", "probes.png"):
        with open(os.path.join(output, name), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_fbt_decode_generates_in_each_mode_and_rejects_bad_input(tmp_path, trained_run):
    for mode in ("standard", "soft", "fused"):
        result = subprocess.run(
            [
                "fbt-decode",
                f"--checkpoint={trained_run}",
                f"--mode={mode}",
                "--prompt=1 2 3",
                "--prompt=4",
                "--max-new-tokens=5",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        assert result.returncode == 0, result.stderr[-2000:]
        lines = [json.loads(line) for line in result.stdout.strip().splitlines()]
        assert [len(line["tokens"]) for line in lines] == [5, 5] and lines[0]["mode"] == mode
    bad = {
        "--checkpoint=/nonexistent": "is not a directory",
        "--mode=hard": "--mode='hard' is unknown",
        "--prompt=1 99": "token id 99 is outside the vocabulary",
    }
    for flag, message in bad.items():
        args = ["fbt-decode", f"--checkpoint={trained_run}", "--prompt=1 2", flag]
        result = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
        assert result.returncode == 2 and message in result.stderr.strip().splitlines()[-1]
    empty = tmp_path / "empty"
    empty.mkdir()
    result = subprocess.run(
        ["fbt-decode", f"--checkpoint={empty}", "--prompt=1"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 2 and "holds no checkpoint" in result.stderr
