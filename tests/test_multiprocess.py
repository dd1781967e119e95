"""Several local processes (jax.distributed over localhost, CPU collectives) act as one job."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import cpu_env, read_jsonl, run_command, start_command

STEPS = 12
ARGS = [
    "--config=configs/tiny.py",
    f"--config.train.steps={STEPS}",
    "--config.train.log_every=1",
    "--config.optimizer.warmup_steps=1",
    "--config.passes.schedule=0:1=0.5,2=0.5",
    "--config.eval.num_batches=2",
]


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("mp") / "two")
    result = run_command(
        ["launch/local.sh", "--devices-per-process", "2", "2", *ARGS, f"--config.workdir={workdir}"],
        cpu_env(2),
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return workdir, result


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("mp") / "one")
    result = run_command(["fbt-train", *ARGS, f"--config.workdir={workdir}"], cpu_env(4), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return workdir


@pytest.mark.slow
def test_two_processes_match_one_process_with_the_same_devices(two_process_run, one_process_run):
    two, one = read_jsonl(two_process_run[0]), read_jsonl(one_process_run)
    assert [r["step"] for r in two] == list(range(1, STEPS + 1))
    assert [r["num_passes"] for r in two] == [r["num_passes"] for r in one]
    np.testing.assert_allclose([r["loss"] for r in two], [r["loss"] for r in one], rtol=2e-5)
    ev_two = read_jsonl(two_process_run[0], "eval.jsonl")[-1]
    ev_one = read_jsonl(one_process_run, "eval.jsonl")[-1]
    for key in ("loss_K1", "loss_K2", "loss_K3"):
        assert ev_two[key] == pytest.approx(ev_one[key], rel=2e-5)
    assert "in 2 process(es)" in two_process_run[1].stdout


@pytest.mark.slow
def test_each_process_loads_a_disjoint_slice_and_together_the_global_batch(two_process_run):
    workdir, _ = two_process_run
    infos = [json.load(open(os.path.join(workdir, "processes", f"process_{i}.json"))) for i in range(2)]
    rows = [set(info["train_rows"]) for info in infos]
    assert [info["process_count"] for info in infos] == [2, 2]
    assert rows[0] and rows[1] and not rows[0] & rows[1]
    assert rows[0] | rows[1] == set(range(32))  # tiny's global batch


@pytest.mark.slow
def test_processes_that_would_draw_different_passes_fail_instead_of_hanging(tmp_path):
    port = subprocess.run(
        [
            sys.executable,
            "-c",
            "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    procs = [
        start_command(
            [
                "fbt-train",
                *ARGS,
                f"--config.workdir={tmp_path / 'mismatch'}",
                f"--config.seed={seed}",
                f"--config.distributed.coordinator_address=127.0.0.1:{port}",
                "--config.distributed.num_processes=2",
                f"--config.distributed.process_id={i}",
            ],
            cpu_env(2),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for i, seed in enumerate((0, 1))
    ]
    outputs = [p.communicate(timeout=300) for p in procs]
    for proc, (_, err) in zip(procs, outputs):
        assert proc.returncode == 4, err[-2000:]
        assert "fbt-train: processes disagree: processes would draw different pass counts K" in err
        assert "same seed and passes.schedule" in err


def test_launchers_print_their_commands_in_dry_run_mode():
    local = run_command(
        ["launch/local.sh", "--dry-run", "3", "--config=configs/tiny.py"], check=True
    ).stdout.splitlines()
    assert len(local) == 3
    for i, line in enumerate(local):
        assert f"--config.distributed.process_id={i}" in line and "--config.distributed.num_processes=3" in line
        assert "xla_force_host_platform_device_count=2" in line and "--config=configs/tiny.py" in line
    tpu = run_command(
        ["launch/tpu_pod.sh", "--dry-run", "my-tpu", "us-east5-a", "--config=configs/fbt_1b.py"], check=True
    ).stdout
    assert "gcloud compute tpus tpu-vm ssh my-tpu --zone us-east5-a --worker=all" in tpu
    assert "fbt-train" in tpu and "configs/fbt_1b.py" in tpu
    slurm = run_command(
        ["launch/slurm_gpu.sbatch", "--config=configs/fbt_1b.py"], {**os.environ, "DRY_RUN": "1"}, check=True
    ).stdout
    assert "srun --kill-on-bad-exit=1 fbt-train --config=configs/fbt_1b.py --config.distributed.mode=always" in slurm
    bad = run_command(["launch/local.sh", "zero"])
    assert bad.returncode == 2 and "usage: launch/local.sh" in bad.stderr
