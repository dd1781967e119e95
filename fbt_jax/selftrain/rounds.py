"""What a self-training round keeps and where its files are: pure functions over the files.

A round r of `fbt-self-train` lives in `<workdir>/round-<r>/`:

    samples/shard-<p>-of-<n>/   fbt-eval's output for the training problems of process p: eval.json,
                                generations.jsonl (one line per sample: task, problem id, mode, sample,
                                text, tokens, answer, verdict, correct), timing.json, scores.*
    kept.jsonl                  the tuning records: one chat (or prompt-completion) record per kept
                                sample, with its task, id, sample, mode and tokens; written whole once
                                every shard has sampled, so it exists only for a finished sampling
    run/                        the tuning run (fbt-train's workdir), from the previous round's weights
    tuned.json                  the tuning run's summary, written when it finished
    held-out/shard-<p>-of-<n>/  fbt-eval's output for the held-out problems, every evaluation mode
    round.json                  the round's figures (`summarize`), written last

Round 0 has only `held-out/` and `round.json`: the weights the loop starts from.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from collections.abc import Iterable
from typing import Any

KEEP_RULES = ("shortest", "correct")  # per problem: its shortest correct sample, or every correct one
GENERATIONS = "generations.jsonl"


def round_dir(workdir: str, r: int) -> str:
    return os.path.join(workdir, f"round-{r}")


def shard_name(index: int, count: int) -> str:
    return f"shard-{index}-of-{count}"


def shard_dirs(directory: str) -> list[str]:
    """The shard directories under `directory` that hold generations, in shard order."""
    if not os.path.isdir(directory):
        return []
    names = [n for n in os.listdir(directory) if n.startswith("shard-") and os.path.isdir(os.path.join(directory, n))]
    return [os.path.join(directory, n) for n in sorted(names, key=lambda n: int(n.split("-")[1]))]


def read_generations(directory: str, count: int) -> list[dict[str, Any]]:
    """Every whole generation line of the `count` shards under `directory` (a torn last line, what a
    kill during a write leaves, is not one), in shard order."""
    records = []
    for index in range(count):
        path = os.path.join(directory, shard_name(index, count), GENERATIONS)
        if not os.path.exists(path):
            continue
        with open(path, encoding="utf-8") as f:
            text = f.read()
        records += [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()]
    return records


def read_jsonl(path: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def write_jsonl(path: str, lines: list[dict[str, Any]]) -> None:
    """`lines` as a JSON-lines file at `path`, whole: drafted beside it, then renamed."""
    fd, draft = tempfile.mkstemp(prefix=".draft-", dir=os.path.dirname(path))
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write("".join(json.dumps(line) + "\n" for line in lines))
    os.replace(draft, path)


def keep(records: Iterable[dict[str, Any]], rule: str) -> list[dict[str, Any]]:
    """The samples a round tunes on, per (task, problem) in the order the problems first appear:
    `shortest`, the correct sample with the fewest generated tokens (ties: the lowest sample number);
    `correct`, every correct sample by sample number. A problem with no correct sample gives none."""
    if rule not in KEEP_RULES:
        raise ValueError(f"keep rule {rule!r} is not one of {KEEP_RULES}")
    correct: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for record in records:
        entries = correct.setdefault((record["task"], record["id"]), [])
        if record["correct"]:
            entries.append(record)
    kept = []
    for entries in correct.values():
        ordered = sorted(entries, key=lambda r: (int(r["tokens"]), int(r["sample"])))
        kept += ordered[:1] if rule == "shortest" else sorted(entries, key=lambda r: int(r["sample"]))
    return kept


def tuning_record(sample: dict[str, Any], prompt: str, chat: bool) -> dict[str, Any]:
    """A kept sample as a tuning record: the problem's prompt as the user turn and the sample's text as
    the reply (`chat`), else as prompt and completion; its provenance beside (fbt-prepare reads only
    the record's own fields)."""
    fields = (
        {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": sample["text"]}]}
        if chat
        else {"prompt": prompt, "completion": sample["text"]}
    )
    provenance = {k: sample[k] for k in ("task", "id", "mode", "sample", "tokens")}
    return {**fields, **provenance}


def summarize(
    r: int,
    held_out: list[dict[str, Any]],
    samples: list[dict[str, Any]] | None = None,
    kept: list[dict[str, Any]] | None = None,
    seconds: dict[str, float] | None = None,
) -> dict[str, Any]:
    """A round's figures: per evaluation mode the held-out accuracy (the mean over problems of their
    correct fraction) and the mean and median answer length in generated tokens; for a round that
    sampled, the problems and samples drawn, the kept fraction (problems with a kept sample), the
    tokens sampled, the training answers' mean length over all samples and over the kept ones, and
    the seconds of sampling and tuning."""
    figures: dict[str, Any] = {"round": r, "held_out": {}}
    by_mode: dict[str, list[dict[str, Any]]] = {}
    for record in held_out:
        by_mode.setdefault(record["mode"], []).append(record)
    for mode, records in by_mode.items():
        per_problem: dict[tuple[str, str], list[bool]] = {}
        for record in records:
            per_problem.setdefault((record["task"], record["id"]), []).append(bool(record["correct"]))
        tokens = [int(record["tokens"]) for record in records]
        figures["held_out"][mode] = {
            "accuracy": statistics.fmean(sum(c) / len(c) for c in per_problem.values()),
            "mean_tokens": statistics.fmean(tokens),
            "median_tokens": statistics.median(tokens),
            "problems": len(per_problem),
        }
    if samples is not None and kept is not None:
        problems = {(s["task"], s["id"]) for s in samples}
        figures["training"] = {
            "problems": len(problems),
            "samples": len(samples),
            "correct_fraction": sum(bool(s["correct"]) for s in samples) / max(len(samples), 1),
            "kept": len(kept),
            "kept_fraction": len({(k["task"], k["id"]) for k in kept}) / max(len(problems), 1),
            "tokens_sampled": sum(int(s["tokens"]) for s in samples),
            "mean_tokens": statistics.fmean(int(s["tokens"]) for s in samples) if samples else 0.0,
            "kept_mean_tokens": statistics.fmean(int(k["tokens"]) for k in kept) if kept else 0.0,
        }
    if seconds is not None:
        figures["seconds"] = dict(seconds)
    return figures
