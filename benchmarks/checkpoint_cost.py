"""What checkpointing costs: step time with asynchronous saves every step, and save/restore times.

On a CPU-sized model, times the production train step (K=1) with no checkpointing and with an
asynchronous orbax save after every step (the save call and any wait for the previous save are
counted in the step), interleaved in rounds; then the wall time of a synchronous save and of a
restore for three model sizes. Async saving should cost under 10% of a step.

    python benchmarks/checkpoint_cost.py [--rounds 5] [--steps-per-round 6] [--smoke] [--write-docs PATH]

Two batch sizes (8 and 32 sequences of 128 tokens) show how the cost depends on the work per step:
the blocking part of a save (copying the state off the device, orbax's bookkeeping) is fixed per
save, and on a 2-core CPU the background write competes with the step for the same cores (on an
accelerator host it runs on otherwise idle CPUs). Prints a table, the ratios and, last, one JSON
line with every figure. `--smoke` runs the same code on a D=64 model with one batch of 4
sequences of 32 tokens, one round (seconds); `--write-docs PATH` rewrites the
`benchmarks/checkpoint_cost.py` block of the Markdown file PATH with the tables (see docs_block.py).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import docs_block  # noqa: E402
from bench_configs import sized_config  # noqa: E402

from fbt_jax.checkpoint import Checkpointer  # noqa: E402
from fbt_jax.sharding import per_device_bytes  # noqa: E402
from fbt_jax.train.trainer import Trainer  # noqa: E402

# Full run: the step-overhead model's width, its batch sizes, the save/restore widths, the sequence length.
FULL = {"width": 256, "batch_sizes": (8, 32), "widths": (128, 256, 512), "seq_len": 128}
SMOKE = {"width": 64, "batch_sizes": (4,), "widths": (64,), "seq_len": 32}


def cpu_config(width: int, workdir: str, batch_size: int = 8, seq_len: int = 128):
    c = sized_config(
        seq_len=seq_len,
        batch_size=batch_size,
        embed_dim=width,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
        mlp_dim=4 * width,
    )
    c.workdir = workdir
    c.passes.schedule = "0:1"
    c.eval.num_batches = 0
    c.checkpoint.max_to_keep = 2
    return c


def trainer_for(config, compile_programs: bool = True) -> Trainer:
    trainer = Trainer(config, log=lambda *_: None, devices=jax.devices()[:1])
    if compile_programs:
        trainer.compile()
    trainer.init_state()
    return trainer


def step_overhead(
    tmp: str, rounds: int, steps_per_round: int, batch_size: int, width: int = 256, seq_len: int = 128
) -> dict[str, float]:
    config = cpu_config(width, os.path.join(tmp, f"overhead{batch_size}"), batch_size, seq_len)
    trainer = trainer_for(config)
    checkpointer = Checkpointer(os.path.join(config.workdir, "checkpoints"), config.checkpoint)
    batch = trainer.batch("train", 0, config.train.batch_size)
    program = trainer.programs.train[1]
    step = 0

    def run(save: bool) -> float:
        nonlocal step
        start = time.perf_counter()
        for _ in range(steps_per_round):
            trainer.state, metrics = program(trainer.state, batch)
            step += 1
            if save:
                checkpointer.save(step, trainer.state, config, force=True)
        jax.block_until_ready(metrics)
        return (time.perf_counter() - start) / steps_per_round

    run(False), run(True)  # warm up both paths
    plain, saving = [], []
    for _ in range(rounds):
        plain.append(run(False))
        saving.append(run(True))
    checkpointer.wait()
    checkpointer.close()
    return {"step_seconds": statistics.median(plain), "step_with_async_save_seconds": statistics.median(saving)}


def save_restore_times(tmp: str, width: int, repeats: int = 3, seq_len: int = 128) -> dict[str, float]:
    config = cpu_config(width, os.path.join(tmp, f"w{width}"), seq_len=seq_len)
    trainer = trainer_for(config, compile_programs=False)  # only the state is saved and restored
    directory = os.path.join(tmp, f"w{width}", "checkpoints")
    checkpointer = Checkpointer(directory, config.checkpoint)
    saves, restores = [], []
    for i in range(repeats):
        start = time.perf_counter()
        checkpointer.save(i + 1, trainer.state, config, force=True)
        checkpointer.wait()
        saves.append(time.perf_counter() - start)
        abstract = trainer.programs.sharded_abstract_state()
        start = time.perf_counter()
        restored = checkpointer.restore_latest(abstract, config)
        jax.block_until_ready(restored.state)
        restores.append(time.perf_counter() - start)
    checkpointer.close()
    size = per_device_bytes(trainer.programs.abstract_state, trainer.programs.state_shardings)
    return {
        "megabytes": size / 1e6,
        "save_seconds": statistics.median(saves),
        "restore_seconds": statistics.median(restores),
    }


def main() -> None:
    args = docs_block.timing_arguments(__doc__, "checkpoint_cost", rounds=5, steps_per_round=6, smoke_steps_per_round=2)
    sizes_cfg = SMOKE if args.smoke else FULL
    repeats = 1 if args.smoke else 3
    width, seq_len = sizes_cfg["width"], sizes_cfg["seq_len"]
    with tempfile.TemporaryDirectory() as tmp:
        overhead = {
            b: step_overhead(tmp, args.rounds, args.steps_per_round, b, width, seq_len)
            for b in sizes_cfg["batch_sizes"]
        }
        sizes = {w: save_restore_times(tmp, w, repeats, seq_len) for w in sizes_cfg["widths"]}
    print(f"{'width':>6}{'state MB':>10}{'save s':>9}{'restore s':>11}{'save MB/s':>11}")
    for w, r in sizes.items():
        print(
            f"{w:>6}{r['megabytes']:>10.1f}{r['save_seconds']:>9.3f}{r['restore_seconds']:>11.3f}"
            f"{r['megabytes'] / r['save_seconds']:>11.1f}"
        )
    ratios = {b: o["step_with_async_save_seconds"] / o["step_seconds"] for b, o in overhead.items()}
    for b, o in overhead.items():
        print(
            f"step (D={width}, L=4, B={b}, T={seq_len}): {o['step_seconds'] * 1e3:.1f} ms without saves, "
            f"{o['step_with_async_save_seconds'] * 1e3:.1f} ms with an async save every step (x{ratios[b]:.3f})"
        )
    small, large = min(ratios), max(ratios)
    also = f"B={small}: {ratios[small]:.3f}; " if small != large else ""
    print(f"step time with async saves every step / without, B={large}: {ratios[large]:.3f} ({also}target < 1.10)")
    results = {
        "width": width,
        "seq_len": seq_len,
        "overhead": overhead,
        "save_restore": sizes,
        "ratios": ratios,
    }
    if args.write_docs:
        docs_block.write_block(args.write_docs, "checkpoint_cost", docs_text(results, args.smoke))
    print(json.dumps(results))


def docs_text(results: dict, smoke: bool) -> str:
    """The Markdown block: the step-overhead table, then the save/restore table."""
    width, seq_len = results["width"], results["seq_len"]
    overhead_rows = [
        [
            b,
            docs_block.ms(o["step_seconds"]),
            docs_block.ms(o["step_with_async_save_seconds"]),
            f"{results['ratios'][b]:.2f}",
        ]
        for b, o in results["overhead"].items()
    ]
    overhead_table = docs_block.table(
        [f"batch (×{seq_len} tokens)", "step without saves", "step with an async save after every step", "ratio"],
        overhead_rows,
    )
    size_rows = [
        [
            w,
            f"{r['megabytes']:.1f}",
            f"{r['save_seconds']:.3f} s",
            f"{r['restore_seconds']:.3f} s",
            f"{r['megabytes'] / r['save_seconds']:.0f}",
        ]
        for w, r in results["save_restore"].items()
    ]
    size_table = docs_block.table(
        ["width D (L=4)", "state MB (params + Adam)", "synchronous save", "restore", "save MB/s"], size_rows
    )
    machine = docs_block.machine_line(jax.devices()[:1], smoke=smoke)
    intro = f"Model D={width}, L=4, T={seq_len}, K=1 train step on one device:"
    return docs_block.block(
        "checkpoint_cost", docs_block.run_arguments(sys.argv[1:]), machine, [intro, overhead_table, size_table]
    )


if __name__ == "__main__":
    main()
