"""Can the input pipeline keep up? Tokens/s delivered by the pipeline vs consumed by the model.

Measures, in one run: the text pipeline (a generated corpus prepared with fbt-prepare's code:
tokenised and packed into ArrayRecord, then read by the step-indexed loader with 2 worker
processes and with a prefetch thread), the synthetic word-problem task, and the tokens/s that
the tiny and a bigger CPU-sized model consume in a compiled K=1 train step (the fastest step, so
the hardest to feed). The pipeline must deliver at least 20× what the model consumes.

    python benchmarks/data_throughput.py [--batches 200]

Prints a table and, last, the smallest pipeline/model ratio (with a JSON line before it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs"))


def corpus_documents(num_docs: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    words = [("".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), size=rng.integers(2, 9)))) for _ in range(2000)]
    return [" ".join(rng.choice(words, size=rng.integers(20, 800))) for _ in range(num_docs)]


def pipeline_tokens_per_second(batches, num_batches: int, num_workers: int) -> float:
    from fbt_jax.data.pipeline import batch_iterator

    iterator = batch_iterator(batches, 0, num_workers=num_workers, prefetch=4)
    for _ in range(10):  # start-up (worker spawn) is not throughput
        next(iterator)
    start = time.perf_counter()
    tokens = 0
    for _ in range(num_batches):
        tokens += next(iterator)["inputs"].size
    elapsed = time.perf_counter() - start
    if hasattr(iterator, "close"):
        iterator.close()
    return tokens / elapsed


def model_tokens_per_second(config, rounds: int = 15) -> float:
    import jax

    from fbt_jax.train import Trainer

    config.passes.schedule = "0:1"
    config.eval.num_batches = 0
    trainer = Trainer(config, log=lambda *_: None, devices=jax.devices()[:1])
    trainer.compile()
    trainer.init_state()
    batch = trainer.batch("train", 0, config.train.batch_size)
    program = trainer.train_programs[1]
    for _ in range(3):
        trainer.state, metrics = program(trainer.state, batch)
    jax.block_until_ready(metrics)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        trainer.state, metrics = program(trainer.state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    return config.train.batch_size * config.data.seq_len / statistics.median(times)


def main() -> None:
    from absl import flags

    flags.FLAGS.mark_as_parsed()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=200)
    args = parser.parse_args()

    from tiny import get_config as tiny_config

    from fbt_jax.data import records
    from fbt_jax.data.pipeline import StepBatches, TaskSplit
    from fbt_jax.data.tasks import make_task

    seq_len, batch_size = 128, 16
    docs = corpus_documents(3000)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        meta = records.prepare(
            {"train": iter(docs), "validation": iter(docs[:10])},
            "byte",
            seq_len,
            os.path.join(tmp, "prep"),
            {"kind": "bench"},
        )
        prepare_rate = (meta["tokens"]["train"] + meta["tokens"]["validation"]) / (time.perf_counter() - start)
        text = StepBatches(
            records.PackedRecords(os.path.join(tmp, "prep"), "train"), batch_size, tuple(range(batch_size)), 0, True
        )
        pipeline = {
            "text, 2 workers": pipeline_tokens_per_second(text, args.batches, num_workers=2),
            "text, thread": pipeline_tokens_per_second(text, args.batches, num_workers=0),
        }
    task_config = tiny_config()
    task = StepBatches(TaskSplit(make_task(task_config), "train"), 32, tuple(range(32)), 0, True)
    pipeline["word problem, 2 workers"] = pipeline_tokens_per_second(task, args.batches, num_workers=2)
    pipeline["word problem, thread"] = pipeline_tokens_per_second(task, args.batches, num_workers=0)

    bigger = tiny_config()
    bigger.data.seq_len = 128
    bigger.model.embed_dim, bigger.model.num_layers, bigger.model.num_heads = 256, 4, 8
    bigger.model.num_kv_heads, bigger.model.mlp_dim, bigger.train.batch_size = 4, 1024, 8
    models = {"tiny": model_tokens_per_second(tiny_config()), "cpu_medium": model_tokens_per_second(bigger)}

    print(f"prepare (tokenise + pack + write): {prepare_rate:,.0f} tokens/s")
    print(f"{'pipeline':<26}{'tokens/s':>14}")
    for name, rate in pipeline.items():
        print(f"{name:<26}{rate:>14,.0f}")
    print(f"{'model (K=1 train step)':<26}{'tokens/s':>14}")
    for name, rate in models.items():
        print(f"{name:<26}{rate:>14,.0f}")
    ratios = {f"{p} / {m}": pipeline[p] / models[m] for p in pipeline for m in models}
    worst = min(ratios, key=ratios.get)
    print(
        json.dumps({"prepare_tokens_per_second": prepare_rate, "pipeline": pipeline, "model": models, "ratios": ratios})
    )
    print(f"smallest pipeline/model ratio: {ratios[worst]:.1f}x ({worst}); target >= 20x")


if __name__ == "__main__":
    main()
