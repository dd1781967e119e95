"""Every experiment script of docs/results.md runs end to end in its --smoke mode and writes its
block and plot; docs/results.md has each experiment's markers, and names a command that exists."""

import os
import re
import shutil

import pytest
from conftest import ROOT, cpu_env, run_command

EXPERIMENTS = {
    # name: a header cell its table must have
    "state_tracking": "| mixture | mean K | K=1 | K=2 | K=3 | standard | soft | fused |",
    "depth_stability": "rate, passes 4–7",
    "layer_probes": "| task | trained | K=1 (no feedback) | K=2 (one feedback pass) | exact recurrence | chance |",
    "text_efficiency": "| variant | schedule | tokens | mean K | loss K=1 | loss K=2 | loss K=3 |",
    "upcycle_split": "| run | loss K=1 | loss K=2 | loss K=3 | accuracy K=1 | accuracy K=2 |",
}
RESULTS = os.path.join(ROOT, "docs", "results.md")


def test_results_md_has_every_experiments_block_and_nothing_else():
    text = open(RESULTS, encoding="utf-8").read()
    named = set(re.findall(r"<!-- begin: experiments/(\w+)\.py -->", text))
    assert named == set(EXPERIMENTS)
    scripts = {f[:-3] for f in os.listdir(os.path.join(ROOT, "experiments")) if f.endswith(".py") and f != "common.py"}
    assert scripts == set(EXPERIMENTS)
    for name in EXPERIMENTS:
        assert f"python experiments/{name}.py --write-docs docs/results.md" in text


@pytest.fixture(scope="module")
def smoke_dir(tmp_path_factory):
    """One directory for every smoke run, so that the state-tracking sweep is trained once."""
    directory = tmp_path_factory.mktemp("experiments")
    docs = directory / "docs"
    docs.mkdir()
    shutil.copy(RESULTS, docs / "results.md")
    return directory


@pytest.mark.slow
@pytest.mark.parametrize("name", list(EXPERIMENTS))
def test_experiment_smoke_run_writes_its_block_and_plot(name, smoke_dir):
    results = smoke_dir / "docs" / "results.md"
    before = results.read_text(encoding="utf-8")
    command = ["python", f"experiments/{name}.py", "--smoke", f"--dir={smoke_dir / 'runs' / name}"]
    # As a user runs it: one CPU device (no XLA_FLAGS).
    result = run_command(command + [f"--write-docs={results}"], cpu_env(None), timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    after = results.read_text(encoding="utf-8")
    begin, end = f"<!-- begin: experiments/{name}.py -->", f"<!-- end: experiments/{name}.py -->"
    block = after.split(begin)[1].split(end)[0]
    assert "Smoke run" in block and EXPERIMENTS[name] in block
    assert "nan" not in block.lower()
    # Only this block changed.
    assert after.split(begin)[0] == before.split(begin)[0] and after.split(end)[1] == before.split(end)[1]
    assert (smoke_dir / "docs" / "results" / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
