"""fbt-decode on a checkpoint written by fbt-train: every mode, and bad input as one line."""

import json

import pytest
from conftest import run_command


@pytest.mark.slow
def test_fbt_decode_generates_in_each_mode_and_rejects_bad_input(tmp_path, trained_run):
    for mode in ("standard", "soft", "fused"):
        result = run_command(
            [
                "fbt-decode",
                f"--checkpoint={trained_run}",
                f"--mode={mode}",
                "--prompt=1 2 3",
                "--prompt=4",
                "--max-new-tokens=5",
            ]
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
        result = run_command(["fbt-decode", f"--checkpoint={trained_run}", "--prompt=1 2", flag])
        assert result.returncode == 2 and message in result.stderr.strip().splitlines()[-1]
    empty = tmp_path / "empty"
    empty.mkdir()
    result = run_command(["fbt-decode", f"--checkpoint={empty}", "--prompt=1"])
    assert result.returncode == 2 and "holds no checkpoint" in result.stderr
