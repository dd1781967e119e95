#!/usr/bin/env bash
# Wheels for running benchmarks/gpu_check.sh on a GPU machine that already has JAX (jax/jaxlib 0.11.2
# or newer with its CUDA plugin, flax, optax, orbax-checkpoint, numpy) but no fbt-jax, and no PyPI:
# only the small pure-Python or manylinux packages fbt-jax needs beyond such an image, never jax,
# jaxlib, a CUDA library or anything that would replace them. Run it where pip reaches PyPI, in this
# checkout; it writes .whl/ (git ignores it), which travels with the checkout:
#     bash benchmarks/gpu_wheels.sh [PYTHON_VERSION]      # default 3.12, the GPU image's Python
# then, on the GPU machine, in the checkout (docs/performance.md, "Running the GPU check"):
#     python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
#     bash benchmarks/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python_version=${1:-3.12}
# What a lent H100/H200 image (docs/platform-notes.md) lacks of pyproject.toml's dependencies, at
# versions the pins allow; the image's own jax stack and everything else stay as they are.
packages=(
  "grain>=0.2.18,<0.3" "array-record>=0.8" "ml-collections>=1.1,<2" "tensorboardX>=2.6" "zstandard>=0.22"
  "portpicker"
)
rm -rf .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$python_version" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d .whl "${packages[@]}"
du -sh .whl | sed 's/\t.*//' | xargs -I{} echo "gpu_wheels.sh: wrote .whl/ ({}): $(cd .whl && ls | tr '\n' ' ')"
