"""Resume from anything: SIGKILL at seeded random moments (one during an asynchronous save) and
resuming on another process count and mesh shape give the uninterrupted run's losses and state."""

import os
import random
import shutil
import signal
import subprocess

import numpy as np
import pytest
from conftest import (
    RESUME_ARGS,
    RESUME_STEPS,
    assert_same_state,
    cpu_env,
    losses,
    read_jsonl,
    run_command,
    start_command,
    tear_last_line,
    wait_for,
)

XDIST_SPLIT = True  # two long tests that share only session fixtures: one per worker (tests/scheduling.py)
STEPS = RESUME_STEPS
COMMAND = ["fbt-train", *RESUME_ARGS]


def logged_steps(workdir):
    path = os.path.join(workdir, "metrics.jsonl")
    return len(open(path).readlines()) if os.path.exists(path) else 0


def saving_now(workdir):
    directory = os.path.join(workdir, "checkpoints")
    return os.path.isdir(directory) and any("orbax-checkpoint-tmp" in name for name in os.listdir(directory))


@pytest.mark.slow
def test_sigkill_at_random_moments_resumes_bitwise(tmp_path, resume_reference):
    reference = resume_reference
    workdir = str(tmp_path / "killed")
    command = [*COMMAND, f"--config.workdir={workdir}"]
    rng = random.Random(20261201)
    # Kill after a random number of logged steps in each life of the run, and once as soon as an
    # asynchronous save is in flight (its temporary directory exists).
    moments = sorted(rng.sample(range(3, STEPS - 5), 3))
    moments.insert(rng.randrange(len(moments) + 1), "during-save")
    killed_at = []
    for moment in moments:
        start = logged_steps(workdir)
        proc = start_command(command, cpu_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        if moment == "during-save":
            wait_for(lambda s=start: saving_now(workdir) and logged_steps(workdir) > s, timeout=600)
        else:
            wait_for(lambda m=moment, s=start: logged_steps(workdir) >= max(m, s + 1), timeout=600)
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate()
        killed_at.append((moment, logged_steps(workdir)))
        resumed_from = [line for line in out.splitlines() if line.startswith("resuming from checkpoint")]
        assert start == 0 or resumed_from, out[-2000:]  # every later life resumed
        if len(killed_at) == 2:  # one later life resumes past a torn line (a write cut short): dropped
            assert "dropped line" in out, out[-2000:]
        if len(killed_at) == 1:
            tear_last_line(os.path.join(workdir, "metrics.jsonl"))
    final = run_command(command, cpu_env())
    assert final.returncode == 0, final.stderr[-2000:]
    assert "resuming from checkpoint" in final.stdout
    names = os.listdir(os.path.join(workdir, "checkpoints"))
    assert not [n for n in names if "damaged" in n], f"a valid checkpoint was set aside: {names}"
    expected, got = losses(reference), losses(workdir)
    assert sorted(got) == list(range(1, STEPS + 1))  # every step logged once
    assert got == expected, f"losses differ after kills at {killed_at}"  # bitwise
    ks = [r["num_passes"] for r in read_jsonl(workdir)]
    assert len(set(ks)) == 3
    assert_same_state(f"{reference}/checkpoints/{STEPS}", f"{workdir}/checkpoints/{STEPS}")
    print(f"killed at (moment, logged steps): {killed_at}")


ELASTIC = [
    "--config=configs/tiny.py",
    "--config.train.log_every=1",
    "--config.optimizer.warmup_steps=2",
    "--config.passes.schedule=0:1=0.5,2=0.5",
    "--config.checkpoint.every_steps=6",
    "--config.eval.num_batches=0",
    "--config.eval.contraction_every_steps=0",  # the monitor has tests of its own
]


def elastic_args(workdir, steps, mesh):
    data, fsdp, tensor = mesh
    return [*ELASTIC, f"--config.workdir={workdir}", f"--config.train.steps={steps}"] + [
        f"--config.mesh.data={data}",
        f"--config.mesh.fsdp={fsdp}",
        f"--config.mesh.tensor={tensor}",
    ]


def one_process(workdir, steps, mesh):
    return run_command(["fbt-train", *elastic_args(workdir, steps, mesh)], cpu_env(8), timeout=900)


def two_processes(workdir, steps, mesh):
    launch = ["launch/local.sh", "--devices-per-process", "4", "2"]
    return run_command([*launch, *elastic_args(workdir, steps, mesh)], cpu_env(4), timeout=900)


@pytest.mark.slow
def test_elastic_resume_across_process_counts_and_mesh_shapes(tmp_path):
    # The reference is the one-process run on the tensor-sharded mesh that the second case resumes
    # with two processes: its 12 steps, recorded before it is cut back to step 6. Three topologies,
    # each compiled once (the suite's compilation cache). Each resume changes both the process count
    # and the mesh, and restores onto FSDP- and tensor-sharded parameters in turn; the first case
    # also resumes on its own topology first (two processes saving and restoring together, bitwise:
    # one 6-step run more here rather than a test of its own).
    reference = str(tmp_path / "1x8-then-2x4")
    result = one_process(reference, 12, (2, 4, 1))
    assert result.returncode == 0, result.stderr[-2000:]
    expected = losses(reference)
    ks_expected = [r["num_passes"] for r in read_jsonl(reference)]
    for name, first, second in (
        ("2x4-then-1x8", lambda w: two_processes(w, 12, (2, 2, 2)), lambda w: one_process(w, 12, (8, 1, 1))),
        ("1x8-then-2x4", None, lambda w: two_processes(w, 12, (2, 2, 2))),
    ):
        workdir = str(tmp_path / name)
        if first is not None:
            result = first(workdir)
            assert result.returncode == 0, result.stdout[-1000:] + result.stderr[-2000:]
            # First the same topology: two processes that died after step 6 resume together,
            # bitwise (the losses and the step-12 state of their uninterrupted run).
            uninterrupted, final = losses(workdir), str(tmp_path / f"{name}-final-12")
            shutil.move(os.path.join(workdir, "checkpoints", "12"), final)
            result = first(workdir)
            assert result.returncode == 0, result.stdout[-1000:] + result.stderr[-2000:]
            assert "(step 6)" in result.stdout and "resume: changed mesh." not in result.stdout
            assert losses(workdir) == uninterrupted
            assert_same_state(final, os.path.join(workdir, "checkpoints", "12"))
        # As if the first job had died after its step-6 checkpoint (the same train.steps, so the same
        # learning-rate schedule), then came back on another topology.
        shutil.rmtree(os.path.join(workdir, "checkpoints", "12"))
        result = second(workdir)
        assert result.returncode == 0, result.stdout[-1000:] + result.stderr[-2000:]
        assert "resuming from checkpoint" in result.stdout and "(step 6)" in result.stdout
        assert "resume: changed mesh." in result.stdout  # the new mesh is reported, and allowed
        got = losses(workdir)
        assert sorted(got) == list(range(1, 13))
        assert [r["num_passes"] for r in read_jsonl(workdir)] == ks_expected  # the same K for every step
        # Same global batches in the same order: the losses match a one-process run to float
        # tolerance (other meshes sum in another order; bitwise equality is not expected).
        np.testing.assert_allclose([got[s] for s in range(1, 13)], [expected[s] for s in range(1, 13)], rtol=2e-5)
