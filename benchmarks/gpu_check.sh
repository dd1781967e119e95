#!/usr/bin/env bash
# One-shot GPU check (docs/performance.md): the GPU's losses, gradients and decoding logits with every
# attention implementation against the CPU reference (exit 1 on a mismatch), then tokens/s, MFU and
# memory per K for gpu_check.py's ~344M shape (attention auto with each remat policy, and cuDNN on rows
# that are not packed) and configs/fbt_1b.py's model at the largest batch that fits, with generation
# per decoding mode. Runs this checkout's fbt_jax (not an installed one) on the environment's jax,
# which must be a CUDA build that sees a GPU (jax 0.11.2 or newer with its CUDA 13 or 12 plugin):
#     pip install -e ".[cuda]"                           # where nothing is installed yet, or else
#     bash benchmarks/gpu_wheels.sh                      # on a machine with PyPI: the small missing
#                                                        # packages as wheels, for a GPU image that has jax
#     bash benchmarks/gpu_check.sh [--rounds 5]          # writes its blocks into docs/performance.md
# (docs/performance.md, "Running the GPU check"). Extra arguments go to both runs of
# benchmarks/gpu_check.py (see its docstring).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# One line and exit 1, before any work: no CUDA build of jax, no GPU, or a package fbt_jax needs.
python - <<'PY' || exit 1
import importlib.util
import sys

import jax

if not any(d.platform == "gpu" for d in jax.devices()):
    cuda = [name for name in ("jax_cuda13_plugin", "jax_cuda12_plugin") if importlib.util.find_spec(name)]
    sys.exit(
        f"gpu_check.sh: jax sees no GPU ({jax.devices()}); "
        + (f"{cuda[0]} is installed: is there a GPU and its driver?" if cuda else "install a CUDA build: pip install 'jax[cuda13]'")
    )
try:
    import fbt_jax.train.trainer  # noqa: F401  (what the checks import)
except ImportError as e:
    sys.exit(f"gpu_check.sh: {e.name} is missing; make wheels with bash benchmarks/gpu_wheels.sh (docs/performance.md)")
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
