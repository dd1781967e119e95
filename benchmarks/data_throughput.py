"""Can the input pipeline keep up? Tokens/s delivered by the pipeline vs consumed by the model.

Measures, in one run: the text pipeline (a generated corpus written into 16 .jsonl files and
prepared in-process with fbt-prepare's code, `text_plan` + `prepare_shard`, into a multi-file
ArrayRecord dataset, then read by the step-indexed loader with 2 worker processes and with a
prefetch thread), the synthetic word-problem task, and the tokens/s that the tiny and a bigger
CPU-sized model consume in a compiled K=1 train step (the fastest step, so the hardest to feed).
The text pipeline must deliver at least 20× what either model consumes; the word-problem task
(synthetic, not a prepared dataset) is reported but left out of that smallest ratio. How fast
preparing itself is, is prepare_throughput.py's to measure.

    python benchmarks/data_throughput.py [--batches 200] [--smoke] [--write-docs PATH]

Prints a table, the smallest text-pipeline/model ratio and, last, one JSON line with every figure.
`--smoke` runs the same code on a small corpus, a few batches and the tiny model only (seconds);
`--write-docs PATH` rewrites the `benchmarks/data_throughput.py` block of the Markdown file PATH
with the tables (see docs_block.py).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import docs_block  # noqa: E402

CORPUS_FILES = 16  # the text corpus's .jsonl files: the prepared dataset has a records file per unit


def corpus_documents(num_docs: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    words = [("".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), size=rng.integers(2, 9)))) for _ in range(2000)]
    return [" ".join(rng.choice(words, size=rng.integers(20, 800))) for _ in range(num_docs)]


def smallest_text_ratio(ratios: dict[str, float]) -> str:
    """The key of the smallest ratio of a text pipeline (the word-problem task is left out)."""
    text = {name: ratio for name, ratio in ratios.items() if name.startswith("text")}
    return min(text, key=text.get)


def pipeline_tokens_per_second(batches, num_batches: int, num_workers: int, warmup: int = 10) -> float:
    from fbt_jax.data.pipeline import batch_iterator

    iterator = batch_iterator(batches, 0, num_workers=num_workers, prefetch=4)
    for _ in range(warmup):  # start-up (worker spawn) is not throughput
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

    from fbt_jax.train.trainer import Trainer

    config.passes.schedule = "0:1"
    config.eval.num_batches = 0
    trainer = Trainer(config, log=lambda *_: None, devices=jax.devices()[:1])
    trainer.compile()
    trainer.init_state()
    batch = trainer.batch("train", 0, config.train.batch_size)
    program = trainer.programs.train[1]
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


def model_label(name: str, config) -> str:
    m = config.model
    return f"{name} (D={m.embed_dim}, L={m.num_layers}, B={config.train.batch_size}, T={config.data.seq_len})"


def main() -> None:
    from absl import flags

    flags.FLAGS.mark_as_parsed()
    args = docs_block.arguments(
        __doc__,
        "data_throughput",
        "tiny sizes and few batches: checks that it runs",
        extra=[("--batches", dict(type=int, default=200))],
    )
    num_docs, warmup, model_rounds = 3000, 10, 15
    if args.smoke:
        args.batches, num_docs, warmup, model_rounds = 5, 100, 2, 2

    from bench_configs import cpu_medium_config, tiny_config

    from fbt_jax.data import records
    from fbt_jax.data.documents import text_plan
    from fbt_jax.data.pipeline import StepBatches, TaskSplit
    from fbt_jax.data.preparation import prepare_shard
    from fbt_jax.data.tasks import make_task

    seq_len, batch_size = 128, 16
    docs = corpus_documents(num_docs)
    with tempfile.TemporaryDirectory() as tmp:
        corpus, prepared = os.path.join(tmp, "corpus"), os.path.join(tmp, "prep")
        os.makedirs(corpus)
        for i in range(CORPUS_FILES):
            with open(os.path.join(corpus, f"part-{i:02d}.jsonl"), "w", encoding="utf-8") as f:
                f.writelines(json.dumps({"text": doc}) + "\n" for doc in docs[i::CORPUS_FILES])
        plan = text_plan(f"{corpus}/*.jsonl", "byte", seq_len, 0.01)
        meta = prepare_shard(plan, prepared, log=lambda *_: None)
        train_files = len(records.split_files(meta, "train"))
        assert train_files > 1, f"the prepared dataset has {train_files} train file(s); the benchmark reads several"
        text = StepBatches(records.PackedRecords(prepared, "train"), batch_size, tuple(range(batch_size)), 0, True)
        pipeline = {
            "text, 2 workers": pipeline_tokens_per_second(text, args.batches, 2, warmup),
            "text, thread": pipeline_tokens_per_second(text, args.batches, 0, warmup),
        }
    task_config = tiny_config()
    task = StepBatches(TaskSplit(make_task(task_config), "train"), 32, tuple(range(32)), 0, True)
    pipeline["word problem, 2 workers"] = pipeline_tokens_per_second(task, args.batches, 2, warmup)
    pipeline["word problem, thread"] = pipeline_tokens_per_second(task, args.batches, 0, warmup)

    model_configs = (
        {"tiny": tiny_config()} if args.smoke else {"tiny": tiny_config(), "cpu_medium": cpu_medium_config()}
    )
    labels = {name: model_label(name, config) for name, config in model_configs.items()}
    models = {name: model_tokens_per_second(config, model_rounds) for name, config in model_configs.items()}

    print(f"text: {train_files} train records files prepared from {CORPUS_FILES} .jsonl files")
    print(f"{'pipeline':<26}{'tokens/s':>14}")
    for name, rate in pipeline.items():
        print(f"{name:<26}{rate:>14,.0f}")
    print(f"{'model (K=1 train step)':<26}{'tokens/s':>14}")
    for name, rate in models.items():
        print(f"{name:<26}{rate:>14,.0f}")
    ratios = {f"{p} / {m}": pipeline[p] / models[m] for p in pipeline for m in models}
    worst = smallest_text_ratio(ratios)
    print(f"smallest text-pipeline/model ratio: {ratios[worst]:.1f}x ({worst}); target >= 20x")
    results = {
        "text_batch": [batch_size, seq_len],
        "word_problem_batch": [32, task_config.data.seq_len],
        "text_train_files": train_files,
        "pipeline": pipeline,
        "model": models,
        "model_labels": labels,
        "ratios": ratios,
        "smallest_ratio": ratios[worst],
    }
    if args.write_docs:
        docs_block.write_block(args.write_docs, "data_throughput", docs_text(results, args.smoke))
    print(json.dumps(results))


def docs_text(results: dict, smoke: bool) -> str:
    """The Markdown block: pipeline and model tables, the prepare rate and the smallest ratio."""
    import jax

    pipeline_table = docs_block.table(
        ["pipeline", "tokens/s"], [[name, f"{rate:,.0f}"] for name, rate in results["pipeline"].items()]
    )
    model_table = docs_block.table(
        ["model (K=1 train step, one device)", "tokens/s"],
        [[results["model_labels"][name], f"{rate:,.0f}"] for name, rate in results["model"].items()],
    )
    worst = smallest_text_ratio(results["ratios"])
    (text_b, text_t), (task_b, task_t) = results["text_batch"], results["word_problem_batch"]
    notes = [
        f"Batches of {text_b} × {text_t} tokens (text) and {task_b} × {task_t} (word problem). The text "
        f"pipeline reads a byte-tokenised dataset of {results['text_train_files']} train records files, prepared "
        "in-process by fbt-prepare's code (how fast preparing is: benchmarks/prepare_throughput.py). "
        f"Smallest text-pipeline/model ratio: {results['smallest_ratio']:.1f}× ({worst}); target ≥ 20×. "
        "The word-problem task is synthetic, not a prepared dataset, and is left out of that ratio."
    ]
    machine = docs_block.machine_line(jax.devices()[:1], smoke=smoke)
    return docs_block.block(
        "data_throughput", docs_block.run_arguments(sys.argv[1:]), machine, [pipeline_table, model_table], notes
    )


if __name__ == "__main__":
    main()
