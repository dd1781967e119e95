"""What sharing trunks saves: the tiny example sweep with trunk sharing vs every run from scratch.

    python benchmarks/sweep_cost.py [--smoke] [--write-docs docs/sweeps.md]

Runs `fbt-sweep run configs/sweeps/tiny_mixtures.py` twice in temporary directories, once as
planned (shared trunks) and once with `--min-shared-steps` above the run length (no trunk: each
run from step 0), one after the other, and times both; then `fbt-sweep report` on the shared one.
Prints the steps each trains, both wall times, and last the ratio shared / from scratch, with the
ideal ratio from the steps alone (≈ (0.75 + 0.25·N)/N for N runs that share 75% of their steps).
`--smoke` sweeps two mixtures for 24 steps. `--write-docs PATH` writes the sweep's results table
and the timing into the block of PATH between this script's markers.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import docs_block  # noqa: E402

SPEC = os.path.join(ROOT, "configs", "sweeps", "tiny_mixtures.py")
SMOKE_SPEC = """
def get_sweep():
    return {{
        "base": {base!r},
        "overrides": {{"train.steps": 24, "train.log_every": 8, "train.batch_size": 8, "checkpoint.every_steps": 8,
                      "eval.num_batches": 1, "eval.batch_size": 8, "optimizer.warmup_steps": 2}},
        "grid": {{"passes.schedule": {{"k1": "0:1", "paper": "0:1; 0.75:2=0.88,3=0.12"}}}},
        "seeds": [0],
    }}
"""


def sweep(*args: str) -> tuple[float, subprocess.CompletedProcess]:
    command = [sys.executable, "-m", "fbt_jax.sweep.cli", *args]
    start = time.perf_counter()
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(
            f"sweep_cost.py: fbt-sweep {' '.join(args)} failed: {(result.stderr or result.stdout).strip().splitlines()[-1]}"
        )
    return time.perf_counter() - start, result


def steps_trained(directory: str) -> tuple[int, int]:
    with open(os.path.join(directory, "sweep.json"), encoding="utf-8") as f:
        jobs = json.load(f)["jobs"]
    return sum(j["end"] - j["start"] for j in jobs), len(jobs)


def main() -> None:
    args = docs_block.arguments(__doc__, "sweep_cost", "two mixtures, 24 steps: checks that it runs")
    with tempfile.TemporaryDirectory() as tmp:
        spec = SPEC
        if args.smoke:
            spec = os.path.join(tmp, "smoke.py")
            with open(spec, "w", encoding="utf-8") as f:
                f.write(SMOKE_SPEC.format(base=os.path.join(ROOT, "configs", "tiny.py")))
        shared_dir, scratch_dir = os.path.join(tmp, "shared"), os.path.join(tmp, "scratch")
        shared_seconds, _ = sweep("run", spec, f"--dir={shared_dir}")
        scratch_seconds, _ = sweep("run", spec, f"--dir={scratch_dir}", "--min-shared-steps=1000000000")
        _, report = sweep("report", f"--dir={shared_dir}")
        table = open(os.path.join(shared_dir, "results.md"), encoding="utf-8").read()
        shared_steps, shared_jobs = steps_trained(shared_dir)
        scratch_steps, scratch_jobs = steps_trained(scratch_dir)
        shutil.rmtree(tmp, ignore_errors=True)
    ratio, ideal = shared_seconds / scratch_seconds, shared_steps / scratch_steps
    print(table.rstrip())
    print(f"shared trunks: {shared_jobs} jobs, {shared_steps} steps, {shared_seconds:.1f} s")
    print(f"from scratch:  {scratch_jobs} jobs, {scratch_steps} steps, {scratch_seconds:.1f} s")
    print(f"ideal (steps) {ideal:.3f}; wall time shared / from scratch {ratio:.3f}")
    if args.write_docs:
        note = " Smoke run: these figures only show that the benchmark runs." if args.smoke else ""
        body = (
            table.rstrip()
            + "\n\n"
            + f"Written by `python benchmarks/sweep_cost.py{' --smoke' if args.smoke else ''}`. Machine: {os.cpu_count()} "
            f"CPU cores; the two sweeps ran one after the other.{note}\n\n"
            "| sweep | jobs | steps trained | wall time |\n|---|---|---|---|\n"
            f"| shared trunks | {shared_jobs} | {shared_steps:,} | {shared_seconds:.0f} s |\n"
            f"| every run from scratch | {scratch_jobs} | {scratch_steps:,} | {scratch_seconds:.0f} s |\n\n"
            f"Shared / from scratch: **{ratio:.2f}** of the wall time, {ideal:.2f} of the steps."
        )
        docs_block.write_block(args.write_docs, "sweep_cost", body)
    print(
        json.dumps(
            {"shared_seconds": shared_seconds, "scratch_seconds": scratch_seconds, "ideal": ideal, "ratio": ratio}
        )
    )


if __name__ == "__main__":
    main()
