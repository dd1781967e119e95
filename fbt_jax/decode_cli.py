"""`fbt-decode`: generate from a trained run in standard, soft or fused mode.

    fbt-decode --checkpoint=runs/tiny --mode=soft --prompt="3 1 4 1 5"
    fbt-decode --checkpoint=runs/text --mode=fused --prompts-file=prompts.txt --output=generations.jsonl

Runs trained on text take text prompts (the run's tokenizer); runs on a built-in task take
space-separated token ids. One prompt per line in --prompts-file.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax.numpy as jnp
import numpy as np

from fbt_jax import decode, paths
from fbt_jax.errors import ArgumentParser, ConfigError, divert_library_noise, reported

if TYPE_CHECKING:
    from fbt_jax.data.plan import DataPlan


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="fbt-decode", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="a run's workdir or checkpoint directory")
    parser.add_argument("--mode", default="soft", help="standard | soft | fused")
    parser.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    parser.add_argument("--prompts-file", help="a file with one prompt per line")
    parser.add_argument(
        "--max-new-tokens", type=int, default=None, help="tokens to generate (default: up to the context length)"
    )
    parser.add_argument(
        "--context-len", type=int, default=0, help="longest prompt + new tokens (default: the run's data.seq_len)"
    )
    parser.add_argument("--prefill-passes", type=int, default=2, help="passes of the fused prefill")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stop", type=int, action="append", default=[], help="stop token id (repeatable)")
    parser.add_argument("--output", help="write JSON lines here instead of printing")
    with reported("fbt-decode"):
        args = parser.parse_args(argv)
        output = check_args(args)
        prompts = read_prompts(args)
        from fbt_jax.data.plan import plan_data
        from fbt_jax.run_services import use_run_cache
        from fbt_jax.trained import load_model

        # Reading damaged checkpoints makes the storage libraries print tracebacks from their
        # threads ("Event loop is closed"); the failure is reported as one line instead.
        divert_library_noise(os.devnull)

        checkpoint = paths.resolve(args.checkpoint, "--checkpoint")
        model, config = load_model(checkpoint, log=lambda *_: None)
        use_run_cache(config, checkpoint, log=lambda line: print(line, file=sys.stderr))
        data = plan_data(config, read_data=False)  # the run's tokenizer and context; its data is not read
        encode, render = codec(data)
        encoded = [encode(p) for p in prompts]
        lengths = np.array([len(e) for e in encoded])
        context = args.context_len or data.seq_len
        if args.max_new_tokens is None:  # fill the context the run trained on
            args.max_new_tokens = int(context - lengths.max())
            if args.max_new_tokens is not None and args.max_new_tokens < 1:
                raise ConfigError(
                    f"a prompt of {lengths.max()} tokens fills the context of {context} tokens; shorten the prompt "
                    "or raise --context-len"
                )
        if lengths.max() + args.max_new_tokens > context:
            raise ConfigError(
                f"a prompt of {lengths.max()} tokens + --max-new-tokens={args.max_new_tokens} exceeds the context of "
                f"{context} tokens (the run trained on {data.seq_len}); shorten the prompt or the generation, "
                "or raise --context-len"
            )
        padded = np.zeros((len(encoded), lengths.max()), np.int32)
        for i, ids in enumerate(encoded):
            padded[i, : len(ids)] = ids
        vocab = model.cfg.vocab_size
        for stop in args.stop:
            if not 0 <= stop < vocab:
                raise ConfigError(
                    f"--stop={stop} is outside the vocabulary [0, {vocab}); give a token id below {vocab}"
                )
        stops = tuple(args.stop)
        if data.source != "task":  # text: a generation ends with its document
            stops += (data.tokenizer.eos_id,)
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
            stop_tokens=stops,
            seed=args.seed,
        )
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
        if output:
            try:
                with open(output, "w", encoding="utf-8") as f:
                    f.write("\n".join(lines) + "\n")
            except OSError as err:
                raise ConfigError(
                    f"--output={args.output!r} cannot be written ({err.strerror}); choose another path"
                ) from None
            print(f"wrote {len(lines)} generations to {output}")
        else:
            print("\n".join(lines))


def check_args(args: argparse.Namespace) -> str:
    """One-line errors for bad flags, before a checkpoint is read; returns the resolved --output."""
    if args.mode not in decode.MODES:
        raise ConfigError(f"--mode={args.mode!r} is unknown; use one of {decode.MODES}")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens={args.max_new_tokens} must be at least 1")
    if args.context_len < 0:
        raise ConfigError(f"--context-len={args.context_len} is negative; use 0 for the run's data.seq_len")
    if args.prefill_passes < 1:
        raise ConfigError(f"--prefill-passes={args.prefill_passes} must be at least 1")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise ConfigError(f"--temperature={args.temperature} must be a finite number >= 0 (0 = greedy)")
    if args.top_k < 0:
        raise ConfigError(f"--top-k={args.top_k} is negative; use 0 for no top-k filter")
    if not (math.isfinite(args.top_p) and 0 < args.top_p <= 1):
        raise ConfigError(f"--top-p={args.top_p} must be in (0, 1]")
    output = ""
    if args.output:
        output = paths.resolve(args.output, "--output")
        paths.check_output_file(output, "--output")
    return output


def read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt)
    if args.prompts_file:
        path = paths.resolve(args.prompts_file, "--prompts-file")
        try:
            with open(path, encoding="utf-8") as f:
                prompts += [line.rstrip("\n") for line in f if line.strip()]
        except UnicodeDecodeError as err:
            raise ConfigError(f"--prompts-file={args.prompts_file!r} is not UTF-8 text ({err.reason})") from None
        except OSError as err:
            raise ConfigError(f"--prompts-file={args.prompts_file!r} cannot be read ({err.strerror})") from None
    if any(not p.strip() for p in prompts):
        raise ConfigError("a --prompt is empty; every prompt needs at least one token")
    if not prompts:
        raise ConfigError("no prompt given; use --prompt or --prompts-file")
    return prompts


def codec(data: DataPlan) -> tuple[Callable[[str], list[int]], Callable[[Any], str]]:
    """(encode prompt → ids, ids → text) for the run's data."""
    if data.source == "task":

        def encode(text: str) -> list[int]:
            try:
                return [int(x) for x in text.split()]
            except ValueError:
                raise ConfigError(
                    f"prompt {text!r} is not space-separated token ids (this run trained on a task)"
                ) from None

        return encode, lambda ids: " ".join(str(int(i)) for i in ids)
    tokenizer = data.tokenizer
    return tokenizer.encode_prompt, tokenizer.decode  # prompts: no end-of-document (a beginning one if it adds one)


if __name__ == "__main__":
    main()
