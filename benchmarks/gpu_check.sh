#!/usr/bin/env bash
# One-shot GPU check (docs/performance.md): the GPU's losses, gradients and decoding logits with every
# attention implementation against the CPU reference (exit 1 on a mismatch), then tokens/s, MFU and
# memory per K for gpu_check.py's ~344M shape (attention auto with each remat policy, and cuDNN on rows
# that are not packed) and configs/fbt_1b.py's model at the largest batch that fits, with generation
# per decoding mode. Needs this package and a CUDA build of jax in the active environment:
#     pip install -e . "jax[cuda12]"
#     bash benchmarks/gpu_check.sh [--rounds 5]          # writes its blocks into docs/performance.md
# Extra arguments go to both runs of benchmarks/gpu_check.py (see its docstring).
set -uo pipefail
cd "$(dirname "$0")/.."
python - <<'PY' || exit 1
import sys

import jax

if not any(d.platform == "gpu" for d in jax.devices()):
    sys.exit(f"gpu_check.sh: jax sees no GPU ({jax.devices()}); install a CUDA build: pip install 'jax[cuda12]'")
PY
# A hung compile or kernel must not hold the machine: each shape gets its own limit (7.3 minutes in
# all, so that the check fits twice in a 15-minute lease); each block is rewritten after every row,
# so a run stopped by its limit keeps what it measured. The 1B run goes ahead when the first reports
# a mismatch; the exit status is the first failure's.
timeout 240 python benchmarks/gpu_check.py --write-docs docs/performance.md "$@"
first=$?
timeout 200 python benchmarks/gpu_check.py --shape=1b --skip-equality --generation --write-docs docs/performance.md "$@"
second=$?
exit $((first != 0 ? first : second))
