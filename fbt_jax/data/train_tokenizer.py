"""`fbt-train-tokenizer`: train a byte-level BPE tokenizer on a corpus, saved as a tokenizer.json;
or extend an existing tokenizer with the special tokens a chat template needs.

    fbt-train-tokenizer --input='corpus/*.jsonl.zst' --vocab-size=32768 --output=tokenizer.json
    fbt-train-tokenizer --from=runs/base/tokenizer --add-special-tokens='<|im_start|>,<|im_end|>' \
        --chat-template=chatml.jinja --output=tokenizers/chat

Training is for a model trained from scratch; a model that starts from a pretrained one uses that
model's tokenizer. The corpus is read as a stream by the same readers as fbt-prepare (any format it
takes); `--max-documents` bounds how much of it the trainer sees. The tokenizer ends documents with
`<|endoftext|>` (fbt-prepare appends it), covers every byte (any text round-trips) and is trained by
the `tokenizers` library's own trainer.

`--from` trains nothing: it writes a save_pretrained directory holding the tokenizer given (a
tokenizer.json or such a directory, whose other files are copied) with `--add-special-tokens`
appended as special tokens (ids after the last one) and `--chat-template` as its chat_template.jinja.
A model that starts from the old vocabulary grows to the new size with `init_from`
(`fbt_jax/init_from.py`: each new row starts at the mean of the old ones).
"""

from __future__ import annotations

import itertools
import json
import os
from typing import Any

from fbt_jax import paths
from fbt_jax.errors import ArgumentParser, ConfigError, reported

END_OF_TEXT = "<|endoftext|>"


def train_bpe(documents, vocab_size: int, output: str, specials: list[str] = ()) -> int:
    """Train on `documents` (an iterable of texts) and save to `output`, the end-of-text token and
    `specials` first; returns the vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT, *(t for t in specials if t != END_OF_TEXT)],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer)
    tokenizer.save(output)
    return tokenizer.get_vocab_size(with_added_tokens=True)


def extend(source: str, specials: list[str], template: str | None, output: str) -> list[str]:
    """Write `source` (a tokenizer.json or a save_pretrained directory) to the directory `output` with
    `specials` added as special tokens and `template` as its chat template; returns the tokens added
    (those of `specials` it did not have)."""
    import shutil

    from tokenizers import AddedToken, Tokenizer

    directory = source if os.path.isdir(source) else None
    tokenizer = Tokenizer.from_file(os.path.join(source, "tokenizer.json") if directory else source)
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    added = [token for token in specials if token not in vocab]
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in added])
    os.makedirs(output, exist_ok=True)
    for name in sorted(os.listdir(directory)) if directory else []:
        if name != "tokenizer.json" and os.path.isfile(os.path.join(directory, name)):
            shutil.copyfile(os.path.join(directory, name), os.path.join(output, name))
    tokenizer.save(os.path.join(output, "tokenizer.json"))
    config_file = os.path.join(output, "tokenizer_config.json")
    config = json.load(open(config_file, encoding="utf-8")) if os.path.isfile(config_file) else {}
    if "added_tokens_decoder" in config:  # transformers reads the added tokens from here too
        for token in added:
            config["added_tokens_decoder"][str(tokenizer.token_to_id(token))] = {
                "content": token, "lstrip": False, "normalized": False, "rstrip": False,
                "single_word": False, "special": True,
            }  # fmt: skip
    if template is not None:
        config.pop("chat_template", None)  # the file below is the template
        with open(os.path.join(output, "chat_template.jinja"), "w", encoding="utf-8") as f:
            f.write(template)
    if config or directory:
        with open(config_file, "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, ensure_ascii=False)
    return added


def main(argv: list[str] | None = None) -> None:
    """`fbt-train-tokenizer`: train a byte-level BPE tokenizer on a corpus, saved as a tokenizer.json;
    or (--from) extend a tokenizer with the special tokens a chat template needs."""
    parser = ArgumentParser(prog="fbt-train-tokenizer", description=main.__doc__)
    parser.add_argument("--input", help="the corpus, as fbt-prepare --input takes it")
    parser.add_argument(
        "--from", dest="source", help="extend this tokenizer (a tokenizer.json or a save_pretrained directory) instead"
    )
    parser.add_argument("--add-special-tokens", default="", help="comma-separated special tokens to add")
    parser.add_argument("--chat-template", help="with --from: a Jinja file saved as the tokenizer's chat template")
    parser.add_argument(
        "--output", required=True, help="the tokenizer.json to write (a local path); with --from, a new directory"
    )
    parser.add_argument("--vocab-size", type=int, default=32768, help="ids, the end-of-text token included")
    parser.add_argument("--text-key", default="text", help="the JSON field / Parquet column holding the text")
    parser.add_argument("--max-documents", type=int, default=0, help="train on at most this many (0: all)")
    with reported("fbt-train-tokenizer"):
        args = parser.parse_args(argv)
        specials = [t.strip() for t in args.add_special_tokens.split(",") if t.strip()]
        if bool(args.input) == bool(args.source):
            raise ConfigError(
                "give --input (a corpus to train on) or --from (a tokenizer to extend), not both or neither"
            )
        if args.source:
            extended(args, specials)
            return
        if args.chat_template:
            raise ConfigError("--chat-template is saved into a tokenizer directory: use it with --from")
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
        vocab = train_bpe(documents, args.vocab_size, output, specials)
    print(f"wrote {output}: a byte-level BPE tokenizer with {vocab:,} ids (end of document {END_OF_TEXT!r})")


def extended(args: Any, specials: list[str]) -> None:
    """`--from`: check the inputs, then write the extended tokenizer directory and say what a run sets."""
    from fbt_jax.data.tokenizers import load_tokenizer

    source = paths.resolve(args.source, "--from")
    before = load_tokenizer(source, "--from")  # a tokenizer it cannot read fails here, in one line
    template = None
    if args.chat_template:
        try:
            template = open(args.chat_template, encoding="utf-8").read()
        except OSError as err:
            raise ConfigError(
                f"--chat-template={args.chat_template!r} cannot be read ({err.strerror}); give a Jinja file"
            ) from None
    if not specials and template is None:
        raise ConfigError(
            "--from without --add-special-tokens or --chat-template would copy the tokenizer; name what to add"
        )
    output = paths.resolve(args.output, "--output")
    if paths.is_url(output) or os.path.isfile(output) or (os.path.isdir(output) and os.listdir(output)):
        raise ConfigError(f"--output={args.output!r} must be a new local directory (it is written whole)")
    added = extend(source, specials, template, output)
    after = load_tokenizer(output, "--output")  # what a run reads; its chat template is checked on use
    print(
        f"wrote {output}: {after.vocab_size:,} ids ({before.vocab_size:,} before; added {', '.join(added) or 'none'}); a run "
        f"starting from a model with fewer ids sets --config.model.vocab_size={after.vocab_size} with init_from"
    )


if __name__ == "__main__":
    main()
