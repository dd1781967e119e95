#!/usr/bin/env bash
# One-shot GPU check, about 3 minutes on one H200 (first run 2026-12-04): the GPU's losses, gradients and decoding
# logits against the CPU reference (exit 1 on a mismatch), then tokens/s, MFU and memory per K of
# a ~350M-parameter config. Needs this package and a CUDA build of jax in the active environment:
#     pip install -e . "jax[cuda12]"
#     bash benchmarks/gpu_check.sh [--rounds 5] [--write-docs docs/performance.md]
# Extra arguments go to benchmarks/gpu_check.py (see its docstring).
set -euo pipefail
cd "$(dirname "$0")/.."
python - <<'PY'
import sys

import jax

if not any(d.platform == "gpu" for d in jax.devices()):
    sys.exit(f"gpu_check.sh: jax sees no GPU ({jax.devices()}); install a CUDA build: pip install 'jax[cuda12]'")
PY
# A hung compile or kernel must not hold the machine: the whole check gets 8 minutes.
exec timeout 480 python benchmarks/gpu_check.py "$@"
