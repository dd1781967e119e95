"""Preparing a corpus into a dataset: unit by unit, on any number of machines and workers, resumable.

A preparation has a plan (`prepare.json`: the input files, their units, the tokenizer's identity,
seq_len, the validation fraction), written once into the output directory by whichever shard
starts first; every shard then prepares its own units (`shards.py`) with `workers` processes.
A unit is read as a stream of documents, each sent to validation or train by a hash of its text
(so the split does not depend on shards or workers), encoded in batches by the tokenizer's own
batch encoder, packed, and written to its own records files; its progress file, written last,
marks it complete. A killed preparation started again skips complete units and redoes the rest,
which gives the same bytes, so the dataset is the same file for file. The shard that completes
the last unit writes meta.json, the manifest (`records.py`); two shards finishing together write
the same manifest.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

from fbt_jax import paths
from fbt_jax import progress as shown_progress
from fbt_jax.data import records, store
from fbt_jax.data.conversations import ConversationEncoder
from fbt_jax.data.documents import is_validation
from fbt_jax.data.packing import RecordPacker
from fbt_jax.data.shards import assign_units
from fbt_jax.data.workers import start_pool
from fbt_jax.errors import ConfigError

# Documents are encoded in batches of at most this many documents or bytes (memory stays flat).
BATCH_DOCUMENTS = 256
BATCH_BYTES = 1 << 20
# What must agree between the plan, every unit and the manifest (one tokenizer, one length, …).
SETTINGS = ("tokenizer_identity", "seq_len", "validation_fraction", "text_key")


def unit_name(unit: int) -> str:
    return f"{unit:05d}"


def progress_path(output: str, unit: int) -> str:
    return store.join(output, "progress", f"{unit_name(unit)}.json")


def staging_dir(output: str) -> str:
    """Where this process drafts files: inside a local output (renames stay on one file system),
    in a temporary directory for a bucket."""
    if paths.is_url(output):
        return os.path.join(tempfile.gettempdir(), "fbt-prepare-staging")
    return os.path.join(output, ".staging")


def open_output(output: str, plan: dict[str, Any], log: Callable[[str], None] = print) -> dict[str, Any]:
    """Start the preparation in `output`, or join or resume the one there; returns the plan in force.
    Refuses a finished dataset, a directory that is something else, and a preparation with other
    settings or files; an input file whose size changed is re-planned (`_replan`)."""
    existing = store.read_json(store.join(output, "prepare.json"))
    if existing is None and store.exists(store.join(output, "meta.json")):
        raise ConfigError(
            f"--output {output} already holds a prepared dataset (meta.json); choose a new directory "
            "(prepared data is never overwritten)"
        )
    if existing is None:
        others = [n for n in store.listdir(output) if n not in (".staging", "progress")]
        if others:
            raise ConfigError(
                f"--output {output} already exists and is not an fbt-prepare output (it holds {others[0]}); "
                "choose a new directory (prepared data is never overwritten)"
            )
        store.write_json(store.join(output, "prepare.json"), plan, staging_dir(output))
        existing = store.read_json(store.join(output, "prepare.json"))  # another shard may have won
    for key in (*SETTINGS, "chat", "inputs"):
        if existing.get(key) != plan.get(key):
            if key == "inputs" and [p for p, _ in existing["inputs"]] == [p for p, _ in plan["inputs"]]:
                return _replan(output, existing, plan, log)
            what = "input files" if key == "inputs" else key
            raise ConfigError(
                f"--output {output} holds a preparation with other {what} ({_short(existing.get(key))} here, "
                f"{_short(plan.get(key))} in this command); run the command that started it, or choose a new directory"
            )
    return existing


def _replan(output: str, existing: dict[str, Any], plan: dict[str, Any], log: Callable[[str], None]) -> dict[str, Any]:
    """The plan in `output` with the new sizes of the input files that changed since it was written
    (a truncated file replaced, as its error advised): the units reading them must not be complete
    (those are refused, naming the file); they keep their files, so complete units stay valid, and
    are prepared again from the new bytes."""
    sizes = [size for _, size in plan["inputs"]]
    changed = [i for i, ((path, old), new) in enumerate(zip(existing["inputs"], sizes)) if old != new]
    for unit, files in enumerate(existing["units"]):
        for i in set(files) & set(changed):
            if store.exists(progress_path(output, unit)):
                path, old = existing["inputs"][i]
                raise ConfigError(
                    f"{path} changed since unit {unit} of --output {output} was prepared from it ({old:,} bytes then, "
                    f"{sizes[i]:,} now); restore it, or prepare into a new directory"
                )
    replanned = {**existing, "inputs": plan["inputs"], "source": {**existing["source"], "bytes": sum(sizes)}}
    store.write_json(store.join(output, "prepare.json"), replanned, staging_dir(output))
    names = ", ".join(existing["inputs"][i][0] for i in changed[:3]) + (" and others" if len(changed) > 3 else "")
    log(f"{len(changed)} input file(s) changed since the plan was written ({names}): their units are prepared again")
    return replanned


def _short(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 60 else f"{len(value)} entries" if isinstance(value, list) else text[:57] + "..."


def unit_done(output: str, unit: int) -> dict[str, Any] | None:
    """The progress record of a complete unit whose files are all there, else None (to redo)."""
    done = store.read_json(progress_path(output, unit))
    if done is None:
        return None
    for name, entry in done["files"].items():
        if store.size(store.join(output, name)) != entry["bytes"]:
            return None  # a file went missing or was cut short since: prepare the unit again
    return done


def _documents(plan: dict[str, Any], unit: int) -> Iterator[tuple[str, Any]]:
    """(split, document) for every document of a unit, as a stream: a text, or for chat data a record
    (where, values), sent to validation by a hash of its values."""
    if "tfds" in plan:
        from fbt_jax.data.documents import tfds_split_documents

        t = plan["tfds"]
        splits, _ = tfds_split_documents(t["name"], t["data_dir"], plan["text_key"], *t["splits"])
        for split, docs in splits.items():
            yield from ((split, text) for text in docs)
        return
    from fbt_jax.data.sources import InputFile, read_documents

    fraction, chat = plan["validation_fraction"], plan.get("chat")
    keys = tuple(chat["keys"]) if chat else plan["text_key"]
    for index in plan["units"][unit]:
        path, size = plan["inputs"][index]
        for doc in read_documents(InputFile(path, size), keys, plan["flag"]):
            text = json.dumps(doc[1], sort_keys=True, ensure_ascii=False) if chat else doc
            yield ("validation" if is_validation(text, fraction) else "train"), doc


def _batches(documents: Iterator[tuple[str, Any]]) -> Iterator[dict[str, list[Any]]]:
    batch: dict[str, list[Any]] = {split: [] for split in records.SPLIT_NAMES}
    count = size = 0
    for split, doc in documents:
        batch[split].append(doc)
        count, size = count + 1, size + (len(doc) if isinstance(doc, str) else len(str(doc[1])))
        if count >= BATCH_DOCUMENTS or size >= BATCH_BYTES:
            yield batch
            batch, count, size = {split: [] for split in records.SPLIT_NAMES}, 0, 0
    if count:
        yield batch


def prepare_unit(plan: dict[str, Any], output: str, unit: int) -> dict[str, Any]:
    """Prepare one unit into `output`: its records files, then its progress record; returns that."""
    from array_record.python.array_record_module import ArrayRecordWriter

    from fbt_jax.data.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(plan["tokenizer"], "--tokenizer")  # loaded once per process
    chat = ConversationEncoder(plan["chat"], tokenizer, plan["seq_len"]) if plan.get("chat") else None
    encode = chat.encode_batch if chat else tokenizer.encode_batch
    staging = tempfile.mkdtemp(prefix=f"unit-{unit_name(unit)}-", dir=_made(staging_dir(output)))
    try:
        drafts = {split: os.path.join(staging, f"{split}.array_record") for split in records.SPLIT_NAMES}
        writers = {split: ArrayRecordWriter(path, "group_size:1") for split, path in drafts.items()}
        packers = {split: RecordPacker(plan["seq_len"], 3 if chat else 2) for split in records.SPLIT_NAMES}
        counts = {key: dict.fromkeys(records.SPLIT_NAMES, 0) for key in ("documents", "tokens", "records")}
        try:
            for batch in _batches(_documents(plan, unit)):
                for split, docs in batch.items():
                    for ids in encode(docs) if docs else ():
                        counts["documents"][split] += 1
                        counts["tokens"][split] += ids.shape[-1]
                        for record in packers[split].add(ids):
                            writers[split].write(record.tobytes())
                            counts["records"][split] += 1
            for split, packer in packers.items():
                for record in packer.finish():
                    writers[split].write(record.tobytes())
                    counts["records"][split] += 1
        finally:
            for writer in writers.values():
                writer.close()
        files = {}
        for split in records.SPLIT_NAMES:
            if counts["records"][split]:  # a unit with nothing held out has no validation file
                name = f"{unit_name(unit)}.{split}.array_record"
                files[name] = {
                    "split": split,
                    "bytes": os.path.getsize(drafts[split]),
                    "blake2b": records.file_digest(drafts[split]),
                    **{key: counts[key][split] for key in counts},
                }
                store.publish(drafts[split], store.join(output, name))
        done = {
            "unit": unit,
            "tokenizer_identity": tokenizer.identity,
            **{key: plan[key] for key in SETTINGS if key != "tokenizer_identity"},
            "files": files,
            **counts,
            **({"chat_counts": dataclasses.asdict(chat.counts)} if chat else {}),
        }
        store.write_json(progress_path(output, unit), done, staging)
        return done
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _made(directory: str) -> str:
    os.makedirs(directory, exist_ok=True)
    return directory


def _run_unit(job: tuple[dict[str, Any], str, int]) -> dict[str, Any]:
    return prepare_unit(*job)


def prepare_shard(
    plan: dict[str, Any],
    output: str,
    num_shards: int = 1,
    shard_index: int = 0,
    workers: int = 1,
    progress: bool = False,
    log: Callable[[str], None] = print,
) -> dict[str, Any] | None:
    """Prepare the units of shard `shard_index` of `num_shards` (those not done yet) into `output`,
    then write the manifest if every unit is done. Returns the manifest, or None while other
    shards still have units to prepare."""
    if workers < 1:
        raise ConfigError(f"--workers={workers} must be at least 1 (the processes that tokenise in parallel)")
    plan = open_output(output, plan, log)
    if store.exists(store.join(output, "meta.json")):  # the same command again, after the end: nothing to do
        log(f"{output} is already prepared by this command (meta.json); nothing to do")
        return store.read_json(store.join(output, "meta.json"))
    unit_bytes = [sum(plan["inputs"][i][1] for i in files) for files in plan["units"]]
    mine = assign_units(unit_bytes, num_shards)[shard_index]
    recorded = set(store.listdir(store.join(output, "progress")))  # one listing, not a request per unit
    todo = [unit for unit in mine if f"{unit_name(unit)}.json" not in recorded or unit_done(output, unit) is None]
    if len(todo) < len(mine):
        log(f"shard {shard_index} of {num_shards}: {len(mine) - len(todo)} of {len(mine)} units already prepared")
    start, tokens = time.perf_counter(), 0
    bar = shown_progress.bar(len(todo), progress, desc=f"prepare shard {shard_index}/{num_shards}", unit="unit")
    jobs = [(plan, output, unit) for unit in todo]
    pool, failed = None, True
    try:  # a stop (SIGTERM) may come while the workers start: the bar is closed before it is reported
        if workers == 1 or len(todo) <= 1:
            finished = map(_run_unit, jobs)
        else:
            pool = start_pool(min(workers, len(todo)), workers)
            finished = pool.imap_unordered(_run_unit, jobs)
        for done in finished:
            tokens += sum(done["tokens"].values())
            bar.update(1)
            bar.set_postfix(tokens_per_s=f"{tokens / max(time.perf_counter() - start, 1e-9):,.0f}")
        failed = False
    finally:
        shown_progress.close(bar, failed)
        if pool is not None:
            pool.terminate()
            pool.join()
    seconds = time.perf_counter() - start
    log(
        f"shard {shard_index} of {num_shards}: prepared {len(todo)} units, {tokens:,} tokens in {seconds:.1f}s "
        f"({tokens / max(seconds, 1e-9):,.0f} tokens/s with {workers} worker(s))"
    )
    return finish(plan, output)


def finish(plan: dict[str, Any], output: str) -> dict[str, Any] | None:
    """Write meta.json once every unit is complete (whichever shard gets here last); None before."""
    units = []
    for unit in range(len(plan["units"])):
        done = store.read_json(progress_path(output, unit))
        if done is None:
            return None
        units.append(done)
    for done in units:
        for key in SETTINGS:
            if done.get(key) != plan.get(key):
                raise ConfigError(
                    f"unit {done['unit']} in {output} was prepared with {key} {done.get(key)!r}, the plan says "
                    f"{plan.get(key)!r}: shards prepared with different settings cannot form one dataset; prepare "
                    "every shard with the same command into a new directory"
                )
    totals = {
        key: {s: sum(d[key][s] for d in units) for s in records.SPLIT_NAMES}
        for key in ("documents", "tokens", "records")
    }
    if totals["tokens"]["train"] < plan["seq_len"] + 1:
        if not paths.is_url(output):
            shutil.rmtree(output, ignore_errors=True)  # it can never become a dataset
        raise ConfigError(
            f"the training data has {totals['tokens']['train']} tokens, fewer than one sequence of "
            f"seq_len+1 = {plan['seq_len'] + 1}; use more text or a shorter sequence length (data.seq_len, fbt-prepare --seq-len)"
        )
    files = {
        name: entry
        for split in records.SPLIT_NAMES
        for d in units
        for name, entry in d["files"].items()
        if entry["split"] == split
    }
    chat = {"chat": plan["chat"], "record_rows": 3} if plan.get("chat") else {}
    if chat:
        chat["chat_counts"] = {k: sum(d["chat_counts"][k] for d in units) for k in units[0]["chat_counts"]}
    meta = {
        "format_version": records.CHAT_FORMAT_VERSION if chat else records.FORMAT_VERSION,
        **{key: plan[key] for key in ("tokenizer", "tokenizer_identity", "vocab_size", "eos_id", "bos_id")},
        **{key: plan[key] for key in SETTINGS if key != "tokenizer_identity"},
        "source": plan["source"],
        "units": len(units),
        **totals,
        **chat,
        "files": files,
    }
    store.write_json(store.join(output, "meta.json"), meta, staging_dir(output))
    if not paths.is_url(output):
        _clear_staging(staging_dir(output))
    return meta


def _clear_staging(staging: str) -> None:
    """Remove the drafts that killed runs left behind: every unit is complete, so no one drafts a
    unit any more; a JSON draft is left alone for a minute (another shard may be writing this very
    manifest), and the directory goes once it is empty."""
    for name in os.listdir(staging) if os.path.isdir(staging) else ():
        path = os.path.join(staging, name)
        if name.startswith("unit-"):
            shutil.rmtree(path, ignore_errors=True)
        elif time.time() - os.path.getmtime(path) > 60:
            os.remove(path)
    try:
        os.rmdir(staging)
    except OSError:
        pass  # a draft of another shard's, still being written: it renames it away itself
