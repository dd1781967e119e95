"""The code base stays ruff-clean (part of the test command so CI enforces it)."""

import subprocess
import sys

from conftest import ROOT


def test_ruff_is_clean():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
