"""The suite's groups reach the workers (tests/scheduling.py): a file's tests run in one worker, a
split file's go anywhere, the longest group first. Checked on a small suite of its own, run by
pytest-xdist on two workers exactly as pyproject.toml runs ours."""

import collections
import os
import subprocess
import sys

from conftest import ROOT

CONFTEST = f"""
import os, sys
sys.path.insert(0, {os.path.join(ROOT, "tests")!r})
import scheduling
from scheduling import pytest_collection_modifyitems, pytest_xdist_make_scheduler
scheduling.SECONDS = {{"test_late.py": 100.0}}
"""
# Each test records its worker; a module fixture records each time it is made.
MODULE = """
import os, pytest
{extra}
@pytest.fixture(scope="module")
def made(request):
    with open(os.path.join(os.environ["RECORD"], "fixtures"), "a") as f:
        f.write(request.module.__name__ + "\\n")
@pytest.mark.parametrize("i", range(4))
def test_one(made, i):
    with open(os.path.join(os.environ["RECORD"], "tests"), "a") as f:
        f.write(f"{{__name__}} {{i}} {{os.environ['PYTEST_XDIST_WORKER']}}\\n")
"""


def test_a_files_tests_run_in_one_worker_and_its_module_fixtures_are_made_once(tmp_path):
    suite, record = tmp_path / "suite", tmp_path / "record"
    suite.mkdir(), record.mkdir()
    (suite / "conftest.py").write_text(CONFTEST)
    for name, extra in (("test_early", ""), ("test_split", "XDIST_SPLIT = True"), ("test_late", "")):
        (suite / f"{name}.py").write_text(MODULE.format(extra=extra))
    env = {**os.environ, "RECORD": str(record), "FBT_TEST_SHARED_DIR": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup",
         "--no-loadscope-reorder", "-c", os.devnull, "--rootdir", str(suite), str(suite)],
        cwd=suite, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    runs = [line.split() for line in (record / "tests").read_text().splitlines()]
    workers = collections.defaultdict(set)
    for module, _, worker in runs:
        workers[module].add(worker)
    assert len(runs) == 12
    assert len(workers["test_early"]) == len(workers["test_late"]) == 1  # a file is one group
    made = collections.Counter((record / "fixtures").read_text().split())
    assert made["test_early"] == made["test_late"] == 1  # so its module fixture is made once
    assert made["test_split"] == len(workers["test_split"])  # once per worker that took some
    (late_worker,) = workers["test_late"]
    first_of_its_worker = next(module for module, _, worker in runs if worker == late_worker)
    assert first_of_its_worker == "test_late"  # the longest group (SECONDS) was sent out first
