"""What checkpointing costs: step time with asynchronous saves every step, and save/restore times.

On a CPU-sized model, times the production train step (K=1) with no checkpointing and with an
asynchronous orbax save after every step (the save call and any wait for the previous save are
counted in the step), interleaved in rounds; then the wall time of a synchronous save and of a
restore for three model sizes. Async saving should cost under 10% of a step.

    python benchmarks/checkpoint_cost.py [--rounds 5] [--steps-per-round 6]

Two batch sizes (8 and 32 sequences of 128 tokens) show how the cost depends on the work per step:
the blocking part of a save (copying the state off the device, orbax's bookkeeping) is fixed per
save, and on a 2-core CPU the background write competes with the step for the same cores (on an
accelerator host it runs on otherwise idle CPUs). Prints a table and, last, the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import jax

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs"))

from tiny import get_config as tiny_config  # noqa: E402

from fbt_jax.checkpoint import Checkpointer  # noqa: E402
from fbt_jax.sharding import per_device_bytes  # noqa: E402
from fbt_jax.train import Trainer  # noqa: E402


def cpu_config(width: int, workdir: str, batch_size: int = 8):
    c = tiny_config()
    c.workdir = workdir
    c.data.seq_len = 128
    c.model.embed_dim, c.model.num_layers, c.model.num_heads, c.model.num_kv_heads = width, 4, 8, 4
    c.model.mlp_dim = 4 * width
    c.train.batch_size = batch_size
    c.passes.schedule = "0:1"
    c.eval.num_batches = 0
    c.checkpoint.max_to_keep = 2
    return c


def trainer_for(config) -> Trainer:
    trainer = Trainer(config, log=lambda *_: None, devices=jax.devices()[:1])
    trainer.compile()
    trainer.init_state()
    return trainer


def step_overhead(tmp: str, rounds: int, steps_per_round: int, batch_size: int) -> dict[str, float]:
    config = cpu_config(256, os.path.join(tmp, f"overhead{batch_size}"), batch_size)
    trainer = trainer_for(config)
    checkpointer = Checkpointer(os.path.join(config.workdir, "checkpoints"), config.checkpoint)
    batch = trainer.batch("train", 0, config.train.batch_size)
    program = trainer.train_programs[1]
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


def save_restore_times(tmp: str, width: int) -> dict[str, float]:
    config = cpu_config(width, os.path.join(tmp, f"w{width}"))
    trainer = trainer_for(config)
    directory = os.path.join(tmp, f"w{width}", "checkpoints")
    checkpointer = Checkpointer(directory, config.checkpoint)
    saves, restores = [], []
    for i in range(3):
        start = time.perf_counter()
        checkpointer.save(i + 1, trainer.state, config, force=True)
        checkpointer.wait()
        saves.append(time.perf_counter() - start)
        abstract = trainer._abstract(trainer.abstract_state, trainer.state_shardings)
        start = time.perf_counter()
        state, _ = checkpointer.restore_latest(abstract, config)
        jax.block_until_ready(state)
        restores.append(time.perf_counter() - start)
    checkpointer.close()
    size = per_device_bytes(trainer.abstract_state, trainer.state_shardings)
    return {
        "megabytes": size / 1e6,
        "save_seconds": statistics.median(saves),
        "restore_seconds": statistics.median(restores),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps-per-round", type=int, default=6)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        overhead = {b: step_overhead(tmp, args.rounds, args.steps_per_round, b) for b in (8, 32)}
        sizes = {width: save_restore_times(tmp, width) for width in (128, 256, 512)}
    print(f"{'width':>6}{'state MB':>10}{'save s':>9}{'restore s':>11}{'save MB/s':>11}")
    for width, r in sizes.items():
        print(
            f"{width:>6}{r['megabytes']:>10.1f}{r['save_seconds']:>9.3f}{r['restore_seconds']:>11.3f}"
            f"{r['megabytes'] / r['save_seconds']:>11.1f}"
        )
    ratios = {b: o["step_with_async_save_seconds"] / o["step_seconds"] for b, o in overhead.items()}
    for b, o in overhead.items():
        print(
            f"step (D=256, L=4, B={b}, T=128): {o['step_seconds'] * 1e3:.1f} ms without saves, "
            f"{o['step_with_async_save_seconds'] * 1e3:.1f} ms with an async save every step (x{ratios[b]:.3f})"
        )
    print(json.dumps({"overhead": overhead, "save_restore": sizes, "ratios": ratios}))
    print(
        f"step time with async saves every step / without, B=32: {ratios[32]:.3f} (B=8: {ratios[8]:.3f}; target < 1.10)"
    )


if __name__ == "__main__":
    main()
