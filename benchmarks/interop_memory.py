"""What importing and exporting a Hugging Face checkpoint costs in host memory and time.

Writes a random Llama-shaped Hugging Face directory (about 100 M parameters in fp32, sharded into
files of 100 MB, as transformers shards), then runs `fbt-import` and `fbt-export` on it, each as its
command line in a fresh process, and reports each one's peak resident memory above what the
process held before starting (the interpreter, jax with its backend and compiler, orbax: measured
in the same process just before the work), as a
ratio to the checkpoint's size. Streaming tensor by tensor keeps that ratio near 1: the model is
held once (as the parameters being written) plus one tensor or one output file.

    python benchmarks/interop_memory.py [--smoke] [--write-docs PATH]

`--smoke` runs the same code on a ~1 M-parameter model (seconds). Prints a table and, last, one
JSON line with every figure; `--write-docs PATH` rewrites the `benchmarks/interop_memory.py`
block of PATH (docs/interop.md).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import docs_block  # noqa: E402

FULL = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
            intermediate_size=2048, vocab_size=32000)  # fmt: skip
SMOKE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, vocab_size=1000)  # fmt: skip

# Run in a fresh process: RSS before the work (after every import), the work, then the peak.
CHILD = """
import json, resource, sys, time
import jax, jax.numpy as jnp
from fbt_jax.interop import exporter, importer
from fbt_jax.trained import load_model  # noqa: F401 (imported before the baseline, as the work needs it)
def rss_bytes():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
jax.jit(lambda x: x + 1)(jnp.ones(4)).block_until_ready()  # the backend and compiler loaded
before = rss_bytes()
start = time.perf_counter()
what, src, out = sys.argv[1:4]
if what == "import":
    importer.main([src, out])
else:
    exporter.main([src, out, "--max-shard-size=100MB"])
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"before": before, "peak": peak, "seconds": seconds}))
"""


def write_random_llama(directory: str, shape: dict, seed: int = 0) -> int:
    """A random Llama directory in fp32, written tensor by tensor; returns the weights' bytes."""
    from fbt_jax.interop import hf_config, hf_files, tensors

    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "tie_word_embeddings": True,
              "rms_norm_eps": 1e-5, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
              "max_position_embeddings": 2048, **shape}  # fmt: skip
    cfg = hf_config.model_config_from_hf(config, directory)
    os.makedirs(directory)
    hf_files.write_json(os.path.join(directory, "config.json"), config)
    rng = np.random.default_rng(seed)
    shapes = tensors.hf_shapes(cfg)

    def tensor(name: str) -> np.ndarray:
        return rng.standard_normal(shapes[name], dtype=np.float32) / math.sqrt(shapes[name][-1])

    hf_files.write_weights(directory, shapes, "float32", tensor, max_shard_bytes=100 * 10**6)
    return sum(math.prod(s) for s in shapes.values()) * 4


def measure(what: str, src: str, out: str) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    result = subprocess.run([sys.executable, "-c", CHILD, what, src, out], capture_output=True, text=True, env=env)
    if result.returncode:
        sys.exit(f"interop_memory.py: {what} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    args = docs_block.arguments(__doc__, "interop_memory", "a ~1 M-parameter model: checks that it runs")
    shape = SMOKE if args.smoke else FULL
    with tempfile.TemporaryDirectory(prefix="fbt-interop-memory-") as tmp:
        src, run, out = (os.path.join(tmp, name) for name in ("hf", "run", "exported"))
        size = write_random_llama(src, shape)
        figures = {"checkpoint_bytes": size, "parameters": size // 4}
        for what, a, b in (("import", src, run), ("export", run, out)):
            m = measure(what, a, b)
            figures[what] = {"peak_above_start_bytes": m["peak"] - m["before"], "start_bytes": m["before"],
                             "ratio": (m["peak"] - m["before"]) / size, "seconds": m["seconds"]}  # fmt: skip
    mib = 2**20
    rows = [
        [what, f"{figures[what]['start_bytes'] / mib:,.0f}", f"{figures[what]['peak_above_start_bytes'] / mib:,.0f}",
         f"{figures[what]['ratio']:.2f}", f"{figures[what]['seconds']:.1f}"]
        for what in ("import", "export")
    ]  # fmt: skip
    header = ["command", "RSS at start (MiB)", "peak above start (MiB)", "÷ checkpoint size", "wall (s)"]
    text = docs_block.table(header, rows)
    print(f"checkpoint: {figures['parameters']:,} parameters, {size / mib:,.0f} MiB in fp32\n{text}")
    if args.write_docs:
        import jax

        body = (
            f"Written by `python benchmarks/interop_memory.py{' --smoke' if args.smoke else ''}` on "
            f"{time.strftime('%Y-%m-%d')}. {docs_block.machine_line(jax.devices(), smoke=args.smoke)}\n"
            f"A random Llama of {figures['parameters']:,} parameters ({size / mib:,.0f} MiB in fp32, files of "
            f"100 MB); each command in a fresh process, its peak RSS above its RSS just before the work:\n\n{text}\n"
        )
        docs_block.write_block(args.write_docs, "interop_memory", body)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
