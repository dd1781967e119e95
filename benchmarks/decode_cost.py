"""What latent feedback costs at inference: soft vs standard decode steps, fused vs plain prefill.

For the tiny and a bigger CPU-sized model (random weights: cost does not depend on them), times
the jitted decode step in each mode (same batch, same cache length; medians over many steps,
modes interleaved), the plain and the 2-pass fused prefill, and prints the analytic forward-FLOP
overhead of feedback per token for the 1B config (target under 1%).

    python benchmarks/decode_cost.py [--steps 200]

Prints a table and, last, the soft/standard per-token latency ratio of the bigger model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs"))

from fbt_1b import get_config as fbt_1b_config  # noqa: E402
from tiny import get_config as tiny_config  # noqa: E402

from fbt_jax import decode  # noqa: E402
from fbt_jax.flops import feedback_overhead_per_token  # noqa: E402
from fbt_jax.model import ModelConfig, build_model  # noqa: E402

BATCH, PROMPT, CACHE = 8, 128, 512


def bigger_model_config():
    c = tiny_config()
    c.model.vocab_size = 512
    c.model.embed_dim, c.model.num_layers, c.model.num_heads, c.model.num_kv_heads = 512, 6, 8, 4
    c.model.mlp_dim = 2048
    return c


def measure(model, steps: int) -> dict[str, float]:
    prompts = jax.random.randint(jax.random.PRNGKey(0), (BATCH, PROMPT), 0, model.cfg.vocab_size)
    lengths = jnp.full((BATCH,), PROMPT)
    prefill = jax.jit(decode.prefill, static_argnums=(3, 4))
    step = jax.jit(decode.step, static_argnums=(3,))
    out: dict[str, float] = {}
    states = {}
    for mode in ("standard", "soft", "fused"):
        jax.block_until_ready(prefill(model, prompts, lengths, CACHE, mode))  # compile
        times = []
        for _ in range(5):
            start = time.perf_counter()
            states[mode] = jax.block_until_ready(prefill(model, prompts, lengths, CACHE, mode))
            times.append(time.perf_counter() - start)
        out[f"prefill_{mode}_seconds"] = statistics.median(times)
    token = jnp.zeros((BATCH,), jnp.int32)
    samples: dict[str, list[float]] = {"standard": [], "soft": []}
    for mode in samples:
        jax.block_until_ready(step(model, states[mode], token, mode))  # compile
    for _ in range(steps):  # interleaved; the same state (same cache length) every time
        for mode in samples:
            start = time.perf_counter()
            jax.block_until_ready(step(model, states[mode], token, mode))
            samples[mode].append(time.perf_counter() - start)
    for mode, values in samples.items():
        out[f"step_{mode}_seconds"] = statistics.median(values)
    out["soft_over_standard"] = out["step_soft_seconds"] / out["step_standard_seconds"]
    out["fused_over_plain_prefill"] = out["prefill_fused_seconds"] / out["prefill_soft_seconds"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    results = {}
    for name, config in (("tiny", tiny_config()), ("cpu_bigger", bigger_model_config())):
        model = build_model(ModelConfig.from_config(config.model), seed=0)
        results[name] = measure(model, args.steps)
    one_b = ModelConfig.from_config(fbt_1b_config().model)
    overhead = feedback_overhead_per_token(one_b, 2048)
    print(f"batch {BATCH}, prompt {PROMPT}, cache {CACHE}")
    print(
        f"{'model':<12}{'standard step':>15}{'soft step':>12}{'soft/std':>10}{'plain prefill':>15}{'fused prefill':>15}{'fused/plain':>13}"
    )
    for name, r in results.items():
        print(
            f"{name:<12}{r['step_standard_seconds'] * 1e3:>13.3f}ms{r['step_soft_seconds'] * 1e3:>10.3f}ms"
            f"{r['soft_over_standard']:>10.3f}{r['prefill_soft_seconds'] * 1e3:>13.1f}ms"
            f"{r['prefill_fused_seconds'] * 1e3:>13.1f}ms{r['fused_over_plain_prefill']:>13.2f}"
        )
    print(f"analytic feedback FLOP overhead per token, 1B config: {overhead:.2%} (target < 1%)")
    print(json.dumps({"results": results, "flop_overhead_1b": overhead}))
    print(f"soft/standard per-token latency (cpu_bigger): {results['cpu_bigger']['soft_over_standard']:.3f}")


if __name__ == "__main__":
    main()
