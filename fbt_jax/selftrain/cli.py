"""`fbt-self-train`: rounds of sampling a tuned run's answers, keeping its shortest correct ones, and
tuning on them (configs/self_train.py; docs/post-training.md, "Self-training").

fbt-self-train --config=configs/self_train.py:runs/chat --config.self_train.tasks=gsm8k@train.jsonl \\
    --config.self_train.held_out=gsm8k@test.jsonl

Run the same command again to continue a stopped run: every stage resumes where it stopped.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import tempfile

import jax
import ml_collections

from fbt_jax import distributed
from fbt_jax.config import resolve_config_paths
from fbt_jax.errors import ConfigError, divert_library_noise, reported
from fbt_jax.selftrain import loop, report

PROG = "fbt-self-train"
TEMPLATE = "chat_template.jinja"


def main(argv: list[str]) -> None:
    from fbt_jax.train.cli import flagged_config, sigterm_is_a_preemption

    del argv
    config = flagged_config()
    with reported(PROG):
        if "self_train" not in config:
            raise ConfigError("this config has no self_train section; start from configs/self_train.py:RUN")
        resolve_config_paths(config)
        loop.check(config)
        with sigterm_is_a_preemption() as after_distributed:
            # jax.distributed first: reading the starting run below already starts the backend.
            after_distributed(distributed.initialize(config.distributed))
            os.makedirs(config.workdir, exist_ok=True)
            keep_template(config)
            check_tuning(config)  # every field of the tuning runs, before a sample is drawn
            loop.claim_workdir(config)
            divert_library_noise(os.path.join(config.workdir, f"{PROG}.log"))
            figures = loop.Loop(config).run()
    if jax.process_index() == 0:
        print(report.markdown(figures), end="")
        print(f"wrote {os.path.join(config.workdir, 'rounds.json')}, rounds.md and rounds.png")


def keep_template(config: ml_collections.ConfigDict) -> None:
    """The chat template the starting run was tuned with, kept in the workdir as the tuning rounds'
    `data.chat_template` (a template given in the config is used as it is)."""
    if not config.self_train.chat or config.data.chat_template:
        return
    from fbt_jax.data.plan import plan_data, run_chat_template
    from fbt_jax.trained import read_run_config

    start, _ = read_run_config(config.init_from, "--config.init_from")
    source = run_chat_template(start, plan_data(start, read_data=False).tokenizer)
    if source is None:
        raise ConfigError(
            f"self_train.chat: the run {config.init_from} has no chat template (not tuned on chat data, none with its "
            "tokenizer); give one (--config.data.chat_template=FILE) or set --config.self_train.chat=False"
        )
    path = os.path.join(config.workdir, TEMPLATE)
    fd, draft = tempfile.mkstemp(prefix=".draft-", dir=config.workdir)  # whole, also with several processes
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(source)
    os.replace(draft, path)
    config.data.chat_template = path


def check_tuning(config: ml_collections.ConfigDict) -> None:
    """validate_config on round 1's tuning config, its data (the kept answers, not sampled yet) planned
    from the tokenizer alone."""
    from fbt_jax.data.plan import chat_settings, plan_data
    from fbt_jax.validation import validate_config

    tuning = loop.tuning_config(config, 1, config.init_from)
    chat_settings(tuning.data)  # the template renders and marks replies: checked as fbt-prepare would
    plan = plan_data(tuning, read_data=False)
    plan = dataclasses.replace(
        plan, vocab_size=plan.tokenizer.vocab_size, vocab_origin=f"data.tokenizer={tuning.data.tokenizer!r}"
    )
    validate_config(tuning, data=plan)


def cli() -> None:
    from absl import app, flags
    from ml_collections import config_flags

    from fbt_jax.train.cli import parse_flags

    config_flags.DEFINE_config_file("config", None, "configs/self_train.py:RUN, the run to start from.")
    flags.mark_flags_as_required(["config"])
    app.run(main, flags_parser=functools.partial(parse_flags, prog=PROG))


if __name__ == "__main__":
    cli()
