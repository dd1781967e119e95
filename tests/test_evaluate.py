"""fbt-eval on a checkpoint written by fbt-train; the probes themselves."""

import json
import os

import numpy as np
import pytest
from conftest import run_command

from fbt_jax.probes import linear_probe


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


@pytest.mark.slow
def test_fbt_eval_writes_the_report_and_plots(tmp_path, trained_run):
    output = str(tmp_path / "eval")
    result = run_command(
        [
            "fbt-eval",
            f"--checkpoint={trained_run}",
            f"--output={output}",
            "--max-depth=40",
            "--seq-len=32",
            "--batch-size=16",
            "--probe-examples=64",
        ]
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.load(open(os.path.join(output, "report.json")))
    depth = report["depth"]
    assert len(depth["loss"]) == 40 and all(np.isfinite(depth["loss"]))
    # Past T passes nothing changes any more (exactness): the change drops to exactly 0.
    assert depth["change"][-1] == 0.0 and depth["change"][1] > 0
    assert len(report["sequential"]["loss"]) == 31 and all(n > 0 for n in report["sequential"]["state_norm"])
    assert set(report["modes"]) == {"standard", "soft", "fused"}
    assert all(0 <= r["accuracy"] <= 1 and r["loss"] > 0 for r in report["modes"].values())
    # Trained up to K = 3: the monitor's passes 4..7, from the same sweep's sums.
    monitor = report["contraction"]
    assert [monitor[f"pass_change_K{k}"] for k in range(4, 8)] == pytest.approx(depth["change"][3:7])
    assert monitor["contracting"] in (0.0, 1.0)
    probes = report["probes"]
    assert len(probes["K1"]) == len(probes["K2"]) == 2 and 0 < probes["chance"] < 1
    by_position = report["probes_by_position"]
    assert by_position["layer"] == 0 and by_position["positions"] == list(range(32))
    for name in ("K1", "K2", "exact", "chance"):
        assert len(by_position[name]) == 32 and all(0 <= a <= 1 for a in by_position[name])
    # Position 0 has no feedback in any setting: its state is its own token, readable by all three.
    assert min(by_position[name][0] for name in ("K1", "K2", "exact")) > 0.9
    assert "contraction monitor, passes 4–7" in result.stdout
    for name in ("depth.png", "sequential.png", "probes.png"):
        with open(os.path.join(output, name), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
