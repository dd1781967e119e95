"""What latent feedback costs at inference: soft vs standard decode steps, fused vs plain prefill.

For the tiny and a bigger CPU-sized model (random weights: cost does not depend on them), times
the jitted decode step in each mode (same batch, same cache length; medians over many steps,
modes interleaved), the plain and the 2-pass fused prefill, and prints the analytic forward-FLOP
overhead of feedback per token for the 1B config (target under 1%).

    python benchmarks/decode_cost.py [--steps 200] [--smoke] [--write-docs PATH]

Prints a table, the soft/standard per-token latency ratio of the bigger model and, last, one JSON
line with every figure. `--smoke` runs the same code on the tiny model only, with batch 2, prompt
16, cache 32 and two steps (seconds); `--write-docs PATH` rewrites the `benchmarks/decode_cost.py`
block of the Markdown file PATH with the table (see docs_block.py).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import docs_block  # noqa: E402
from bench_configs import fbt_1b_config, sized_config, tiny_config  # noqa: E402

from fbt_jax import decode  # noqa: E402
from fbt_jax.flops import feedback_overhead_per_token  # noqa: E402
from fbt_jax.model import ModelConfig, build_model  # noqa: E402

BATCH, PROMPT, CACHE = 8, 128, 512
SMOKE_BATCH, SMOKE_PROMPT, SMOKE_CACHE = 2, 16, 32


def bigger_model_config():
    return sized_config(vocab_size=512, embed_dim=512, num_layers=6, num_heads=8, num_kv_heads=4, mlp_dim=2048)


def measure(
    model, steps: int, batch: int = BATCH, prompt: int = PROMPT, cache: int = CACHE, prefill_repeats: int = 5
) -> dict[str, float]:
    prompts = jax.random.randint(jax.random.PRNGKey(0), (batch, prompt), 0, model.cfg.vocab_size)
    lengths = jnp.full((batch,), prompt)
    prefill = jax.jit(decode.prefill, static_argnums=(3, 4))
    step = jax.jit(decode.step, static_argnums=(3,))
    out: dict[str, float] = {}
    states = {}
    for mode in ("standard", "soft", "fused"):
        jax.block_until_ready(prefill(model, prompts, lengths, cache, mode))  # compile
        times = []
        for _ in range(prefill_repeats):
            start = time.perf_counter()
            states[mode] = jax.block_until_ready(prefill(model, prompts, lengths, cache, mode))
            times.append(time.perf_counter() - start)
        out[f"prefill_{mode}_seconds"] = statistics.median(times)
    token = jnp.zeros((batch,), jnp.int32)
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
    args = docs_block.arguments(
        __doc__,
        "decode_cost",
        "tiny sizes and two steps: checks that it runs",
        extra=[("--steps", dict(type=int, default=200))],
    )
    sizes = {"batch": BATCH, "prompt": PROMPT, "cache": CACHE}
    configs = (("tiny", tiny_config()), ("cpu_bigger", bigger_model_config()))
    prefill_repeats = 5
    if args.smoke:
        sizes = {"batch": SMOKE_BATCH, "prompt": SMOKE_PROMPT, "cache": SMOKE_CACHE}
        configs, args.steps, prefill_repeats = configs[:1], 2, 2
    results = {}
    for name, config in configs:
        model = build_model(ModelConfig.from_config(config.model), seed=0)
        results[name] = measure(model, args.steps, **sizes, prefill_repeats=prefill_repeats)
        results[name] |= {"embed_dim": config.model.embed_dim, "num_layers": config.model.num_layers}
    one_b = ModelConfig.from_config(fbt_1b_config().model)
    overhead = feedback_overhead_per_token(one_b, 2048)
    print(f"batch {sizes['batch']}, prompt {sizes['prompt']}, cache {sizes['cache']}")
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
    last = list(results)[-1]
    print(f"soft/standard per-token latency ({last}): {results[last]['soft_over_standard']:.3f}")
    out = {"sizes": sizes, "results": results, "flop_overhead_1b": overhead}
    if args.write_docs:
        docs_block.write_block(args.write_docs, "decode_cost", docs_text(out, args.smoke))
    print(json.dumps(out))


def docs_text(out: dict, smoke: bool) -> str:
    """The Markdown block: one table row per model, then the analytic 1B overhead."""
    sizes = out["sizes"]
    rows = [
        [
            f"{name} (D={r['embed_dim']}, L={r['num_layers']})",
            docs_block.ms(r["step_standard_seconds"]),
            docs_block.ms(r["step_soft_seconds"]),
            f"{r['soft_over_standard']:.3f}",
            docs_block.ms(r["prefill_soft_seconds"]),
            docs_block.ms(r["prefill_fused_seconds"]),
            f"{r['fused_over_plain_prefill']:.2f}",
        ]
        for name, r in out["results"].items()
    ]
    header = [
        "model",
        "standard step",
        "soft step",
        "soft/standard",
        "plain prefill",
        "fused (2-pass) prefill",
        "fused/plain",
    ]
    intro = f"Batch {sizes['batch']}, prompt {sizes['prompt']}, cache {sizes['cache']}, random weights, one device, medians:"
    note = (
        f"Analytic feedback overhead per token for the 1B config: {out['flop_overhead_1b']:.2%} of forward FLOPs "
        "(`fbt_jax.flops.feedback_overhead_per_token`; target < 1%)."
    )
    machine = docs_block.machine_line(jax.devices()[:1], smoke=smoke)
    return docs_block.block(
        "decode_cost", docs_block.run_arguments(sys.argv[1:]), machine, [intro, docs_block.table(header, rows)], [note]
    )


if __name__ == "__main__":
    main()
