"""Step cost of K-pass training: does K passes cost K times one pass, and no more?

At the two shapes compared with nanodo on this CPU (D256 L4 H4 T256 B16 and D512 L6 H8 T256 B8,
vocabulary 32768), times the compiled production train step (`fbt_jax.train.step.train_step`) for
K = 1, 2, 3, interleaving the Ks round by round so that machine noise hits all of them alike, and
reports medians, the ratio t(K) / (K · t(1)) (target ≤ 1.03), the explicitly counted model FLOPs
per step (see fbt_jax/flops.py for what is counted), the achieved FLOP/s as a fraction of this
machine's peak fp32 matmul FLOP/s sampled in the same round (MFU, median over rounds: the
machine's speed drifts), and each K program's per-device memory; all of it twice, with the whole
readout at once and with the chunked loss (`model.loss_chunk_size=64`), timed in the same rounds.

    python benchmarks/step_cost.py [--rounds 5] [--steps-per-round 1] [--smoke] [--write-docs PATH]

Prints a table and, last, one JSON line with every figure. `--smoke` runs the same code on the tiny
config only, at K = 1 and 2 (K = 3 is one more compile of the same program), with small matmuls and
one round (seconds); `--write-docs PATH` rewrites the
`benchmarks/step_cost.py` block of the Markdown file PATH with the table (see docs_block.py).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import docs_block  # noqa: E402
from bench_configs import every_k_trainer, nanodo_configs, tiny_config  # noqa: E402

from fbt_jax.flops import train_step_flops  # noqa: E402
from fbt_jax.model import ModelConfig  # noqa: E402

PASS_COUNTS = (1, 2, 3)
CHUNK = 64  # positions per chunk of the chunked-loss variant


class MatmulPeak:
    """The machine's practical fp32 matmul FLOP/s, sampled between the timed steps.

    This 2-core VM's speed drifts by tens of percent within minutes, so a peak measured once at
    start-up says little about a step timed five minutes later: each round of steps is compared
    with the peak sampled in the same round (best of a few square sizes).
    """

    def __init__(self, sizes: tuple[int, ...]):
        matmul = jax.jit(lambda x, y: x @ y)
        self.operands = {
            n: (jax.random.normal(jax.random.PRNGKey(0), (n, n)), jax.random.normal(jax.random.PRNGKey(1), (n, n)))
            for n in sizes
        }
        self.matmul = matmul
        for a, b in self.operands.values():
            matmul(a, b).block_until_ready()
        self.samples: list[float] = []

    def sample(self, repeats: int = 3) -> float:
        best = 0.0
        for n, (a, b) in self.operands.items():
            for _ in range(repeats):
                start = time.perf_counter()
                self.matmul(a, b).block_until_ready()
                best = max(best, 2 * n**3 / (time.perf_counter() - start))
        self.samples.append(best)
        return best


def time_variants(
    variants: dict[str, object], rounds: int, steps_per_round: int, peak: MatmulPeak, pass_counts: tuple[int, ...]
) -> dict[str, dict[int, dict[str, float]]]:
    """Per variant (a config) and K: the median step time, the median over rounds of the step's
    FLOP/s as a fraction of the matmul peak sampled in the same round, the FLOPs and the compiled
    per-device memory. Every program of every variant runs once per round, in turn."""
    runs = {}
    for label, config in variants.items():
        # One device, like the peak it is compared with (a multi-device mesh is sharding_overhead.py's).
        trainer = every_k_trainer(config, jax.devices()[:1])
        report = trainer.compile(pass_counts)
        trainer.init_state()
        batch = trainer.batch("train", 0, config.train.batch_size)
        state = trainer.state
        for k in pass_counts:  # warm up each program
            for _ in range(2):
                state, metrics = trainer.programs.train[k](state, batch)
            jax.block_until_ready(metrics)
        model_cfg = ModelConfig.from_config(config.model)
        flops = {k: train_step_flops(model_cfg, config.train.batch_size, config.data.seq_len, k) for k in pass_counts}
        runs[label] = {"trainer": trainer, "state": state, "batch": batch, "report": report, "flops": flops}
    samples = {label: {k: [] for k in pass_counts} for label in variants}
    fractions = {label: {k: [] for k in pass_counts} for label in variants}
    for _ in range(rounds):
        round_peak = peak.sample()
        for label, run in runs.items():
            for k in pass_counts:
                program, state = run["trainer"].programs.train[k], run["state"]
                start = time.perf_counter()
                for _ in range(steps_per_round):
                    state, metrics = program(state, run["batch"])
                jax.block_until_ready((state, metrics))
                run["state"] = state
                samples[label][k].append((time.perf_counter() - start) / steps_per_round)
                fractions[label][k].append(run["flops"][k] / samples[label][k][-1] / round_peak)
    return {
        label: {
            k: {
                "seconds": statistics.median(samples[label][k]),
                "fraction_of_peak": statistics.median(fractions[label][k]),
                "flops": run["flops"][k],
                "device_mib": run["report"][f"train_K{k}"].get("device_bytes", 0.0) / 2**20,
            }
            for k in pass_counts
        }
        for label, run in runs.items()
    }


def main() -> None:
    args = docs_block.timing_arguments(__doc__, "step_cost", rounds=5, steps_per_round=1)
    if args.smoke:
        configs = (("tiny", tiny_config()),)
        peak = MatmulPeak(sizes=(256,))
        pass_counts = (1, 2)  # one pass (the ratio's baseline) and feedback
    else:
        configs = tuple(nanodo_configs().items())
        peak = MatmulPeak(sizes=(1024, 2048))
        pass_counts = PASS_COUNTS
    print(f"devices: {jax.devices()}  peak fp32 matmul at start: {peak.sample() / 1e9:.1f} GFLOP/s")
    results = {"configs": {}}
    header = (
        f"{'config':<14}{'K':>2}{'GFLOP/step':>12}{'median step':>14}{'t(K)/(K·t(1))':>15}{'MFU':>7}{'MiB':>9}"
        f"{'| chunked:':>11}{'median step':>14}{'t(K)/(K·t(1))':>15}{'MFU':>7}{'MiB':>9}"
    )
    print(header)
    print("-" * len(header))
    for name, config in configs:
        chunked = config.copy_and_resolve_references()
        chunked.model.loss_chunk_size = min(CHUNK, config.data.seq_len // 2)
        timed = time_variants(
            {"full": config, "chunked": chunked}, args.rounds, args.steps_per_round, peak, pass_counts
        )
        rows = {}
        for k in pass_counts:
            rows[k] = {"flops_per_step": timed["full"][k]["flops"]}
            for label, suffix in (("full", ""), ("chunked", "_chunked_loss")):
                t = timed[label][k]
                rows[k] |= {
                    f"median_step_seconds{suffix}": t["seconds"],
                    f"ratio_to_k_times_one_pass{suffix}": t["seconds"] / (k * timed[label][1]["seconds"]),
                    f"achieved_flops{suffix}": t["flops"] / t["seconds"],
                    f"fraction_of_peak{suffix}": t["fraction_of_peak"],
                    f"device_mib{suffix}": t["device_mib"],
                }
            r = rows[k]
            print(
                f"{name:<14}{k:>2}{r['flops_per_step'] / 1e9:>12.3f}"
                + "".join(
                    f"{'|':>11}"
                    * (suffix != "")
                    + f"{r['median_step_seconds' + suffix] * 1e3:>12.2f}ms{r['ratio_to_k_times_one_pass' + suffix]:>15.3f}"
                    f"{r['fraction_of_peak' + suffix]:>7.1%}{r['device_mib' + suffix]:>9.1f}"
                    for suffix in ("", "_chunked_loss")
                )
            )
        results["configs"][name] = {
            "embed_dim": config.model.embed_dim,
            "num_layers": config.model.num_layers,
            "batch_size": config.train.batch_size,
            "seq_len": config.data.seq_len,
            "loss_chunk_size": chunked.model.loss_chunk_size,
            "by_num_passes": rows,
        }
    results["peak_flops_median"] = statistics.median(peak.samples)
    results["peak_flops_range"] = [min(peak.samples), max(peak.samples)]
    results["peak_sizes"] = list(peak.operands)
    if args.write_docs:
        docs_block.write_block(args.write_docs, "step_cost", docs_text(results, args.smoke))
    print(json.dumps(results))


def docs_text(results: dict, smoke: bool) -> str:
    """The Markdown block for the docs: the machine and peak, then one table row per config and K."""
    low, high = results["peak_flops_range"]
    sizes = ", ".join(f"{n}²" for n in results["peak_sizes"])
    machine = docs_block.machine_line(
        jax.devices()[:1],
        f"peak fp32 matmul ({sizes}) sampled every round: median {results['peak_flops_median'] / 1e9:.0f} GFLOP/s, "
        f"range {low / 1e9:.0f}–{high / 1e9:.0f}; MFU is each round's step against that round's peak (median)",
        smoke,
    )
    rows = []
    for name, c in results["configs"].items():
        label = f"{name} (D={c['embed_dim']}, L={c['num_layers']}, B={c['batch_size']}, T={c['seq_len']})"
        for k, r in c["by_num_passes"].items():
            row = [label if k == PASS_COUNTS[0] else "", k, f"{r['flops_per_step'] / 1e9:.3g}"]
            for suffix in ("", "_chunked_loss"):
                row += [
                    docs_block.ms(r["median_step_seconds" + suffix]),
                    f"{r['ratio_to_k_times_one_pass' + suffix]:.3f}",
                    f"{r['fraction_of_peak' + suffix]:.0%}",
                    f"{r['device_mib' + suffix]:,.0f}",
                ]
            rows.append(row)
    chunk = next(iter(results["configs"].values()))["loss_chunk_size"]
    header = ["config", "K", "GFLOP/step", "median step", "t(K) / (K·t(1))", "MFU", "MiB per device"]
    header += [f"chunked: {h}" for h in header[3:]]
    note = f"chunked: the same step with `model.loss_chunk_size={chunk}` (the readout and loss {chunk} positions at a time)."
    return docs_block.block(
        "step_cost", docs_block.run_arguments(sys.argv[1:]), machine, [docs_block.table(header, rows)], [note]
    )


if __name__ == "__main__":
    main()
