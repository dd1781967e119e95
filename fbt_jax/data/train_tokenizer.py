"""`fbt-train-tokenizer`: train a byte-level BPE tokenizer on a corpus, saved as a tokenizer.json.

    fbt-train-tokenizer --input='corpus/*.jsonl.zst' --vocab-size=32768 --output=tokenizer.json

For a model trained from scratch; a model that starts from a pretrained one uses that model's
tokenizer.json instead. The corpus is read as a stream by the same readers as fbt-prepare (any
format it takes); `--max-documents` bounds how much of it the trainer sees. The tokenizer ends
documents with `<|endoftext|>` (fbt-prepare appends it), covers every byte (any text round-trips)
and is trained by the `tokenizers` library's own trainer.
"""

from __future__ import annotations

import itertools
import os

from fbt_jax import paths
from fbt_jax.errors import ArgumentParser, ConfigError, reported

END_OF_TEXT = "<|endoftext|>"


def train_bpe(documents, vocab_size: int, output: str) -> int:
    """Train on `documents` (an iterable of texts) and save to `output`; returns the vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer)
    tokenizer.save(output)
    return tokenizer.get_vocab_size(with_added_tokens=True)


def main(argv: list[str] | None = None) -> None:
    """`fbt-train-tokenizer`: train a byte-level BPE tokenizer on a corpus, saved as a tokenizer.json."""
    parser = ArgumentParser(prog="fbt-train-tokenizer", description=main.__doc__)
    parser.add_argument("--input", required=True, help="the corpus, as fbt-prepare --input takes it")
    parser.add_argument("--output", required=True, help="the tokenizer.json to write (a local path)")
    parser.add_argument("--vocab-size", type=int, default=32768, help="ids, the end-of-text token included")
    parser.add_argument("--text-key", default="text", help="the JSON field / Parquet column holding the text")
    parser.add_argument("--max-documents", type=int, default=0, help="train on at most this many (0: all)")
    with reported("fbt-train-tokenizer"):
        args = parser.parse_args(argv)
        if args.vocab_size < 257:
            raise ConfigError(f"--vocab-size={args.vocab_size} is too small; a byte-level BPE needs at least 257")
        output = paths.resolve(args.output, "--output")
        if paths.is_url(output):
            raise ConfigError(f"--output={args.output!r} must be a local file; copy it to the bucket afterwards")
        paths.check_output_dir(os.path.dirname(output), "--output")
        os.makedirs(os.path.dirname(output), exist_ok=True)
        paths.check_output_file(output, "--output")
        from fbt_jax.data.sources import check_input, list_inputs, read_documents

        files = list_inputs(paths.resolve_inputs(args.input, "--input"), "--input")
        for file in files:
            check_input(file, args.text_key, "--input")
        documents = (d for f in files for d in read_documents(f, args.text_key, "--input"))
        if args.max_documents > 0:
            documents = itertools.islice(documents, args.max_documents)
        vocab = train_bpe(documents, args.vocab_size, output)
    print(f"wrote {output}: a byte-level BPE tokenizer with {vocab:,} ids (end of document {END_OF_TEXT!r})")


if __name__ == "__main__":
    main()
