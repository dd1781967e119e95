"""The dry run: the 1B config builds, shards and compiles on simulated devices without allocating,
and its memory table shows every K fitting a v5e's 16 GiB per device."""

import re

from conftest import cpu_env, run_command


def test_the_1b_dry_run_completes_without_allocating_and_every_k_fits_16_gib():
    # As docs/launch.md has it and a user runs it (no XLA_FLAGS): the same programs as the docs test
    # compiles, so the session's compilation cache serves the second of the two.
    result = run_command(
        ["fbt-train", "--config=configs/fbt_1b.py", "--config.dry_run=True"], cpu_env(None), timeout=600
    )
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    count = int(out.split(" parameters")[0].split(": ")[-1].replace(",", ""))
    assert abs(count / 1e9 - 1) <= 0.05
    assert "over 64 cpu devices" in out and "dry run complete" in out
    for k in (1, 2, 3):
        assert f"compiled train step K={k}: compiled in" in out and "per-device memory" in out
        assert f"  K={k}: " in out
    assert "parameters + optimizer state" in out
    assert "memory per device against 16 GiB (v5e), at train.microbatches=2" in out
    rows = re.findall(r"^\| (\d) \| ([\d.]+) \| (yes|no) \| (.+) \|$", out, re.MULTILINE)
    assert [int(k) for k, *_ in rows] == [1, 2, 3], out
    for k, gib, fits, largest in rows:
        assert float(gib) <= 16 and fits == "yes", f"K={k}: {gib} GiB per device does not fit 16 GiB"
        assert re.fullmatch(r"\d+ examples \(train\.microbatches=\d+\)", largest), largest
