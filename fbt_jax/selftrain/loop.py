"""The self-training loop: R rounds of sample → keep → tune → evaluate, each stage resumable.

Every stage continues what a killed attempt left (`rounds.py` has the files):
- sampling is fbt-eval's generative evaluation of the training problems in `self_train.mode`, which
  continues its generations file where it stopped; each row's seed derives from (round, task,
  problem, sample) alone, so a resumed or re-sharded sampling draws the same samples;
- the kept set is a function of the samples, written whole once every shard has sampled;
- tuning is an fbt-train run (`init_from` the previous round), which resumes bitwise from its
  checkpoints;
- the held-out evaluation continues like the sampling.

With several processes (one per host, as fbt-train runs) each samples and evaluates its share of
the problems (every count-th, from its index) on its own devices, into its own shard directory of
the shared workdir; they meet before the kept set is written and before each round's figures, and
tune as one run.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from typing import Any

import jax
import ml_collections

from fbt_jax import decode, paths
from fbt_jax.config import config_from_dict
from fbt_jax.data import store
from fbt_jax.evals import builtin
from fbt_jax.evals.runner import EvalSettings
from fbt_jax.evals.spec import load_spec, read_problems
from fbt_jax.run_services import compilation_cache_dir
from fbt_jax.selftrain import report, rounds

SECONDS = "seconds.json"  # per round: wall seconds of each stage, summed over attempts
RECORD = "self_train.json"  # the config whose numbers the workdir holds
GROWS = ("self_train.rounds", "self_train.batch_size")  # may change on a rerun: more rounds, other batches


def sampling_settings(config: ml_collections.ConfigDict, r: int) -> EvalSettings:
    """Round r's sampling: its own seed (every round draws anew), the loop's mode and sampler."""
    st = config.self_train
    return EvalSettings(
        tasks=names(st.tasks), modes=(st.mode,), samples=st.samples, pass_at=(1,), temperature=st.temperature,
        top_p=st.top_p, top_k=st.top_k, seed=1000 * config.seed + r, max_new_tokens=st.max_new_tokens,
        num_problems=st.num_problems, prefill_passes=st.prefill_passes, chat=st.chat,
    )  # fmt: skip


def held_out_settings(config: ml_collections.ConfigDict) -> EvalSettings:
    """The held-out evaluation, the same every round: greedy, one answer per problem and mode."""
    st = config.self_train
    return EvalSettings(
        tasks=names(st.held_out), modes=names(st.eval_modes), seed=config.seed, max_new_tokens=st.max_new_tokens,
        num_problems=st.held_out_problems, prefill_passes=st.prefill_passes, chat=st.chat,
    )  # fmt: skip


def names(text: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in text.split(",") if t.strip())


def prompts(settings: EvalSettings) -> dict[tuple[str, str], str]:
    """(task, problem id) → the problem's rendered prompt (the user turn of its tuning record)."""
    found = {}
    for arg in settings.tasks:
        name_or_spec, _, problems_path = arg.partition("@")
        spec = load_spec(name_or_spec)
        for problem in read_problems(spec, problems_path or spec.problems, settings.num_problems):
            found[(spec.name, problem.id)] = problem.prompt
    return found


def tuning_config(config: ml_collections.ConfigDict, r: int, previous: str) -> ml_collections.ConfigDict:
    """Round r's fbt-train config: the loop's own config without its `self_train` section, in
    `round-r/run`, from the previous round's weights, on the round's kept records."""
    tuning = config_from_dict(config.to_dict())
    tuning.workdir = os.path.join(rounds.round_dir(config.workdir, r), "run")
    tuning.init_from = previous
    tuning.data.source = "text"
    tuning.data.path = os.path.join(rounds.round_dir(config.workdir, r), "kept.jsonl")
    tuning.data.format = "chat" if config.self_train.chat else "prompt-completion"
    # One compilation cache for every round (the same programs, other weights), and for their
    # evaluations, which use the cache a run names.
    tuning.train.compilation_cache_dir = compilation_cache_dir(config)
    return tuning


def sync(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


class Loop:
    """One `fbt-self-train` run: its config (with `self_train`), this process's shard, a log."""

    def __init__(self, config: ml_collections.ConfigDict, log: Any = print):
        self.config, self.log = config, log
        self.shard = (jax.process_index(), jax.process_count())

    def run(self) -> list[dict[str, Any]]:
        """Every round not yet done, from round 0 (the starting weights' held-out figures); returns
        every round's figures."""
        st = self.config.self_train
        self.round(0, self.config.init_from)
        for r in range(1, st.rounds + 1):
            previous = self.config.init_from if r == 1 else self.run_dir(r - 1)
            self.round(r, previous)
        figures = [store.read_json(os.path.join(rounds.round_dir(self.config.workdir, r), "round.json"))
                   for r in range(st.rounds + 1)]  # fmt: skip
        if self.shard[0] == 0:
            report.write(self.config.workdir, figures)
        return figures

    def run_dir(self, r: int) -> str:
        return os.path.join(rounds.round_dir(self.config.workdir, r), "run")

    def round(self, r: int, previous: str) -> None:
        directory = rounds.round_dir(self.config.workdir, r)
        if os.path.exists(os.path.join(directory, "round.json")):
            return
        samples = kept = None
        if r > 0:
            kept_path = os.path.join(directory, "kept.jsonl")
            if not os.path.exists(kept_path):
                with self.timed(r, "sampling"):
                    self.evaluate(previous, os.path.join(directory, "samples"), sampling_settings(self.config, r))
                sync(f"self-train round {r}: sampled")
                if self.shard[0] == 0:
                    self.write_kept(r, kept_path)
                sync(f"self-train round {r}: kept")
            samples = rounds.read_generations(os.path.join(directory, "samples"), self.shard[1])
            kept = rounds.read_jsonl(kept_path)
            if not os.path.exists(os.path.join(directory, "tuned.json")):
                with self.timed(r, "tuning"):
                    self.tune(r, previous, len(kept))
            checkpoint = self.run_dir(r)
        else:
            checkpoint = previous
        held_out = os.path.join(directory, "held-out")
        with self.timed(r, "held_out"):
            self.evaluate(checkpoint, held_out, held_out_settings(self.config))
        sync(f"self-train round {r}: evaluated")
        if self.shard[0] == 0:
            records = rounds.read_generations(held_out, self.shard[1])
            seconds = store.read_json(os.path.join(directory, SECONDS)) or {}
            figures = rounds.summarize(r, records, samples, kept, seconds)
            store.write_json(os.path.join(directory, "round.json"), figures, staging=directory)
            self.log(report.line(figures))
        sync(f"self-train round {r}: written")

    def evaluate(self, checkpoint: str, directory: str, settings: EvalSettings) -> None:
        """fbt-eval's generative evaluation of this process's share of the problems (continued)."""
        from fbt_jax.evals.evaluation import evaluate_tasks

        output = os.path.join(directory, rounds.shard_name(*self.shard))
        os.makedirs(output, exist_ok=True)
        evaluate_tasks(checkpoint, output, settings, self.config.self_train.batch_size, progress=False,
                       shard=self.shard)  # fmt: skip

    def write_kept(self, r: int, path: str) -> None:
        """The kept set of round r's samples, written whole (then the round tunes on it)."""
        settings = sampling_settings(self.config, r)
        samples = rounds.read_generations(os.path.join(os.path.dirname(path), "samples"), self.shard[1])
        prompt_of = prompts(settings)
        order = {key: i for i, key in enumerate(prompt_of)}  # the problems' own order, whatever the shards
        samples.sort(key=lambda s: (order[(s["task"], s["id"])], int(s["sample"])))
        kept = rounds.keep(samples, self.config.self_train.keep)
        lines = [rounds.tuning_record(s, prompt_of[(s["task"], s["id"])], settings.chat) for s in kept]
        rounds.write_jsonl(path, lines)
        self.log(f"round {r}: kept {len(kept)} of {len(samples)} samples ({self.config.self_train.keep} correct)")

    def tune(self, r: int, previous: str, kept: int) -> None:
        from fbt_jax.errors import ConfigError
        from fbt_jax.train.trainer import Trainer

        if kept == 0:
            raise ConfigError(
                f"round {r}: no sample of any training problem was correct, so there is nothing to tune on; "
                "sample more (self_train.samples, self_train.temperature) or start from a better run"
            )
        config = tuning_config(self.config, r, previous)
        summary = Trainer(config, log=self.log).train(progress=False)
        if self.shard[0] == 0:
            directory = rounds.round_dir(self.config.workdir, r)
            kept_summary = {k: summary[k] for k in ("steps", "train_seconds") if k in summary}
            store.write_json(os.path.join(directory, "tuned.json"), kept_summary, staging=directory)
        sync(f"self-train round {r}: tuned")

    @contextlib.contextmanager
    def timed(self, r: int, stage: str) -> Iterator[None]:
        """Adds the stage's wall seconds to the round's seconds.json (process 0), also when it fails."""
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.shard[0] == 0:
                directory = rounds.round_dir(self.config.workdir, r)
                seconds = store.read_json(os.path.join(directory, SECONDS)) or {}
                seconds[stage] = seconds.get(stage, 0.0) + time.perf_counter() - start
                store.write_json(os.path.join(directory, SECONDS), seconds, staging=directory)


def claim_workdir(config: ml_collections.ConfigDict) -> None:
    """The workdir for this config: a new one records it; one holding the same loop is continued (its
    rounds may grow); one holding another is refused in one line, before anything is read."""
    from fbt_jax.errors import ConfigError
    from fbt_jax.workdir import trajectory_fields

    record = json.loads(config.to_json_best_effort())
    fields = {**trajectory_fields(record), "init_from": config.init_from}
    fields = {k: v for k, v in fields.items() if k not in GROWS}
    path = os.path.join(config.workdir, RECORD)
    saved = store.read_json(path)
    if saved is None:
        store.write_json(path, fields, staging=config.workdir)
        return
    changed = [f"{k}: {saved.get(k)!r} -> {fields.get(k)!r}" for k in sorted(set(saved) | set(fields))
               if saved.get(k) != fields.get(k)]  # fmt: skip
    if changed:
        raise ConfigError(
            f"{config.workdir} holds a self-training run of another config ({'; '.join(changed)}); give a new "
            "--config.workdir, or the same config to continue that one (self_train.rounds may grow)"
        )


def check(config: ml_collections.ConfigDict) -> None:
    """One-line errors for the self_train section, before anything is loaded."""
    from fbt_jax.errors import ConfigError
    from fbt_jax.evals.runner import check_task_files

    st = config.self_train
    if paths.is_url(config.workdir):
        raise ConfigError(
            f"workdir={config.workdir!r}: self-training appends its samples as they come, so it needs a local (or "
            "mounted, shared) directory; give one"
        )
    if not config.init_from:
        raise ConfigError("init_from is empty: give the run to start from (--config=configs/self_train.py:RUN)")
    if st.rounds < 1 or st.samples < 1 or st.batch_size < 1:
        raise ConfigError("self_train.rounds, self_train.samples and self_train.batch_size must be at least 1")
    for field, modes in (("mode", (st.mode,)), ("eval_modes", names(st.eval_modes))):
        if not modes or not set(modes) <= set(decode.MODES):
            raise ConfigError(f"self_train.{field}={st[field]!r}: use {'some' if field == 'eval_modes' else 'one'} "
                              f"of {', '.join(decode.MODES)}")  # fmt: skip
    if st.samples > 1 and st.temperature == 0:
        raise ConfigError(
            f"self_train.samples={st.samples} at temperature 0 draws one answer {st.samples} times; "
            "set self_train.temperature > 0"
        )
    if st.keep not in rounds.KEEP_RULES:
        raise ConfigError(f"self_train.keep={st.keep!r} is not one of {', '.join(rounds.KEEP_RULES)}")
    for field in ("tasks", "held_out"):
        if not names(st[field]):
            raise ConfigError(f"self_train.{field} is empty; give task specs (SPEC@PROBLEMS.jsonl, comma-separated)")
        for task in names(st[field]):
            if builtin.is_builtin(task.partition("@")[0]):
                raise ConfigError(
                    f"self_train.{field}: {task} is a built-in task, answered with one label token: there is no "
                    "answer to keep or shorten; give a task spec (SPEC@PROBLEMS.jsonl)"
                )
    for settings in (sampling_settings(config, 1), held_out_settings(config)):
        settings.check()
        check_task_files(settings)
