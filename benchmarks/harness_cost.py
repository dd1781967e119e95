"""What the paper's evaluation table costs: lm-evaluation-harness loglikelihood requests per second in
each decoding mode, through the `fbt` backend's scorer (`fbt_jax.evals.likelihood.Scorer`).

For tiny and cpu_medium (bench_configs, random weights: cost does not depend on them), a set of
multiple-choice-shaped requests (an 89-token context and an 8-token continuation each, the shapes
of a few-shot cloze task) is scored in each mode at batch 32 on one device: standard is one plain pass
over context + continuation; soft reads the context plain and then feeds the continuation one token
at a time with latent feedback; fused prefills the context with 2 passes first. A warm-up call
compiles each mode's programs, then medians over `--repeats` repeats with the modes interleaved
(rotated each repeat). Reported: requests/s, continuation tokens scored per second, and each
mode's time over standard's: what a user pays per request for the soft and fused columns.

    python benchmarks/harness_cost.py [--repeats 5] [--smoke] [--write-docs PATH]

Prints a table and, last, one JSON line with every figure. `--smoke` scores 4 short requests on
the tiny model once; `--write-docs PATH` rewrites the `benchmarks/harness_cost.py` block of PATH.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import docs_block  # noqa: E402
from bench_configs import cpu_medium_config, tiny_config  # noqa: E402

from fbt_jax import decode  # noqa: E402
from fbt_jax.evals.generation import Compiled  # noqa: E402
from fbt_jax.evals.likelihood import Scorer  # noqa: E402
from fbt_jax.model import ModelConfig, build_model  # noqa: E402

# 89 + 8 − 1 = 96 input positions in standard mode, a multiple of the length bucket (32) as soft and
# fused's 89-token prefill is padded to: the modes compared on the same padded shapes.
SIZES = {"requests": 64, "context": 89, "continuation": 8, "batch": 32}
SMOKE_SIZES = {"requests": 4, "context": 12, "continuation": 3, "batch": 2}


def measure(model, requests: int, context: int, continuation: int, batch: int, repeats: int) -> dict[str, float]:
    """Requests/s and continuation tokens/s per mode, and each mode's time over standard's."""
    rng = np.random.default_rng(0)
    vocab = model.cfg.vocab_size
    asked = [(rng.integers(0, vocab, context).tolist(), rng.integers(0, vocab, continuation).tolist())
             for _ in range(requests)]  # fmt: skip
    scorer = Scorer(Compiled(model, jax.devices()[:1]), batch_size=batch)
    for mode in decode.MODES:  # warm-up: each mode's programs compiled
        scorer.score(asked, mode)
    samples: dict[str, list[float]] = {mode: [] for mode in decode.MODES}
    for r in range(repeats):
        for mode in decode.MODES[r % 3 :] + decode.MODES[: r % 3]:
            start = time.perf_counter()
            scored = scorer.score(asked, mode)
            samples[mode].append(time.perf_counter() - start)
            if not all(np.isfinite(s.total) for s in scored):
                raise RuntimeError(f"{mode}: a loglikelihood is not finite")
    out: dict[str, float] = {}
    for mode in decode.MODES:
        seconds = statistics.median(samples[mode])
        out[f"{mode}_requests_per_second"] = requests / seconds
        out[f"{mode}_tokens_per_second"] = requests * continuation / seconds
        out[f"{mode}_over_standard"] = seconds / statistics.median(samples["standard"])
    return out


def main() -> None:
    args = docs_block.arguments(__doc__, "harness_cost", "4 short requests on tiny, once: checks that it runs",
                                extra=[("--repeats", dict(type=int, default=5))])  # fmt: skip
    sizes, configs = SIZES, (("tiny", tiny_config()), ("cpu_medium", cpu_medium_config()))
    if args.smoke:
        sizes, configs, args.repeats = SMOKE_SIZES, configs[:1], 1
    results = {}
    for name, config in configs:
        model = build_model(ModelConfig.from_config(config.model), seed=0)
        results[name] = measure(model, **sizes, repeats=args.repeats)
        results[name] |= {"embed_dim": config.model.embed_dim, "num_layers": config.model.num_layers}
    print(
        f"{'model':<12}" + "".join(f"{m + ' req/s':>16}" for m in decode.MODES) + f"{'soft/std':>10}{'fused/std':>11}"
    )
    for name, r in results.items():
        print(f"{name:<12}" + "".join(f"{r[m + '_requests_per_second']:>16.1f}" for m in decode.MODES)
              + f"{r['soft_over_standard']:>10.2f}{r['fused_over_standard']:>11.2f}")  # fmt: skip
    out = {"sizes": sizes, "repeats": args.repeats, "results": results}
    if args.write_docs:
        docs_block.write_block(args.write_docs, "harness_cost", docs_text(out, args.smoke))
    print(json.dumps(out))


def docs_text(out: dict, smoke: bool) -> str:
    s = out["sizes"]
    intro = (
        f"{s['requests']} loglikelihood requests, contexts of {s['context']} tokens and continuations of "
        f"{s['continuation']}, batch {s['batch']}, random weights, one device; medians over {out['repeats']} "
        f"repeat{'s' * (out['repeats'] != 1)} after a warm-up that compiled every program, the modes interleaved:"
    )
    header = ["model", *[f"{m} requests/s" for m in decode.MODES], "soft/standard time", "fused/standard time"]
    header.insert(4, "standard tokens/s")
    rows = [
        [f"{name} (D={r['embed_dim']}, L={r['num_layers']})"]
        + [f"{r[f'{m}_requests_per_second']:.0f}" for m in decode.MODES]
        + [
            f"{r['standard_tokens_per_second']:.0f}",
            f"{r['soft_over_standard']:.2f}",
            f"{r['fused_over_standard']:.2f}",
        ]
        for name, r in out["results"].items()
    ]
    notes = [
        "Standard scores a request in one parallel pass; soft and fused feed the continuation one cached step per "
        "token (the recurrence they decode with), so their cost grows with the continuation's length, and fused adds "
        "the second pass over the context. Lengths are padded to multiples of 32 (context) and 8 (continuation) so "
        "that a few programs serve a task: a request's cost follows its padded length."
    ]
    machine = docs_block.machine_line(jax.devices()[:1], smoke=smoke)
    return docs_block.block("harness_cost", docs_block.run_arguments(sys.argv[1:]), machine,
                            [intro, docs_block.table(header, rows)], notes)  # fmt: skip


if __name__ == "__main__":
    main()
