"""What the 1B dry run prints: parameters, per-device bytes, and the compile time and per-device
memory of every pass count K on the simulated 64-device mesh.

    python benchmarks/dry_run_memory.py [--smoke] [--write-docs docs/launch.md]

Runs `fbt-train --config=configs/fbt_1b.py --config.dry_run=True` (docs/launch.md's command) and
prints its report, last one JSON line with its wall time and the per-device memory per K.
`--smoke` runs the tiny config's dry run on 8 simulated devices instead; `--write-docs PATH`
writes the report into the block of PATH between the markers of this script.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import docs_block  # noqa: E402


def main() -> None:
    args = docs_block.arguments(__doc__, "dry_run_memory", "the tiny config on 8 devices: checks that it runs")
    command = ["fbt-train", "--config=configs/fbt_1b.py", "--config.dry_run=True"]
    if args.smoke:
        command = ["fbt-train", "--config=configs/tiny.py", "--config.dry_run=True", "--config.dry_run_devices=8"]
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
        body = f"Written by `python benchmarks/dry_run_memory.py{' --smoke' if args.smoke else ''}` (`{' '.join(command)}`). {machine}\n\n```text\n{report}\n```"
        docs_block.write_block(args.write_docs, "dry_run_memory", body)
    print(json.dumps({"wall_seconds": wall, **memory}))


if __name__ == "__main__":
    main()
