"""Step cost of K-pass training: does K passes cost K times one pass, and no more?

For the tiny config and a bigger CPU-sized one, times the compiled production train step
(`fbt_jax.train.train_step`) for K = 1, 2, 3, interleaving the Ks round by round so that machine
noise hits all of them alike, and reports medians, the ratio t(K) / (K · t(1)) (target ≤ 1.05),
the explicitly counted model FLOPs per step (see fbt_jax/flops.py for what is counted) and the
achieved FLOP/s as a fraction of this machine's peak matmul FLOP/s, measured in the same run.

    python benchmarks/step_cost.py [--rounds 15] [--steps-per-round 3]

Prints a table and, last, one JSON line with every figure.
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

from tiny import get_config as tiny_config  # noqa: E402

from fbt_jax.flops import train_step_flops  # noqa: E402
from fbt_jax.model import ModelConfig  # noqa: E402
from fbt_jax.train import Trainer  # noqa: E402

PASS_COUNTS = (1, 2, 3)


def cpu_medium_config():
    c = tiny_config()
    c.data.seq_len = 128
    c.model.embed_dim = 256
    c.model.num_layers = 4
    c.model.num_heads = 8
    c.model.num_kv_heads = 4
    c.model.mlp_dim = 1024
    c.train.batch_size = 8
    return c


def peak_matmul_flops(rounds: int = 10) -> dict[str, float]:
    """Best median fp32 matmul FLOP/s over a few square sizes (the machine's practical peak)."""
    out = {}
    for n in (1024, 2048):
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


def time_steps(config, rounds: int, steps_per_round: int) -> dict[int, float]:
    config.passes.schedule = "0:1=0.4,2=0.3,3=0.3"  # any mixture that compiles every K in PASS_COUNTS
    config.eval.num_batches = 0
    trainer = Trainer(config, log=lambda *_: None)
    trainer.compile()
    batch = trainer._local_batch("train", 0, config.train.batch_size)
    state = trainer.state
    for k in PASS_COUNTS:  # warm up each program
        for _ in range(2):
            state, metrics = trainer.train_programs[k](state, batch)
        jax.block_until_ready(metrics)
    samples: dict[int, list[float]] = {k: [] for k in PASS_COUNTS}
    for _ in range(rounds):
        for k in PASS_COUNTS:
            program = trainer.train_programs[k]
            start = time.perf_counter()
            for _ in range(steps_per_round):
                state, metrics = program(state, batch)
            jax.block_until_ready((state, metrics))
            samples[k].append((time.perf_counter() - start) / steps_per_round)
    return {k: statistics.median(v) for k, v in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps-per-round", type=int, default=3)
    args = parser.parse_args()

    peaks = peak_matmul_flops()
    peak = max(peaks.values())
    print(
        f"devices: {jax.devices()}  peak fp32 matmul: "
        + ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in peaks.items())
    )
    results = {"peak_flops": peak, "peak_by_size": peaks, "configs": {}}
    header = (
        f"{'config':<11}{'K':>2}{'median step':>14}{'t(K)/(K·t(1))':>15}{'GFLOP/step':>12}{'GFLOP/s':>9}{'of peak':>9}"
    )
    print(header)
    print("-" * len(header))
    for name, config in (("tiny", tiny_config()), ("cpu_medium", cpu_medium_config())):
        model_cfg = ModelConfig.from_config(config.model)
        times = time_steps(config, args.rounds, args.steps_per_round)
        rows = {}
        for k in PASS_COUNTS:
            flops = train_step_flops(model_cfg, config.train.batch_size, config.data.seq_len, k)
            rows[k] = {
                "median_step_seconds": times[k],
                "ratio_to_k_times_one_pass": times[k] / (k * times[1]),
                "flops_per_step": flops,
                "achieved_flops": flops / times[k],
                "fraction_of_peak": flops / times[k] / peak,
            }
            r = rows[k]
            print(
                f"{name:<11}{k:>2}{times[k] * 1e3:>12.2f}ms{r['ratio_to_k_times_one_pass']:>15.3f}"
                f"{flops / 1e9:>12.3f}{r['achieved_flops'] / 1e9:>9.1f}{r['fraction_of_peak']:>9.1%}"
            )
        results["configs"][name] = {
            "batch_size": config.train.batch_size,
            "seq_len": config.data.seq_len,
            "by_num_passes": rows,
        }
    print(json.dumps(results))


if __name__ == "__main__":
    main()
