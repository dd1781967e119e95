"""What a restart costs: cold vs warm start-up with the persistent compilation cache, the goodput of
a run preempted twice, and checkpoint saves to an emulated bucket vs the local disk.

    python benchmarks/restart_cost.py [--rounds 2] [--smoke] [--write-docs PATH]

1. For `tiny` and a cpu_medium-sized model (D=256, L=4, 8 × 128 tokens) and K = 1, 2, 3 (a
   schedule of that K alone), `fbt-train` is started twice per round in new workdirs sharing one
   cache directory: the first run compiles (cold: the directory is new), the second loads (warm).
   Each run's own time record (goodput.jsonl) gives its compile seconds and its time to the first
   step (start-up + compile + restore, from the process's start); the ratios warm / cold are of
   medians over the rounds.
2. A tiny run of 300 steps (checkpoints every 50) SIGTERMed at two seeded moments and started again
   each time: its goodput (productive step seconds / wall seconds over the three attempts) and
   where the rest went.
3. The same tiny run of 120 steps saving every 10 steps to the local disk and to a bucket in the
   Cloud Storage emulator (tests/storage_emulator.py): wall seconds per step (steps, data and
   checkpoint blocking) and the bucket / disk ratio.

`--smoke`: tiny at K = 1 only, one round, a 24-step run preempted once, 10-step save runs (these
two at K = 1 only, from the warm cache).
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import docs_block  # noqa: E402
from storage_emulator import emulated_bucket  # noqa: E402

TINY = ["--config=configs/tiny.py", "--config.eval.num_batches=0", "--config.eval.contraction_passes=0"]
# cpu_medium (benchmarks/bench_configs.py) as flags on tiny
MEDIUM = [
    *TINY,
    "--config.data.seq_len=128",
    "--config.train.batch_size=8",
    "--config.model.embed_dim=256",
    "--config.model.num_layers=4",
    "--config.model.num_heads=8",
    "--config.model.num_kv_heads=4",
    "--config.model.mlp_dim=1024",
]
FULL = {"models": {"tiny": TINY, "cpu_medium": MEDIUM}, "ks": (1, 2, 3), "preempted_steps": 300, "preemptions": 2,
        "save_steps": 120}  # fmt: skip
# Smoke: the preempted and saving runs train K=1 only from the cache the K=1 start-up filled (warm).
# One preemption takes the whole path (SIGTERM, exit 75, restore); a second is one more process.
SMOKE = {"models": {"tiny": TINY}, "ks": (1,), "preempted_steps": 24, "preemptions": 1, "save_steps": 10,
         "smoke": True}  # fmt: skip


def environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_COMPILATION_CACHE_DIR", "XLA_FLAGS")}
    return {**env, "JAX_PLATFORMS": "cpu", **extra}


def train(args: list[str], env: dict[str, str]) -> dict:
    """Run fbt-train to its end; the time record of its (last) attempt."""
    result = subprocess.run(
        [sys.executable, "-m", "fbt_jax.train", *args], cwd=ROOT, env=env, capture_output=True, text=True
    )
    if result.returncode != 0:
        sys.exit(f"restart_cost.py: fbt-train failed: {result.stderr.strip().splitlines()[-1]}")
    workdir = next(a.split("=", 1)[1] for a in args if a.startswith("--config.workdir="))
    return ledger(workdir)[-1]


def ledger(workdir: str) -> list[dict]:
    with open(os.path.join(workdir, "goodput.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def to_first_step(attempt: dict) -> float:
    return sum(attempt["seconds"][c] for c in ("startup", "compile", "restore"))


def cold_and_warm(tmp: str, model: list[str], k: int, rounds: int) -> dict[str, float]:
    runs: dict[str, list[dict]] = {"cold": [], "warm": []}
    for r in range(rounds):
        cache = os.path.join(tmp, f"cache-{k}-{r}")
        for kind in ("cold", "warm"):
            workdir = os.path.join(tmp, f"run-{kind}-{time.monotonic_ns()}")
            args = [*model, "--config.train.steps=2", "--config.optimizer.warmup_steps=1",
                    f"--config.passes.schedule=0:{k}", "--config.checkpoint.every_steps=0",
                    f"--config.train.compilation_cache_dir={cache}", f"--config.workdir={workdir}"]  # fmt: skip
            runs[kind].append(train(args, environment()))
    out = {}
    for kind, attempts in runs.items():
        out[f"{kind}_compile_seconds"] = statistics.median(a["seconds"]["compile"] for a in attempts)
        out[f"{kind}_first_step_seconds"] = statistics.median(to_first_step(a) for a in attempts)
    out["compile_ratio"] = out["warm_compile_seconds"] / out["cold_compile_seconds"]
    out["first_step_ratio"] = out["warm_first_step_seconds"] / out["cold_first_step_seconds"]
    return out


def preempted_run(tmp: str, steps: int, preemptions: int, extra: list[str]) -> dict:
    """A tiny run SIGTERMed at `preemptions` seeded moments (logged steps) and restarted each time."""
    workdir = os.path.join(tmp, "preempted")
    args = [*TINY, f"--config.train.steps={steps}", "--config.optimizer.warmup_steps=5", "--config.train.log_every=1",
            f"--config.checkpoint.every_steps={steps // 6}", f"--config.workdir={workdir}", *extra]  # fmt: skip
    moments = sorted(random.Random(21).sample(range(steps // 6, steps - steps // 6), preemptions))
    metrics = os.path.join(workdir, "metrics.jsonl")
    for moment in moments:
        proc = subprocess.Popen([sys.executable, "-m", "fbt_jax.train", *args], cwd=ROOT, env=environment(),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        while not (os.path.exists(metrics) and sum(1 for _ in open(metrics)) >= moment):
            if proc.poll() is not None:
                sys.exit("restart_cost.py: the run ended before it could be preempted")
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        if proc.wait() != 75:
            sys.exit(f"restart_cost.py: a preempted run exited {proc.returncode}, not 75")
    train(args, environment())
    with open(os.path.join(workdir, "summary.json"), encoding="utf-8") as f:
        return {"moments": moments, **json.load(f)["goodput"]}


def save_cost(tmp: str, steps: int, extra: list[str]) -> dict[str, float]:
    """Seconds per step of the same run saving every 10 steps (every 5 in smoke) to disk and to a bucket."""
    every = 10 if steps >= 100 else 5
    out = {}
    with emulated_bucket("fbt-bench") as bucket_env:
        for where, directory in (("disk", os.path.join(tmp, "saves")), ("bucket", "gs://fbt-bench/saves")):
            workdir = os.path.join(tmp, f"save-{where}")
            args = [*TINY, f"--config.train.steps={steps}", "--config.optimizer.warmup_steps=1",
                    f"--config.checkpoint.every_steps={every}", f"--config.checkpoint.dir={directory}",
                    f"--config.workdir={workdir}", *extra]  # fmt: skip
            attempt = train(args, environment(**bucket_env))
            loop = sum(attempt["seconds"][c] for c in ("data_wait", "steps", "checkpoint"))
            out[f"{where}_seconds_per_step"] = loop / steps
            out[f"{where}_blocking_seconds_per_save"] = attempt["seconds"]["checkpoint"] / (steps // every)
    out["bucket_over_disk"] = out["bucket_seconds_per_step"] / out["disk_seconds_per_step"]
    return out


def main() -> None:
    args = docs_block.arguments(
        __doc__, "restart_cost", "tiny, K=1, one round: checks that it runs",
        extra=[("--rounds", dict(type=int, default=2))],
    )  # fmt: skip
    plan = SMOKE if args.smoke else FULL
    rounds = 1 if args.smoke else args.rounds
    with tempfile.TemporaryDirectory() as tmp:
        starts = {f"{name}_K{k}": cold_and_warm(tmp, model, k, rounds) for name, model in plan["models"].items()
                  for k in plan["ks"]}  # fmt: skip
        warm = ["--config.passes.schedule=0:1", f"--config.train.compilation_cache_dir={tmp}/cache-1-0"]
        extra = warm if plan.get("smoke") else []
        preempted = preempted_run(tmp, plan["preempted_steps"], plan["preemptions"], extra)
        saves = save_cost(tmp, plan["save_steps"], extra)
    rows = [
        [name, f"{r['cold_compile_seconds']:.2f}", f"{r['warm_compile_seconds']:.2f}", f"{r['compile_ratio']:.3f}",
         f"{r['cold_first_step_seconds']:.2f}", f"{r['warm_first_step_seconds']:.2f}", f"{r['first_step_ratio']:.3f}"]
        for name, r in starts.items()
    ]  # fmt: skip
    start_table = docs_block.table(
        ["config", "compile cold s", "compile warm s", "warm/cold", "first step cold s", "first step warm s",
         "warm/cold"], rows,
    )  # fmt: skip
    seconds = preempted["seconds"]
    goodput_table = docs_block.table(
        ["attempts", "wall s", "goodput", *[f"{c} s" for c in seconds]],
        [[preempted["attempts"], f"{preempted['wall_seconds']:.1f}", f"{100 * preempted['goodput']:.1f}%",
          *[f"{v:.2f}" for v in seconds.values()]]],
    )  # fmt: skip
    save_table = docs_block.table(
        ["checkpoints to", "s per step", "blocking s per save"],
        [[where, f"{saves[f'{where}_seconds_per_step']:.4f}", f"{saves[f'{where}_blocking_seconds_per_save']:.4f}"]
         for where in ("disk", "bucket")],
    )  # fmt: skip
    print(start_table, goodput_table, save_table, sep="\n\n")
    notes = [
        f"Preempted (SIGTERM) after logged steps {preempted['moments']} of {plan['preempted_steps']}; the "
        "restarts load their programs from the run's compilation cache.",
        f"Bucket / disk, seconds per step: {saves['bucket_over_disk']:.3f} (the emulator is one local Python "
        "process: this shows the client path, not Cloud Storage's speed).",
    ]
    if args.write_docs:
        import jax

        machine = docs_block.machine_line(jax.devices(), smoke=args.smoke)
        body = docs_block.block("restart_cost", docs_block.run_arguments(sys.argv[1:]), machine,
                                [start_table, goodput_table, save_table], notes)  # fmt: skip
        docs_block.write_block(args.write_docs, "restart_cost", body)
    print(json.dumps({"start_up": starts, "goodput": preempted["goodput"], "saves": saves}))


if __name__ == "__main__":
    main()
