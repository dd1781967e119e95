"""What latent feedback costs at inference: soft vs standard decode steps, fused vs plain prefill,
and whole generations through the evaluation engine.

For the tiny and a bigger CPU-sized model (random weights: cost does not depend on them), times
the jitted decode step in each mode (same batch, same cache length; medians over many steps,
modes interleaved), the plain and the 2-pass fused prefill, and prints the analytic forward-FLOP
overhead of feedback per token for the 1B config (target under 1%). Then, for tiny and cpu_medium
(bench_configs.cpu_medium_config), the tokens/s of whole greedy generations through
`fbt_jax.evals.generation.Generator.generate` in each mode at batch 1 and 32 (prompt 64, 64 new
tokens, no stop tokens; compiled by a warm-up call, then medians over `--repeats` repeats with the
modes interleaved), with the soft/standard time per generated token and the fused/standard
prefill time (a generate with max_new_tokens=1: the prefill and one step).

    python benchmarks/decode_cost.py [--steps 200] [--repeats 5] [--smoke] [--write-docs PATH]

Prints two tables, the soft/standard per-token latency ratio of the bigger model and, last, one
JSON line with every figure. `--smoke` runs the same code on the tiny model only, with batch 2,
prompt 16, cache 32 and two steps, and generations of 4 tokens after 16 at batch 2, once
(seconds); `--write-docs PATH` rewrites the `benchmarks/decode_cost.py` block of the Markdown file
PATH with the tables (see docs_block.py).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import docs_block  # noqa: E402
from bench_configs import cpu_medium_config, fbt_1b_config, sized_config, tiny_config  # noqa: E402

from fbt_jax import decode  # noqa: E402
from fbt_jax.evals.generation import Generator, Request  # noqa: E402
from fbt_jax.flops import feedback_overhead_per_token  # noqa: E402
from fbt_jax.model import ModelConfig, build_model  # noqa: E402

BATCH, PROMPT, CACHE = 8, 128, 512
SMOKE_BATCH, SMOKE_PROMPT, SMOKE_CACHE = 2, 16, 32
GENERATION = {"batches": (1, 32), "prompt": 64, "new_tokens": 64}
SMOKE_GENERATION = {"batches": (2,), "prompt": 16, "new_tokens": 4}


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


def measure_generation(model, batches, prompt: int, new_tokens: int, repeats: int) -> dict[str, dict[str, float]]:
    """Whole greedy generations through Generator.generate, per batch size: tokens/s per mode, the
    soft/standard time per generated token and the fused/standard time of a 1-token generate."""
    generator = Generator(model, jax.devices()[:1])
    rng = np.random.default_rng(0)
    runs = [(mode, n) for n in (new_tokens, 1) for mode in decode.MODES]
    out = {}
    for batch in batches:
        requests = [Request(rng.integers(0, model.cfg.vocab_size, prompt).tolist(), seed=i) for i in range(batch)]
        compile_before = generator.timing.compile_s
        for mode, n in runs:  # warm-up: compiles each mode's prefill and generation programs
            generator.generate(requests, mode, n)
        samples: dict[tuple, list[float]] = {run: [] for run in runs}
        for r in range(repeats):  # modes interleaved, the order rotated every repeat
            for mode, n in runs[r % len(runs) :] + runs[: r % len(runs)]:
                start = time.perf_counter()
                generated = generator.generate(requests, mode, n)
                samples[mode, n].append(time.perf_counter() - start)
                if any(len(g) != n for g in generated):
                    raise RuntimeError(f"{mode}: a row generated other than {n} tokens")
        t = {run: statistics.median(values) for run, values in samples.items()}
        r = {"batch": batch, "compile_seconds": generator.timing.compile_s - compile_before}
        for mode in decode.MODES:
            r[f"{mode}_seconds"] = t[mode, new_tokens]
            r[f"{mode}_tokens_per_second"] = batch * new_tokens / t[mode, new_tokens]
            r[f"{mode}_first_token_seconds"] = t[mode, 1]
        r["soft_over_standard_per_token"] = t["soft", new_tokens] / t["standard", new_tokens]
        r["fused_over_standard_per_token"] = t["fused", new_tokens] / t["standard", new_tokens]
        r["fused_over_standard_prefill"] = t["fused", 1] / t["standard", 1]
        out[f"batch_{batch}"] = r
    return out


def main() -> None:
    args = docs_block.arguments(
        __doc__,
        "decode_cost",
        "tiny sizes and two steps: checks that it runs",
        extra=[("--steps", dict(type=int, default=200)), ("--repeats", dict(type=int, default=5))],
    )
    sizes = {"batch": BATCH, "prompt": PROMPT, "cache": CACHE}
    configs = (("tiny", tiny_config()), ("cpu_bigger", bigger_model_config()))
    generation = dict(GENERATION)
    prefill_repeats = 5
    if args.smoke:
        sizes = {"batch": SMOKE_BATCH, "prompt": SMOKE_PROMPT, "cache": SMOKE_CACHE}
        configs, args.steps, prefill_repeats = configs[:1], 2, 2
        generation, args.repeats = dict(SMOKE_GENERATION), 1
    generation_configs = (("tiny", tiny_config()), ("cpu_medium", cpu_medium_config()))[: len(configs)]
    results = {}
    for name, config in configs:
        model = build_model(ModelConfig.from_config(config.model), seed=0)
        results[name] = measure(model, args.steps, **sizes, prefill_repeats=prefill_repeats)
        results[name] |= {"embed_dim": config.model.embed_dim, "num_layers": config.model.num_layers}
    generated = {}
    for name, config in generation_configs:
        model = build_model(ModelConfig.from_config(config.model), seed=0)
        generated[name] = measure_generation(model, **generation, repeats=args.repeats)
        generated[name] |= {"embed_dim": config.model.embed_dim, "num_layers": config.model.num_layers}
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
    g = generation
    print(f"\ngenerate: prompt {g['prompt']}, {g['new_tokens']} new tokens, greedy, median of {args.repeats}")
    print(
        f"{'model':<12}{'batch':>6}"
        + "".join(f"{m + ' tok/s':>16}" for m in decode.MODES)
        + f"{'soft/std':>10}{'fused/std prefill':>19}"
    )
    for name, batches in generated.items():
        for r in (r for key, r in batches.items() if key.startswith("batch_")):
            print(
                f"{name:<12}{r['batch']:>6}"
                + "".join(f"{r[m + '_tokens_per_second']:>16.1f}" for m in decode.MODES)
                + f"{r['soft_over_standard_per_token']:>10.3f}{r['fused_over_standard_prefill']:>19.2f}"
            )
    print(f"analytic feedback FLOP overhead per token, 1B config: {overhead:.2%} (target < 1%)")
    last = list(results)[-1]
    print(f"soft/standard per-token latency ({last}): {results[last]['soft_over_standard']:.3f}")
    generation = {
        "batches": list(g["batches"]),
        "prompt": g["prompt"],
        "new_tokens": g["new_tokens"],
        "repeats": args.repeats,
    }
    out = {"sizes": sizes, "results": results, "flop_overhead_1b": overhead}
    out["generation"] = {"sizes": generation, "results": generated}
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
    g = out["generation"]["sizes"]
    generation_intro = (
        f"Whole generations through `fbt_jax.evals.generation.Generator.generate`: greedy, no stop tokens (every row "
        f"generates exactly {g['new_tokens']} tokens after a {g['prompt']}-token prompt), random weights, one device. "
        "Tokens/s = generated tokens / wall time of `generate`, after a warm-up call that compiled every program; "
        f"medians over {g['repeats']} repeat{'s' * (g['repeats'] != 1)}, the modes interleaved within each repeat:"
    )
    generation_rows = [
        [f"{name} (D={m['embed_dim']}, L={m['num_layers']})", r["batch"]]
        + [docs_block.rate(r[f"{mode}_tokens_per_second"]) for mode in decode.MODES]
        + [f"{r['soft_over_standard_per_token']:.3f}", f"{r['fused_over_standard_prefill']:.2f}"]
        for name, m in out["generation"]["results"].items()
        for key, r in m.items()
        if key.startswith("batch_")
    ]
    generation_header = ["model", "batch", "standard tok/s", "soft tok/s", "fused tok/s", "soft/standard per token"]
    generation_header.append("fused/standard prefill")
    notes = [
        "Soft/standard per token: the wall time per generated token of those whole generations (it includes the "
        "prompt's prefill, the same one-pass prefill in both modes). Fused/standard prefill: the median wall time of "
        "a `generate` with `max_new_tokens=1` (the prefill, 2 passes in fused mode, and one step) in each mode, "
        "timed in the same repeats.",
        f"Analytic feedback overhead per token for the 1B config: {out['flop_overhead_1b']:.2%} of forward FLOPs "
        "(`fbt_jax.flops.feedback_overhead_per_token`; target < 1%).",
    ]
    tables = [intro, docs_block.table(header, rows), generation_intro]
    tables.append(docs_block.table(generation_header, generation_rows))
    machine = docs_block.machine_line(jax.devices()[:1], smoke=smoke)
    return docs_block.block("decode_cost", docs_block.run_arguments(sys.argv[1:]), machine, tables, notes)


if __name__ == "__main__":
    main()
