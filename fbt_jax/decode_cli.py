"""`fbt-decode`: generate from a trained run in standard, soft or fused mode.

    fbt-decode --checkpoint=runs/tiny --mode=soft --prompt="3 1 4 1 5"
    fbt-decode --checkpoint=runs/text --mode=fused --prompts-file=prompts.txt --output=generations.jsonl

Runs trained on text take text prompts (the run's tokenizer); runs on a built-in task take
space-separated token ids. One prompt per line in --prompts-file.
"""

from __future__ import annotations

import argparse
import json
import sys

import jax.numpy as jnp
import numpy as np

from fbt_jax import decode
from fbt_jax.errors import ConfigError


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="fbt-decode", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="a run's workdir or checkpoint directory")
    parser.add_argument("--mode", default="soft", help="standard | soft | fused")
    parser.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    parser.add_argument("--prompts-file", help="a file with one prompt per line")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--prefill-passes", type=int, default=2, help="passes of the fused prefill")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stop", type=int, action="append", default=[], help="stop token id (repeatable)")
    parser.add_argument("--output", help="write JSON lines here instead of printing")
    args = parser.parse_args(argv)
    try:
        if args.mode not in decode.MODES:
            raise ConfigError(f"--mode={args.mode!r} is unknown; use one of {decode.MODES}")
        prompts = list(args.prompt)
        if args.prompts_file:
            with open(args.prompts_file, encoding="utf-8") as f:
                prompts += [line.rstrip("\n") for line in f if line.strip()]
        if not prompts:
            raise ConfigError("no prompt given; use --prompt or --prompts-file")
        from fbt_jax.checkpoint import load_model

        model, config = load_model(args.checkpoint, log=lambda *_: None)
        encode, render = codec(config)
        encoded = [encode(p) for p in prompts]
        lengths = np.array([len(e) for e in encoded])
        padded = np.zeros((len(encoded), lengths.max()), np.int32)
        for i, ids in enumerate(encoded):
            padded[i, : len(ids)] = ids
        cache_len = int(lengths.max()) + args.max_new_tokens
        decode.check_request(model, padded, lengths, cache_len - args.max_new_tokens, args.mode)
        tokens, counts = decode.generate(
            model,
            jnp.asarray(padded),
            jnp.asarray(lengths),
            args.max_new_tokens,
            args.mode,
            prefill_passes=args.prefill_passes,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            stop_tokens=tuple(args.stop),
            seed=args.seed,
        )
    except ConfigError as err:
        print(f"fbt-decode: {err}", file=sys.stderr)
        sys.exit(2)
    tokens, counts = np.asarray(tokens), np.asarray(counts)
    lines = [
        json.dumps(
            {
                "prompt": p,
                "mode": args.mode,
                "tokens": tokens[i, : counts[i]].tolist(),
                "text": render(tokens[i, : counts[i]]),
            }
        )
        for i, p in enumerate(prompts)
    ]
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
        print(f"wrote {len(lines)} generations to {args.output}")
    else:
        print("\n".join(lines))


def codec(config):
    """(encode prompt → ids, ids → text) for the run's data."""
    if config.data.source == "task":

        def encode(text: str) -> list[int]:
            try:
                return [int(x) for x in text.split()]
            except ValueError:
                raise ConfigError(
                    f"prompt {text!r} is not space-separated token ids (this run trained on a task)"
                ) from None

        return encode, lambda ids: " ".join(str(int(i)) for i in ids)
    from fbt_jax.data.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(config.data.tokenizer)
    return (lambda text: tokenizer.encode(text)[:-1].tolist()), tokenizer.decode  # no end-of-document on prompts


if __name__ == "__main__":
    main()
