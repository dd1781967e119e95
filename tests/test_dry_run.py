"""The dry run without libtpu: the 1B config builds, shards and compiles every program on 64
simulated CPU devices without allocating, says that its figures are the CPU compiler's, and gives
its memory table against a v5e's 16 GiB. (Compiled for a TPU slice with the TPU compiler:
tests/test_targets.py, and benchmarks/compile_memory.py for the 1B figures.)"""

import re

import pytest
from conftest import cpu_env, run_command


@pytest.mark.slow
def test_the_1b_dry_run_on_the_cpu_compiles_every_program_and_says_whose_figures_they_are():
    # As docs/launch.md has it and a user runs it (no XLA_FLAGS): the same programs as the docs test
    # compiles, so the session's compilation cache serves the second of the two.
    result = run_command(
        ["fbt-train", "--config=configs/fbt_1b.py", "--config.dry_run=True"], cpu_env(None), timeout=600
    )
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    count = int(out.split(" parameters")[0].split(": ")[-1].replace(",", ""))
    assert abs(count / 1e9 - 1) <= 0.05
    assert "figures from: the CPU compiler over 64 cpu devices (a TPU's or GPU's compiler gives other figures" in out
    assert "over 64 cpu devices" in out and "dry run complete" in out
    for k in (1, 2, 3):
        assert f"compiled train step K={k}: compiled in" in out and "per-device memory" in out
        assert f"  K={k}: " in out
    assert "compiled eval (K up to 3): compiled in" in out and "compiled contraction monitor" in out
    assert "parameters + optimizer state" in out
    assert "memory per device against 16 GiB (v5e), at train.microbatches=1 (8 examples per device" in out
    rows = re.findall(r"^\| (\d) \| ([\d.]+) \| (yes|no) \| (.+) \|$", out, re.MULTILINE)
    assert [int(k) for k, *_ in rows] == [1, 2, 3], out
    for k, gib, fits, largest in rows:
        assert (fits == "yes") == (float(gib) <= 16), f"K={k}: {gib} GiB per device, fits {fits}"
        assert re.fullmatch(r"\d+ examples \(train\.microbatches=\d+\)", largest), largest
