"""Cost of sharding on one host: sharded vs single-device step time, and compile time per K.

On 8 simulated CPU devices, runs the production train step for the same global batch (the same
total work) on one device and on each mesh, interleaving them round by round, and prints the
median step-time ratio sharded / single-device (it should not be much worse on one host; on a
2-core CPU the 8 "devices" share 2 cores, so this measures partitioning overhead, not speed-up).
Then compiles every K for the tiny config and, abstractly, for the 1B config (FSDP over the 8
devices, no weights allocated) and prints the compile times.

    python benchmarks/sharding_overhead.py [--rounds 9] [--steps-per-round 3] [--smoke] [--write-docs PATH]

Prints a table and, last, one JSON line with every figure. `--smoke` runs the same code with a
smaller model and batch, two layouts (1 device and 2x2x2) without the contraction monitor's program, one round, and
compiles only K=1 (seconds); `--write-docs PATH` rewrites the `benchmarks/sharding_overhead.py` block of the
Markdown file PATH with the table (see docs_block.py).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import docs_block  # noqa: E402
from bench_configs import fbt_1b_config, sized_config, tiny_config  # noqa: E402

from fbt_jax.train.trainer import Trainer  # noqa: E402

# layout name → (data, fsdp, tensor) mesh over all 8 devices, or None for one device
MESHES = {"1 device": None, "8x1x1": (8, 1, 1), "2x2x2": (2, 2, 2), "1x4x2": (1, 4, 2)}
SMOKE_MESHES = {name: MESHES[name] for name in ("1 device", "2x2x2")}
MESH_LABELS = {
    "1 device": "1 device",
    "8x1x1": "data 8",
    "2x2x2": "data 2 × fsdp 2 × tensor 2",
    "1x4x2": "fsdp 4 × tensor 2",
}


def bench_config(smoke: bool = False):
    if smoke:
        c = sized_config(seq_len=16, batch_size=8, embed_dim=32, num_heads=4, num_kv_heads=2, mlp_dim=64)
    else:
        c = sized_config(seq_len=64, batch_size=32, embed_dim=128, num_heads=4, num_kv_heads=2, mlp_dim=512)
    c.passes.schedule = "0:1" if smoke else "0:1=0.5,2=0.5"
    c.eval.num_batches = 0
    if smoke:  # the timed layouts never run the contraction monitor: compiling it only costs time
        c.eval.contraction_passes = 0
    return c


def step_times(rounds: int, steps_per_round: int, meshes: dict = MESHES, smoke: bool = False) -> dict[str, float]:
    programs = {}
    for name, mesh in meshes.items():
        config = bench_config(smoke)
        devices = jax.devices()[:1] if mesh is None else jax.devices()
        if mesh is not None:
            config.mesh.data, config.mesh.fsdp, config.mesh.tensor = mesh
        trainer = Trainer(config, log=lambda *_: None, devices=devices)
        trainer.compile()
        trainer.init_state()
        batch = trainer.batch("train", 0, config.train.batch_size)
        programs[name] = [trainer, batch]
        for _ in range(2):  # warm up
            trainer.state, metrics = trainer.programs.train[1](trainer.state, batch)
        jax.block_until_ready(metrics)
    samples: dict[str, list[float]] = {name: [] for name in meshes}
    for _ in range(rounds):
        for name, (trainer, batch) in programs.items():
            start = time.perf_counter()
            for _ in range(steps_per_round):
                trainer.state, metrics = trainer.programs.train[1](trainer.state, batch)
            jax.block_until_ready((trainer.state, metrics))
            samples[name].append((time.perf_counter() - start) / steps_per_round)
    return {name: statistics.median(v) for name, v in samples.items()}


def compile_times(config, devices) -> dict[str, float]:
    config.eval.num_batches = 0
    trainer = Trainer(config, log=lambda *_: None, devices=devices)
    return {k: v["compile_seconds"] for k, v in trainer.compile().items()}


def main() -> None:
    args = docs_block.timing_arguments(__doc__, "sharding_overhead", rounds=9, steps_per_round=3)
    meshes, tiny_schedule, one_b_schedule = MESHES, "0:1=0.4,2=0.3,3=0.3", None
    if args.smoke:
        meshes, tiny_schedule, one_b_schedule = SMOKE_MESHES, "0:1", "0:1"

    times = step_times(args.rounds, args.steps_per_round, meshes, args.smoke)
    base = times["1 device"]
    print(f"{'layout':<10}{'median step':>14}{'ratio to 1 device':>20}")
    for name, t in times.items():
        print(f"{name:<10}{t * 1e3:>12.2f}ms{t / base:>20.3f}")

    tiny = tiny_config()
    tiny.passes.schedule = tiny_schedule
    one_b = fbt_1b_config()
    one_b.mesh.data, one_b.mesh.fsdp = 1, 8
    if one_b_schedule:
        one_b.passes.schedule = one_b_schedule
    compiles = {
        "tiny (8 devices)": compile_times(tiny, jax.devices()),
        "1b abstract (fsdp=8)": compile_times(one_b, jax.devices()),
    }
    for name, per_k in compiles.items():
        print(f"compile {name}: " + ", ".join(f"{k} {v:.1f}s" for k, v in per_k.items()))
    bench = bench_config(args.smoke)
    results = {
        "batch_size": bench.train.batch_size,
        "seq_len": bench.data.seq_len,
        "embed_dim": bench.model.embed_dim,
        "num_layers": bench.model.num_layers,
        "rounds": args.rounds,
        "steps_per_round": args.steps_per_round,
        "step_seconds": times,
        "ratio_to_one_device": {name: t / base for name, t in times.items()},
        "compile_seconds": compiles,
    }
    if args.write_docs:
        docs_block.write_block(args.write_docs, "sharding_overhead", docs_text(results, args.smoke))
    print(json.dumps(results))


def docs_text(results: dict, smoke: bool) -> str:
    """The Markdown block: one table row per layout, then the compile times."""
    rows = [
        [MESH_LABELS[name], docs_block.ms(t), f"{results['ratio_to_one_device'][name]:.2f}"]
        for name, t in results["step_seconds"].items()
    ]
    intro = (
        f"Same global batch ({results['batch_size']} × {results['seq_len']} tokens, D={results['embed_dim']}, "
        f"L={results['num_layers']}), medians over {results['rounds']} interleaved rounds × "
        f"{results['steps_per_round']} K=1 steps:"
    )
    compiles = "; ".join(
        f"{name} "
        + " / ".join(f"{v:.1f}" for v in per_k.values())
        + " s for K = "
        + " / ".join(k.removeprefix("train_K") for k in per_k)
        for name, per_k in results["compile_seconds"].items()
    )
    machine = docs_block.machine_line(jax.devices(), smoke=smoke)
    return docs_block.block(
        "sharding_overhead",
        docs_block.run_arguments(sys.argv[1:]),
        machine,
        [intro, docs_block.table(["layout", "median step", "ratio to one device"], rows)],
        [f"Compile times: {compiles}."],
    )


if __name__ == "__main__":
    main()
