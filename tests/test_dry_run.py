"""The dry run: the 1B config builds, shards and compiles on simulated devices without allocating."""

from conftest import run_command


def test_the_1b_dry_run_completes_without_allocating():
    result = run_command(["fbt-train", "--config=configs/fbt_1b.py", "--config.dry_run=True"], timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    count = int(out.split(" parameters")[0].split(": ")[-1].replace(",", ""))
    assert abs(count / 1e9 - 1) <= 0.05
    assert "over 64 cpu devices" in out and "dry run complete" in out
    for k in (1, 2, 3):
        assert f"compiled train step K={k}: compiled in" in out and "per-device memory" in out
        assert f"  K={k}: " in out
    assert "parameters + optimizer state" in out
