"""Runs that keep their files in a bucket, against a local Cloud Storage emulator (started and
stopped here, tests/storage_emulator.py): the properties the local tests check, through the clients
a pod uses (tensorstore for checkpoints, gcsfs for the rest).

- a gs:// workdir trains, is SIGKILLed during an asynchronous save, and is resumed on "another host"
  (an empty local mirror): the same losses and final state as an uninterrupted local run, each
  step logged once, the logs downloaded from the bucket;
- the same run is read from the bucket by fbt-eval, fbt-decode (the same tokens as from the local
  run), `init_from`, `fork_from` (what a sweep's runs do) and fbt-export (to the bucket too);
- a run with only checkpoint.dir in the bucket: a damaged newest checkpoint falls back, and only
  on evidence (the bucket out of reach is an error that moves nothing);
- data prepared into the bucket is what a local preparation writes, and a run reads it;
- the compilation cache in the bucket makes a restart load its programs.
"""

import json
import os
import signal
import subprocess
import urllib.parse
import urllib.request

import numpy as np
import pytest
from conftest import (
    RESUME_ARGS,
    RESUME_EVERY,
    RESUME_STEPS,
    assert_same_state,
    cpu_env,
    run_command,
    start_command,
    wait_for,
)
from storage_emulator import emulated_bucket, free_port

BUCKET = "fbt-test"
STEPS, EVERY = RESUME_STEPS, RESUME_EVERY
COMMAND = ["fbt-train", *RESUME_ARGS]


@pytest.fixture(scope="module")
def bucket():
    """The emulator's client variables, also set in this process (orbax and gcsfs read them)."""
    with emulated_bucket(BUCKET) as env, pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        yield env


def api(env, path: str, data: bytes | None = None) -> bytes:
    request = urllib.request.Request(env["STORAGE_EMULATOR_HOST"] + path, data=data, method="POST" if data else "GET")
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.read()


def objects(env, prefix: str) -> list[str]:
    """Every object name under `prefix`, listed by the JSON API (no client cache in between)."""
    names, token = [], ""
    while True:
        query = urllib.parse.urlencode({"prefix": prefix, **({"pageToken": token} if token else {})})
        page = json.loads(api(env, f"/storage/v1/b/{BUCKET}/o?{query}"))
        names += [item["name"] for item in page.get("items", [])]
        token = page.get("nextPageToken", "")
        if not token:
            return names


def read_object(env, name: str) -> bytes:
    return api(env, f"/download/storage/v1/b/{BUCKET}/o/{urllib.parse.quote(name, safe='')}?alt=media")


def write_object(env, name: str, data: bytes) -> None:
    api(env, f"/upload/storage/v1/b/{BUCKET}/o?uploadType=media&name={urllib.parse.quote(name, safe='')}", data)


def bucket_losses(env, run: str) -> dict[int, float]:
    lines = read_object(env, f"{run}/metrics.jsonl").decode().splitlines()
    steps = [json.loads(line)["step"] for line in lines]
    assert len(steps) == len(set(steps)), "a step was logged twice"
    return {json.loads(line)["step"]: json.loads(line)["loss"] for line in lines}


def host(env, tmp_path, name: str, **extra: str) -> dict[str, str]:
    """A command's environment on host `name`: its own local mirror of gs:// workdirs."""
    return cpu_env(1, **env, FBT_JAX_CACHE=str(tmp_path / name), **extra)


def saves_in_flight(env, prefix: str) -> list[str]:
    """Checkpoint steps under `prefix` that have objects but no commit marker yet."""
    names = [n[len(prefix) :] for n in objects(env, prefix)]
    started = {n.split("/")[0] for n in names if "/" in n}
    committed = {n.split("/")[0] for n in names if n.endswith("/commit_success.txt")}
    return sorted(started - committed)


@pytest.fixture(scope="module")
def killed_run(bucket, tmp_path_factory, resume_reference):
    """A gs:// run SIGKILLed while an asynchronous save is in flight, then resumed on another host,
    and the same run uninterrupted in a local workdir."""
    base = tmp_path_factory.mktemp("bucket")
    reference = resume_reference
    run = "runs/killed"
    command = [*COMMAND, f"--config.workdir=gs://{BUCKET}/{run}"]
    proc = start_command(command, host(bucket, base, "host-a"), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    in_flight: list[str] = []
    # A save after the first, so that a committed checkpoint exists to fall back to.
    later = lambda: [s for s in saves_in_flight(bucket, f"{run}/checkpoints/") if s.isdigit() and int(s) > EVERY]  # noqa: E731
    wait_for(lambda: bool(in_flight.extend(later()) or in_flight), 600)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    left = objects(bucket, f"{run}/checkpoints/")
    resumed = run_command(command, host(bucket, base, "host-b"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return {"reference": reference, "run": run, "in_flight": in_flight, "left": left, "resumed": resumed, "base": base}


@pytest.mark.slow
def test_bucket_run_killed_during_an_async_save_resumes_on_another_host_bitwise(bucket, killed_run):
    run, reference = killed_run["run"], killed_run["reference"]
    step = killed_run["in_flight"][0]
    # The kill came while checkpoint `step` was being written: it had objects and no commit marker.
    assert any(n.startswith(f"{run}/checkpoints/{step}/") for n in killed_run["left"])
    assert f"{run}/checkpoints/{step}/commit_success.txt" not in killed_run["left"]
    out = killed_run["resumed"].stdout
    assert f"resuming from checkpoint gs://{BUCKET}/{run}/checkpoints/" in out
    resumed_step = int(out.split(f"gs://{BUCKET}/{run}/checkpoints/")[1].split(" ")[0])
    assert resumed_step < int(step)  # the half-written checkpoint was not taken for a saved one
    expected, got = {}, bucket_losses(bucket, run)
    with open(os.path.join(reference, "metrics.jsonl")) as f:
        expected = {r["step"]: r["loss"] for r in map(json.loads, f)}
    assert sorted(got) == list(range(1, STEPS + 1))  # host B downloaded host A's logs and continued them
    assert got == expected  # bitwise
    assert_same_state(f"{reference}/checkpoints/{STEPS}", f"gs://{BUCKET}/{run}/checkpoints/{STEPS}")
    ledger = [json.loads(line) for line in read_object(bucket, f"{run}/goodput.jsonl").decode().splitlines()]
    assert [a["attempt"] for a in ledger] == [1, 2] and ledger[1]["start_step"] == resumed_step
    # How far the killed attempt ran is known from the bucket only up to its last sync of the logs.
    assert ledger[0]["end_step"] >= resumed_step and ledger[1]["end_step"] == STEPS
    summary = json.loads(read_object(bucket, f"{run}/summary.json"))
    assert summary["goodput"]["attempts"] == 2 and 0 < summary["goodput"]["goodput"] < 1


@pytest.mark.slow
def test_bucket_run_is_read_by_eval_decode_init_from_fork_from_and_export(bucket, killed_run, tmp_path):
    url, reference = f"gs://{BUCKET}/{killed_run['run']}", killed_run["reference"]
    env = host(bucket, tmp_path, "host-c")
    decoded = run_command(["fbt-decode", f"--checkpoint={url}", "--mode=soft", "--prompt=1 2 3"], env)
    assert decoded.returncode == 0 and json.loads(decoded.stdout.splitlines()[-1])["tokens"], decoded.stderr[-2000:]
    result = run_command(["fbt-eval", f"--checkpoint={url}", f"--output={tmp_path / 'eval'}", "--max-depth=2"], env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"loaded {url}/checkpoints/{STEPS}" in result.stdout
    started = run_command(
        [
            *COMMAND[:2],
            "--config.train.steps=2",
            "--config.eval.num_batches=0",
            "--config.optimizer.warmup_steps=1",
            f"--config.init_from={url}",
            f"--config.workdir={tmp_path / 'from'}",
        ],
        env,
    )
    assert started.returncode == 0 and url in started.stdout, started.stderr[-2000:]
    # A sweep's run continues its trunk (here one that ran to its end: the fork saves its own copy).
    forked = run_command([*COMMAND, f"--config.fork_from={url}", f"--config.workdir=gs://{BUCKET}/runs/fork"], env)
    assert forked.returncode == 0, forked.stderr[-2000:]
    assert f"runs/fork/checkpoints/{STEPS}/commit_success.txt" in objects(bucket, "runs/fork/checkpoints/")
    exported = run_command(["fbt-export", url, f"gs://{BUCKET}/exports/killed"], env)
    assert exported.returncode == 0, exported.stderr[-2000:]
    local = run_command(["fbt-export", reference, str(tmp_path / "export")], env)
    assert local.returncode == 0, local.stderr[-2000:]
    names = sorted(os.listdir(tmp_path / "export"))
    assert sorted(n.split("/")[-1] for n in objects(bucket, "exports/killed/")) == names
    for name in names:  # the bucket's export is the local run's, byte for byte
        assert read_object(bucket, f"exports/killed/{name}") == (tmp_path / "export" / name).read_bytes(), name


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_bucket_checkpoint_dir_damaged_newest_falls_back_only_on_evidence(bucket, tmp_path):
    prefix = "runs/damaged/checkpoints"
    argv = [
        *COMMAND[:2],
        "--config.train.steps=6",
        "--config.checkpoint.every_steps=2",
        "--config.eval.num_batches=0",
        "--config.optimizer.warmup_steps=1",
        "--config.train.log_every=1",
        f"--config.workdir={tmp_path / 'run'}",
        f"--config.checkpoint.dir=gs://{BUCKET}/{prefix}",
    ]
    env = host(bucket, tmp_path, "host")
    assert run_command(argv, env).returncode == 0
    manifest = next(n for n in objects(bucket, f"{prefix}/6/") if n.endswith("manifest.ocdbt"))
    before = {n: read_object(bucket, n) for n in objects(bucket, prefix)}
    # The bucket out of reach is no evidence of damage: one line, and nothing moved or rewritten.
    away = run_command(
        [*argv, "--config.train.steps=8"], {**env, "STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{free_port()}"}
    )
    assert away.returncode == 2 and "cannot reach the storage emulator" in away.stderr.splitlines()[-1]
    assert {n: read_object(bucket, n) for n in objects(bucket, prefix)} == before
    write_object(bucket, manifest, before[manifest][:10])  # a torn write of the newest checkpoint
    resumed = run_command([*argv, "--config.train.steps=8"], env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from checkpoint gs://{BUCKET}/{prefix}/4 (step 4)" in resumed.stdout
    steps = {n[len(prefix) + 1 :].split("/")[0] for n in objects(bucket, prefix)}
    assert any(s.startswith("6.damaged-") for s in steps) and {"6", "8"} <= steps, steps  # kept aside


@pytest.mark.slow
def test_bucket_prepared_data_equals_a_local_preparation_and_trains(bucket, prepared, tmp_path):
    corpus, local, _ = prepared
    env = host(bucket, tmp_path, "host")
    result = run_command(
        [
            "fbt-prepare",
            f"--input={corpus}/*",
            f"--output=gs://{BUCKET}/prepared/records",
            "--seq-len=32",
            "--validation-fraction=0.2",
        ],
        env,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    names = sorted(n[len("prepared/records/") :] for n in objects(bucket, "prepared/records/"))
    local_names = sorted(os.path.relpath(os.path.join(r, f), local) for r, _, fs in os.walk(local) for f in fs)
    assert names == local_names
    for name in names:
        if name.endswith(".json"):  # the metadata names where it was written; the records are equal
            continue
        assert read_object(bucket, f"prepared/records/{name}") == open(os.path.join(local, name), "rb").read(), name
    trained = run_command(
        [
            *COMMAND[:2],
            "--config.train.steps=3",
            "--config.optimizer.warmup_steps=1",
            "--config.eval.num_batches=0",
            "--config.data.source=text",
            f"--config.data.path=gs://{BUCKET}/prepared/records",
            "--config.model.vocab_size=257",
            "--config.data.seq_len=32",
            f"--config.workdir={tmp_path / 'run'}",
        ],
        env,
    )
    assert trained.returncode == 0, trained.stderr[-2000:]


@pytest.mark.slow
def test_bucket_compilation_cache_makes_a_restart_load_its_programs(bucket, tmp_path):
    cache = f"gs://{BUCKET}/compilation-cache"
    argv = [
        *COMMAND[:2],
        "--config.train.steps=2",
        "--config.optimizer.warmup_steps=1",
        "--config.eval.num_batches=0",
        "--config.eval.contraction_passes=0",
        "--config.passes.schedule=0:1",
        "--config.checkpoint.every_steps=0",
        f"--config.train.compilation_cache_dir={cache}",
    ]
    env = host(bucket, tmp_path, "host")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # the suite's shared cache would answer first
    cold = run_command([*argv, f"--config.workdir={tmp_path / 'cold'}"], env)
    warm = run_command([*argv, f"--config.workdir={tmp_path / 'warm'}"], env)
    assert cold.returncode == 0 and warm.returncode == 0, cold.stderr[-2000:] + warm.stderr[-2000:]
    line = "compiled train step K=1: compiled in"
    assert (
        line in cold.stdout and "(loaded from the compilation cache)" not in cold.stdout.split(line)[1].split("\n")[0]
    )
    assert "(loaded from the compilation cache)" in warm.stdout.split(line)[1].split("\n")[0]
    assert any("train_step" in n for n in objects(bucket, "compilation-cache/"))
    losses = [[json.loads(r)["loss"] for r in open(tmp_path / w / "metrics.jsonl")] for w in ("cold", "warm")]
    assert losses[0] == losses[1] and np.all(np.isfinite(losses[0]))
