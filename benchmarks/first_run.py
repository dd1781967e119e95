"""The README's first run: `fbt-train --config=configs/tiny.py`, timed, and what it prints.

    python benchmarks/first_run.py [--smoke] [--write-docs README.md]

Runs the README's command (in a temporary workdir, so nothing in the checkout changes), prints
its wall time and summary, last one JSON line with the wall time and the held-out losses per K.
`--smoke` stops after 60 steps; `--write-docs PATH` writes the summary, as the command printed it,
into the block of PATH between the markers of this script (see docs_block.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import docs_block  # noqa: E402

COMMAND = ["fbt-train", "--config=configs/tiny.py"]


def main() -> None:
    args = docs_block.arguments(__doc__, "first_run", "60 steps: checks that it runs")
    with tempfile.TemporaryDirectory() as tmp:
        workdir = os.path.join(tmp, "tiny")
        command = [*COMMAND, f"--config.workdir={workdir}"] + (["--config.train.steps=60"] if args.smoke else [])
        start = time.perf_counter()
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if result.returncode != 0:
            sys.exit(f"first_run.py: {' '.join(COMMAND)} failed: {result.stderr.strip().splitlines()[-1]}")
        summary = json.load(open(os.path.join(workdir, "summary.json")))
    printed = result.stdout.strip().replace(workdir, "runs/tiny")
    print(printed)
    losses = {k: v for k, v in summary["eval"].items() if k.startswith("loss_")}
    figures = {"wall_seconds": wall, "train_seconds": summary["train_seconds"], "steps": summary["steps"], **losses}
    if args.write_docs:
        shown = (
            printed.split("outputs in")[0]
            + "outputs in runs/tiny: metrics.jsonl, eval.jsonl, tensorboard/, config.json"
        )
        machine = f"Machine: {os.cpu_count()} CPU cores; the whole command took {wall:.0f} s (compiles included)."
        if args.smoke:
            machine += " Smoke run (60 steps): these figures only show that the benchmark runs."
        body = f"Written by `python benchmarks/first_run.py{' --smoke' if args.smoke else ''}`. {machine}\n\n```text\n{shown}\n```"
        docs_block.write_block(args.write_docs, "first_run", body)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
