"""What the 1B dry run prints: parameters, per-device bytes, and the compile time and per-device
memory of every program, on the simulated 64-device mesh (the CPU compiler) or, with
`--topology`, for a TPU slice with the TPU compiler.

    python benchmarks/dry_run_memory.py [--topology=v5e:8x8] [--seq-len=8192] [--smoke] [--write-docs docs/launch.md]

Runs `fbt-train --config=configs/fbt_1b.py --config.dry_run=True` (docs/launch.md's command; with
`--config.dry_run_topology=TOPOLOGY` for `--topology`) and prints its report, last one JSON line
with its wall time and the per-device memory per K. `--smoke` runs the tiny config's dry run on 8
simulated devices (on v5e:2x2 with `--topology`) instead; `--write-docs PATH` writes the report into
the block of PATH between the markers of this script (its `--topology=…` variant's with one).
`--seq-len=N`: the same model at a longer context (a long-context phase, docs/post-training.md),
with the batch cut to keep the tokens per step (variant `--seq-len=N`).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import docs_block  # noqa: E402


def main() -> None:
    args = docs_block.arguments(
        __doc__,
        "dry_run_memory",
        "the tiny config on 8 devices: checks that it runs",
        (
            ("--topology", {"default": "", "help": "compile for this TPU slice with the TPU compiler (libtpu)"}),
            ("--seq-len", {"type": int, "default": 0, "help": "at this context, the same tokens per step"}),
        ),
        variant=variant_of,
    )
    command = ["fbt-train", "--config=configs/fbt_1b.py", "--config.dry_run=True"]
    if args.smoke:
        command = ["fbt-train", "--config=configs/tiny.py", "--config.dry_run=True", "--config.dry_run_devices=8"]
    if args.topology:  # the TPU compiler for that slice, in place of simulated CPU devices
        command = [*command[:3], f"--config.dry_run_topology={'v5e:2x2' if args.smoke else args.topology}"]
    if args.seq_len:  # the batch shrinks with the longer rows: the same tokens per step (at least one row per device)
        seq_len, batch = (128, 16) if args.smoke else (args.seq_len, max(64, 512 * 2048 // args.seq_len))
        command += [
            f"--config.data.seq_len={seq_len}",
            f"--config.train.batch_size={batch}",
            f"--config.eval.batch_size={batch}",
        ]
    start = time.perf_counter()
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        sys.exit(f"dry_run_memory.py: {' '.join(command)} failed: {result.stderr.strip().splitlines()[-1]}")
    report = result.stdout.strip().replace(ROOT + os.sep, "")  # paths as the docs' reader has them
    print(report)
    memory = {
        f"device_mib_K{k}": float(mib.replace(",", ""))
        for k, mib in re.findall(r"train step K=(\d+): compiled in [\d.]+s, per-device memory ([\d,.]+) MiB", report)
    }
    if args.write_docs:
        machine = f"Machine: {os.cpu_count()} CPU cores; the dry run took {wall:.0f} s."
        if args.smoke:
            machine += " Smoke run (tiny config): these figures only show that the benchmark runs."
        variant = variant_of(args)
        script = " ".join(["python benchmarks/dry_run_memory.py", variant, "--smoke" if args.smoke else ""]).split()
        body = f"Written by `{' '.join(script)}` (`{' '.join(command)}`). {machine}\n\n```text\n{report}\n```"
        docs_block.write_block(args.write_docs, "dry_run_memory", body, variant=variant)
    print(json.dumps({"wall_seconds": wall, **memory}))


def variant_of(args: Any) -> str:
    """The docs block's variant: '--topology=… --seq-len=…', each where given ('' for neither)."""
    return " ".join(
        ([f"--topology={args.topology}"] if args.topology else [])
        + ([f"--seq-len={args.seq_len}"] if args.seq_len else [])
    )


if __name__ == "__main__":
    main()
