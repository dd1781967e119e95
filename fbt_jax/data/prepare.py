"""`fbt-prepare`: tokenise and pack a text corpus or a TFDS dataset into fixed-length records.

    fbt-prepare --input='corpus/*.jsonl.zst' --output=data/corpus --seq-len=2048 --tokenizer=tokenizer.json --workers=8

Many machines share the work by running the same command with `--num-shards`/`--shard-index`
(taken from a SLURM array or a TPU VM's worker id when not given) into one `--output`; the shard
that finishes last writes the manifest. The same command resumes a killed preparation. Prepared
data is never overwritten (`preparation.py` has how, `records.py` the format).
"""

from __future__ import annotations

import json
import signal
from typing import Any

from fbt_jax import paths
from fbt_jax.data.documents import text_plan, tfds_plan
from fbt_jax.data.preparation import prepare_shard, progress_path
from fbt_jax.data.shards import shard_from_env
from fbt_jax.errors import ArgumentParser, ConfigError, Preempted, reported


def _preempted(signum: int, frame: object) -> None:
    raise Preempted("fbt-prepare stopped on SIGTERM; run the same command again to prepare the missing units")


def main(argv: list[str] | None = None) -> None:
    """`fbt-prepare`: tokenise and pack a text corpus or a TFDS dataset into fixed-length records."""
    parser = ArgumentParser(prog="fbt-prepare", description=main.__doc__)
    parser.add_argument(
        "--output", required=True, help="directory to write, local or gs:// (a new one, or one to resume)"
    )
    parser.add_argument("--seq-len", type=int, required=True, help="tokens per example (the model's data.seq_len)")
    parser.add_argument(
        "--input",
        help="comma-separated globs of .txt/.jsonl/.jsonl.gz/.jsonl.zst/.parquet files (local or gs://), or @FILE listing them",
    )
    parser.add_argument(
        "--tokenizer", default="byte", help="'byte', a SentencePiece .model, a tokenizer.json or a save_pretrained dir"
    )
    parser.add_argument("--text-key", default="text", help="the JSON field / Parquet column holding the text")
    parser.add_argument(
        "--format", default="text", help="text | chat (records with 'messages') | prompt-completion (two fields)"
    )
    parser.add_argument("--chat-template", help="a Jinja chat template file (default: the tokenizer's own)")
    parser.add_argument("--fields", default="", help="the record fields read: 'messages', or 'prompt,completion'")
    parser.add_argument(
        "--turns", default="split", help="multi-turn chat: split (each reply in its own segment) | joint"
    )
    parser.add_argument("--overlong", default="drop", help="a conversation over seq_len + 1 tokens: drop | truncate")
    parser.add_argument("--show", type=int, default=0, help="print the first N records as trained, write nothing")
    parser.add_argument("--validation-fraction", type=float, default=0.01, help="share of text documents held out")
    parser.add_argument("--workers", type=int, default=1, help="processes tokenising in parallel on this machine")
    parser.add_argument("--num-shards", type=int, help="machines sharing the work (default: SLURM array / TPU slice)")
    parser.add_argument("--shard-index", type=int, help="this machine's shard, 0..num-shards-1 (default: from env)")
    parser.add_argument("--tfds-name", help="a prepared TFDS dataset (name[:version]) instead of --input")
    parser.add_argument("--tfds-data-dir", help="its data_dir (local or gs://)")
    parser.add_argument("--tfds-splits", default="train,validation", help="TFDS splits used as train,validation")
    with reported("fbt-prepare"):
        args = parser.parse_args(argv)
        signal.signal(signal.SIGTERM, _preempted)  # a scheduler's stop: exit 75, the same command resumes
        output = paths.resolve(args.output, "--output")
        paths.check_reachable(output, "--output", writable=True)
        paths.check_output_dir(output, "--output")
        if args.seq_len < 2:
            raise ConfigError(f"--seq-len {args.seq_len} is too short; use at least 2")
        if args.workers < 1:
            raise ConfigError(f"--workers={args.workers} must be at least 1 (the processes that tokenise in parallel)")
        num_shards, shard_index, _ = shard_from_env(args.num_shards, args.shard_index)
        if bool(args.input) == bool(args.tfds_name):
            raise ConfigError("give exactly one of --input (text files) or --tfds-name (a TFDS dataset)")
        tokenizer = args.tokenizer if args.tokenizer == "byte" else paths.resolve(args.tokenizer, "--tokenizer")
        if args.format != "text" and not args.input:
            raise ConfigError(f"--format={args.format} reads records from --input files (.jsonl or .parquet)")
        if args.input:
            spec = paths.resolve_inputs(args.input, "--input")
            chat = chat_settings(args, tokenizer)
            if args.show > 0:
                return show_records(spec, chat, tokenizer, args.seq_len, args.show)
            plan = text_plan(
                spec, tokenizer, args.seq_len, args.validation_fraction, args.text_key, "--input",
                "--validation-fraction", "--tokenizer", chat,
            )  # fmt: skip
        else:
            if args.tfds_splits.count(",") != 1:
                raise ConfigError(f"--tfds-splits={args.tfds_splits!r} must name two splits: train,validation")
            data_dir = paths.resolve(args.tfds_data_dir or "", "--tfds-data-dir")
            splits = tuple(args.tfds_splits.split(","))
            plan = tfds_plan(args.tfds_name, data_dir, args.text_key, splits, tokenizer, args.seq_len, "--tokenizer")
        meta = prepare_shard(plan, output, num_shards, shard_index, args.workers, progress=True)
    if meta is None:
        from fbt_jax.data import store

        plan = store.read_json(store.join(output, "prepare.json")) or plan  # the plan in force (units kept)
        done = sum(store.exists(progress_path(output, u)) for u in range(len(plan["units"])))
        print(
            f"shard {shard_index} of {num_shards} is prepared ({done} of {len(plan['units'])} units of the dataset); "
            f"the shard that finishes last writes {output}/meta.json"
        )
        return
    if "chat_counts" in meta:
        c = meta["chat_counts"]
        print(
            f"{c['conversations']:,} {args.format} records, {c['replies']:,} replies ({args.turns}); over-long "
            f"(> seq_len + 1 = {args.seq_len + 1} tokens): {c['dropped']:,} dropped, {c['truncated']:,} truncated"
        )
    print(
        f"wrote {meta['records']['train']:,} train and {meta['records']['validation']:,} validation records "
        f"({meta['tokens']['train']:,} + {meta['tokens']['validation']:,} tokens, vocab {meta['vocab_size']}) "
        f"to {output}; train with --config.data.source=text --config.data.path={output} "
        f"--config.data.seq_len={args.seq_len} --config.model.vocab_size={meta['vocab_size']} (or larger)"
    )


def chat_settings(args: Any, tokenizer_spec: str) -> dict[str, Any] | None:
    """The preparation's chat settings (None for text), every choice checked before any work."""
    from fbt_jax.data.conversations import settings
    from fbt_jax.data.tokenizers import load_tokenizer

    if args.format == "text":
        if args.chat_template or args.show:
            raise ConfigError("--chat-template and --show are for --format=chat or prompt-completion")
        return None
    fields = tuple(f.strip() for f in args.fields.split(",") if f.strip())
    template = paths.resolve(args.chat_template, "--chat-template") if args.chat_template else None
    tokenizer = load_tokenizer(tokenizer_spec, "--tokenizer")
    return settings(args.format, tokenizer, template, fields, args.turns, args.overlong)


def show_records(spec: str, chat: dict[str, Any], tokenizer_spec: str, seq_len: int, count: int) -> None:
    """`--show=N`: the first N records as they would be trained, one JSON line each ({"ids", "loss_weights"}),
    then a readable view with the trained text between ⟦ and ⟧. Writes nothing."""
    from fbt_jax.data.conversations import ConversationEncoder
    from fbt_jax.data.sources import list_inputs, read_documents
    from fbt_jax.data.tokenizers import load_tokenizer

    encoder = ConversationEncoder(chat, load_tokenizer(tokenizer_spec, "--tokenizer"), seq_len)
    views = []
    for file in list_inputs(spec, "--input"):
        for where, values in read_documents(file, tuple(chat["keys"]), "--input"):
            line, view = encoder.show(where, values)
            print(json.dumps(line), flush=True)
            views.append(f"--- {where}: {len(line['ids'])} tokens, {sum(line['loss_weights'])} trained\n{view}")
            if len(views) == count:
                break
        if len(views) == count:
            break
    print("\n".join(views))


if __name__ == "__main__":
    main()
