"""What tuning on chat data costs: a tuning step against a pretraining step of the same shape, and chat
preparation against text preparation of the same conversations.

    python benchmarks/tuning_cost.py [--rounds 7] [--smoke] [--write-docs docs/post-training.md]

The step: configs/tiny.py's model and batch shape, K = 2, the compiled production train step
(`fbt_jax.train.step.train_step`) once with a per-token fuse mask (chat rows: each row's reply fused
from a random start, loss on it alone) and once without (pretraining rows, fuse-from drawn). The mask is
data: one compiled program serves every mask, and the tuning step costs what the pretraining step
costs. Rounds interleave the two; medians.

Preparation: tests/chat/sample.jsonl's conversations (repeated), rendered by tests/chat/tokenizer's chat
template into ids and trained flags (`ConversationEncoder`), against encoding the same rendered texts
as plain text (`encode_batch`), in this process; records and tokens per second, medians over rounds.
Prints a table and, last, one JSON line with every figure. `--smoke`: 1 round, fewer steps and records.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import docs_block  # noqa: E402
from bench_configs import tiny_config  # noqa: E402
from flax import nnx  # noqa: E402

from fbt_jax.data.conversations import ConversationEncoder, settings  # noqa: E402
from fbt_jax.data.tokenizers import load_tokenizer  # noqa: E402
from fbt_jax.model import ModelConfig, build_model  # noqa: E402
from fbt_jax.train.step import TrainState, optimizer_with, step_constants, step_settings, train_step  # noqa: E402

CHAT = os.path.join(ROOT, "tests", "chat")


def step_seconds(rounds: int, steps: int) -> dict[str, list[float]]:
    """Per-step seconds of the K = 2 train step with and without a fuse mask, rounds interleaved."""
    config = tiny_config()
    model = build_model(ModelConfig.from_config(config.model), seed=0)
    graphdef, params = nnx.split(model, nnx.Param)
    tx = optimizer_with(config, lambda step: 1e-3)
    state = TrainState(step=jnp.asarray(0, jnp.int32), params=params, opt_state=tx.init(params))
    B, T, V = config.train.batch_size, config.data.seq_len, config.model.vocab_size
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, V, (B, T + 1), dtype=np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": np.ones((B, T), np.float32),
             "segment_ids": np.ones((B, T), np.int32), "positions": np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))}  # fmt: skip
    starts = rng.integers(1, T, (B, 1))
    fuse = (np.arange(T) >= starts).astype(np.int32)
    chat = {**batch, "fuse": fuse, "weights": fuse.astype(np.float32)}
    constants = {k: jnp.asarray(v) for k, v in step_constants(config).items()}
    make_tx = functools.partial(optimizer_with, config)
    step = functools.partial(
        train_step, graphdef=graphdef, make_tx=make_tx, settings=step_settings(config), num_passes=2
    )
    compiled = {
        name: jax.jit(step).lower(state, b, constants).compile()
        for name, b in (("pretraining", batch), ("tuning", chat))
    }
    masks = [np.roll(fuse, shift, axis=1) for shift in range(steps)]  # other masks, the same program
    times: dict[str, list[float]] = {"pretraining": [], "tuning": []}
    for _ in range(rounds):
        for name, program in compiled.items():
            start = time.perf_counter()
            for i in range(steps):
                b = batch if name == "pretraining" else {**chat, "fuse": masks[i]}
                out = program(state, b, constants)
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - start) / steps)
    return times


def preparation_rates(rounds: int, records: int) -> dict[str, dict[str, float]]:
    """Records and tokens per second: chat rendering with trained flags, and plain text encoding."""
    tokenizer = load_tokenizer(os.path.join(CHAT, "tokenizer"))
    with open(os.path.join(CHAT, "sample.jsonl"), encoding="utf-8") as f:
        sample = [json.loads(line) for line in f]
    rows = [(f"sample:{i}", sample[i % len(sample)]) for i in range(records)]
    chat = settings("chat", tokenizer)
    encoder = ConversationEncoder(chat, tokenizer, 4096)
    texts = [encoder.template.render(values["messages"])[0] for _, values in rows]
    out: dict[str, dict[str, list[float]]] = {
        "chat": {"records": [], "tokens": []},
        "text": {"records": [], "tokens": []},
    }
    for _ in range(rounds):
        start = time.perf_counter()
        docs = encoder.encode_batch(rows)
        seconds = time.perf_counter() - start
        out["chat"]["records"].append(records / seconds)
        out["chat"]["tokens"].append(sum(d.shape[1] for d in docs) / seconds)
        start = time.perf_counter()
        encoded = tokenizer.encode_batch(texts)
        seconds = time.perf_counter() - start
        out["text"]["records"].append(records / seconds)
        out["text"]["tokens"].append(sum(len(ids) for ids in encoded) / seconds)
    return {kind: {k: statistics.median(v) for k, v in figures.items()} for kind, figures in out.items()}


def main() -> None:
    args = docs_block.arguments(
        __doc__, "tuning_cost", "1 round, fewer steps and records: checks that it runs",
        extra=[("--rounds", {"type": int, "default": 7, "help": "interleaved rounds (medians over them)"})],
    )  # fmt: skip
    rounds = 1 if args.smoke else args.rounds
    times = step_seconds(rounds, 2 if args.smoke else 10)
    step = {name: statistics.median(t) for name, t in times.items()}
    ratio = step["tuning"] / step["pretraining"]
    prep = preparation_rates(rounds, 100 if args.smoke else 3000)
    config = tiny_config()
    shape = f"configs/tiny.py's model, batch {config.train.batch_size} × {config.data.seq_len} tokens, K = 2"
    step_table = docs_block.table(
        ["train step", "median per step", "tuning / pretraining"],
        [["pretraining rows (fuse-from drawn)", docs_block.ms(step["pretraining"]), "1.00"],
         ["chat rows (per-token fuse mask, loss on replies)", docs_block.ms(step["tuning"]), f"{ratio:.2f}"]],
    )  # fmt: skip
    prep_table = docs_block.table(
        ["preparation (in this process)", "records/s", "tokens/s"],
        [["chat: template render, ids, trained flags", f"{prep['chat']['records']:.0f}", docs_block.rate(prep["chat"]["tokens"])],
         ["text: the same rendered texts, encode_batch (parallel)", f"{prep['text']['records']:.0f}", docs_block.rate(prep["text"]["tokens"])]],
    )  # fmt: skip
    print(step_table + "\n\n" + prep_table)
    if args.write_docs:
        machine = docs_block.machine_line(jax.devices(), smoke=args.smoke)
        notes = [
            f"The step: {shape}, {rounds} interleaved rounds, medians. One compiled program runs every mask (the "
            "rounds feed it shifted masks): the mask is data, not a new program.",
            "Preparation renders each conversation through the Jinja template and encodes it with character "
            "offsets (for the mask), one record at a time; text preparation encodes a batch with the library's parallel encoder (every core), without offsets.",
        ]
        body = docs_block.block(
            "tuning_cost", docs_block.run_arguments(sys.argv[1:]), machine, [step_table, prep_table], notes
        )
        docs_block.write_block(args.write_docs, "tuning_cost", body)
    print(json.dumps({"step_seconds": step, "ratio": ratio, "preparation": prep}))


if __name__ == "__main__":
    main()
