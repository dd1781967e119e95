"""Step cost of K-pass training: does K passes cost K times one pass, and no more?

At the two shapes compared with nanodo on this CPU (D256 L4 H4 T256 B16 and D512 L6 H8 T256 B8,
vocabulary 32768), times the compiled production train step (`fbt_jax.train.step.train_step`) for
K = 1, 2, 3, interleaving the Ks round by round so that machine noise hits all of them alike, and
reports medians, the ratio t(K) / (K · t(1)) (target ≤ 1.03), the explicitly counted model FLOPs
per step (see fbt_jax/flops.py for what is counted), the achieved FLOP/s as a fraction of this
machine's peak matmul FLOP/s measured in the same run (MFU), and each K program's per-device
memory without and with the chunked loss (`model.loss_chunk_size=64`).

    python benchmarks/step_cost.py [--rounds 5] [--steps-per-round 1] [--smoke] [--write-docs PATH]

Prints a table and, last, one JSON line with every figure. `--smoke` runs the same code on the tiny
config only, with small matmuls and one round (seconds); `--write-docs PATH` rewrites the
`benchmarks/step_cost.py` block of the Markdown file PATH with the table (see docs_block.py).
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
from bench_configs import nanodo_configs, tiny_config  # noqa: E402

from fbt_jax.flops import train_step_flops  # noqa: E402
from fbt_jax.model import ModelConfig  # noqa: E402
from fbt_jax.train.trainer import Trainer  # noqa: E402

PASS_COUNTS = (1, 2, 3)


def peak_matmul_flops(rounds: int = 10, sizes: tuple[int, ...] = (1024, 2048)) -> dict[str, float]:
    """Best median fp32 matmul FLOP/s over a few square sizes (the machine's practical peak)."""
    out = {}
    for n in sizes:
        a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.float32)
        b = jax.random.normal(jax.random.PRNGKey(1), (n, n), jnp.float32)
        matmul = jax.jit(lambda x, y: x @ y)
        matmul(a, b).block_until_ready()
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            matmul(a, b).block_until_ready()
            times.append(time.perf_counter() - start)
        out[f"matmul_{n}"] = 2 * n**3 / statistics.median(times)
    return out


def trainer_for(config) -> Trainer:
    config.passes.schedule = "0:1=0.4,2=0.3,3=0.3"  # any mixture that compiles every K in PASS_COUNTS
    config.eval.num_batches = 0
    # One device, like the peak it is compared with (a multi-device mesh is sharding_overhead.py's).
    return Trainer(config, log=lambda *_: None, devices=jax.devices()[:1])


def device_mib(config, loss_chunk_size: int) -> dict[int, float]:
    """Per-device memory (MiB) of each K's compiled train step, with the given loss chunking."""
    config = config.copy_and_resolve_references()
    config.model.loss_chunk_size = loss_chunk_size
    report = trainer_for(config).compile(PASS_COUNTS)
    return {k: report[f"train_K{k}"].get("device_bytes", 0.0) / 2**20 for k in PASS_COUNTS}


def time_steps(config, rounds: int, steps_per_round: int) -> dict[int, float]:
    trainer = trainer_for(config)
    trainer.compile(PASS_COUNTS)
    trainer.init_state()
    batch = trainer.batch("train", 0, config.train.batch_size)
    state = trainer.state
    for k in PASS_COUNTS:  # warm up each program
        for _ in range(2):
            state, metrics = trainer.programs.train[k](state, batch)
        jax.block_until_ready(metrics)
    samples: dict[int, list[float]] = {k: [] for k in PASS_COUNTS}
    for _ in range(rounds):
        for k in PASS_COUNTS:
            program = trainer.programs.train[k]
            start = time.perf_counter()
            for _ in range(steps_per_round):
                state, metrics = program(state, batch)
            jax.block_until_ready((state, metrics))
            samples[k].append((time.perf_counter() - start) / steps_per_round)
    return {k: statistics.median(v) for k, v in samples.items()}


def main() -> None:
    args = docs_block.timing_arguments(__doc__, "step_cost", rounds=5, steps_per_round=1)
    if args.smoke:
        configs = (("tiny", tiny_config()),)
        peaks = peak_matmul_flops(rounds=2, sizes=(256,))
    else:
        configs = tuple(nanodo_configs().items())
        peaks = peak_matmul_flops()
    peak = max(peaks.values())
    print(
        f"devices: {jax.devices()}  peak fp32 matmul: "
        + ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in peaks.items())
    )
    results = {"peak_flops": peak, "peak_by_size": peaks, "configs": {}}
    header = (
        f"{'config':<14}{'K':>2}{'median step':>14}{'t(K)/(K·t(1))':>15}{'GFLOP/step':>12}{'GFLOP/s':>9}{'MFU':>7}"
        f"{'MiB':>9}{'MiB chunked':>13}"
    )
    print(header)
    print("-" * len(header))
    for name, config in configs:
        model_cfg = ModelConfig.from_config(config.model)
        times = time_steps(config, args.rounds, args.steps_per_round)
        memory, memory_chunked = device_mib(config, 0), device_mib(config, min(64, config.data.seq_len // 2))
        rows = {}
        for k in PASS_COUNTS:
            flops = train_step_flops(model_cfg, config.train.batch_size, config.data.seq_len, k)
            rows[k] = {
                "median_step_seconds": times[k],
                "ratio_to_k_times_one_pass": times[k] / (k * times[1]),
                "flops_per_step": flops,
                "achieved_flops": flops / times[k],
                "fraction_of_peak": flops / times[k] / peak,
                "device_mib": memory[k],
                "device_mib_chunked_loss": memory_chunked[k],
            }
            r = rows[k]
            print(
                f"{name:<14}{k:>2}{times[k] * 1e3:>12.2f}ms{r['ratio_to_k_times_one_pass']:>15.3f}"
                f"{flops / 1e9:>12.3f}{r['achieved_flops'] / 1e9:>9.1f}{r['fraction_of_peak']:>7.1%}"
                f"{memory[k]:>9.1f}{memory_chunked[k]:>13.1f}"
            )
        results["configs"][name] = {
            "embed_dim": config.model.embed_dim,
            "num_layers": config.model.num_layers,
            "batch_size": config.train.batch_size,
            "seq_len": config.data.seq_len,
            "by_num_passes": rows,
        }
    if args.write_docs:
        docs_block.write_block(args.write_docs, "step_cost", docs_text(results, args.smoke))
    print(json.dumps(results))


def docs_text(results: dict, smoke: bool) -> str:
    """The Markdown block for the docs: the machine and peak, then one table row per config and K."""
    best = max(results["peak_by_size"], key=results["peak_by_size"].get)
    size = best.removeprefix("matmul_")
    machine = docs_block.machine_line(
        jax.devices()[:1], f"peak fp32 matmul measured {results['peak_flops'] / 1e9:.0f} GFLOP/s at {size}²", smoke
    )
    rows = []
    for name, c in results["configs"].items():
        label = f"{name} (D={c['embed_dim']}, L={c['num_layers']}, B={c['batch_size']}, T={c['seq_len']})"
        for k, r in c["by_num_passes"].items():
            rows.append(
                [
                    label if k == PASS_COUNTS[0] else "",
                    k,
                    docs_block.ms(r["median_step_seconds"]),
                    f"{r['ratio_to_k_times_one_pass']:.3f}",
                    f"{r['flops_per_step'] / 1e9:.3g}",
                    f"{r['achieved_flops'] / 1e9:.1f}",
                    f"{r['fraction_of_peak']:.0%}",
                    f"{r['device_mib']:,.0f}",
                    f"{r['device_mib_chunked_loss']:,.0f}",
                ]
            )
    header = [
        "config",
        "K",
        "median step",
        "t(K) / (K·t(1))",
        "GFLOP/step",
        "GFLOP/s",
        "MFU",
        "MiB per device",
        "MiB, chunked loss",
    ]
    return docs_block.block(
        "step_cost", docs_block.run_arguments(sys.argv[1:]), machine, [docs_block.table(header, rows)]
    )


if __name__ == "__main__":
    main()
