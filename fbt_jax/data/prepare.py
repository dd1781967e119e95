"""`fbt-prepare`: tokenise and pack a text corpus or a TFDS dataset into fixed-length records.

    fbt-prepare --input='corpus/*.txt' --output=data/corpus --seq-len=256

The output directory is written atomically and never overwritten (`records.py` has the format).
"""

from __future__ import annotations

import os
import tempfile

from fbt_jax import paths
from fbt_jax.data.documents import text_split_documents, tfds_split_documents
from fbt_jax.data.records import prepare, upload_dir
from fbt_jax.data.tokenizers import load_tokenizer
from fbt_jax.errors import ArgumentParser, ConfigError, reported


def main(argv: list[str] | None = None) -> None:
    """`fbt-prepare`: tokenise and pack a text corpus or a TFDS dataset into fixed-length records."""
    parser = ArgumentParser(prog="fbt-prepare", description=main.__doc__)
    parser.add_argument("--output", required=True, help="directory to write (must not exist yet)")
    parser.add_argument("--seq-len", type=int, required=True, help="tokens per example (the model's data.seq_len)")
    parser.add_argument(
        "--input", help="glob of text files (.jsonl: one {'text': ...} per line; others: one document per file)"
    )
    parser.add_argument("--tokenizer", default="byte", help="'byte' or a SentencePiece .model path")
    parser.add_argument("--validation-fraction", type=float, default=0.01, help="share of text documents held out")
    parser.add_argument("--tfds-name", help="a prepared TFDS dataset (name[:version]) instead of --input")
    parser.add_argument("--tfds-data-dir", help="its data_dir (local or gs://)")
    parser.add_argument("--tfds-text-key", default="text")
    parser.add_argument("--tfds-splits", default="train,validation", help="TFDS splits used as train,validation")
    with reported("fbt-prepare"):
        args = parser.parse_args(argv)
        output = paths.resolve(args.output, "--output")
        if paths.is_url(output):
            paths.check_reachable(output, "--output")
            from etils import epath

            if epath.Path(output).exists():
                raise ConfigError(
                    f"--output {output} already exists; choose a new directory (prepared data is never overwritten)"
                )
        else:
            if os.path.exists(output):
                raise ConfigError(
                    f"--output {output} already exists; choose a new directory (prepared data is never overwritten)"
                )
            paths.check_output_dir(output, "--output")
        if args.seq_len < 2:
            raise ConfigError(f"--seq-len {args.seq_len} is too short; use at least 2")
        if bool(args.input) == bool(args.tfds_name):
            raise ConfigError("give exactly one of --input (text files) or --tfds-name (a TFDS dataset)")
        tokenizer = args.tokenizer if args.tokenizer == "byte" else paths.resolve(args.tokenizer, "--tokenizer")
        load_tokenizer(tokenizer, "--tokenizer")  # a bad tokenizer fails here, before reading any data
        if args.input:
            documents, source = text_split_documents(
                paths.resolve(args.input, "--input"), args.validation_fraction, "--input", "--validation-fraction"
            )
        else:
            if args.tfds_splits.count(",") != 1:
                raise ConfigError(f"--tfds-splits={args.tfds_splits!r} must name two splits: train,validation")
            train_split, validation_split = args.tfds_splits.split(",")
            data_dir = paths.resolve(args.tfds_data_dir or "", "--tfds-data-dir")
            documents, source = tfds_split_documents(
                args.tfds_name, data_dir, args.tfds_text_key, train_split, validation_split
            )
        if paths.is_url(output):
            with tempfile.TemporaryDirectory(prefix="fbt-prepare-") as staging:
                local = os.path.join(staging, "prepared")
                meta = prepare(documents, tokenizer, args.seq_len, local, source, progress=True)
                upload_dir(local, output)
        else:
            meta = prepare(documents, tokenizer, args.seq_len, output, source, progress=True)
    print(
        f"wrote {meta['records']['train']:,} train and {meta['records']['validation']:,} validation records "
        f"({meta['tokens']['train']:,} + {meta['tokens']['validation']:,} tokens, vocab {meta['vocab_size']}) "
        f"to {output}; train with --config.data.source=text --config.data.path={output} "
        f"--config.data.seq_len={args.seq_len} --config.model.vocab_size={meta['vocab_size']}"
    )


if __name__ == "__main__":
    main()
