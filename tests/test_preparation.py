"""fbt-prepare at scale: prepared ids equal the tokenizer library's own encoding; any split of the
work (workers, shards) gives the same dataset file for file; a killed preparation resumes to it;
the manifest says what it holds; the loader reads the sharded dataset as one set of records."""

import json
import os
import random
import re
import signal
import subprocess
import time

import numpy as np
import pytest
from conftest import WORDS, run_command, start_command, wait_for

from fbt_jax.data import records
from fbt_jax.data.documents import is_validation
from fbt_jax.data.prepare import main as fbt_prepare
from fbt_jax.data.sources import list_inputs, read_documents


def write_mixed_corpus(directory, num_files=9, docs_per_file=40, seed=0, words=400):
    """Word documents in .jsonl, .jsonl.gz, .jsonl.zst and .txt files; returns every document in
    file order."""
    import gzip

    import zstandard

    rng = np.random.default_rng(seed)
    os.makedirs(directory, exist_ok=True)
    everything = []
    for i in range(num_files):
        docs = [" ".join(rng.choice(WORDS, size=rng.integers(3, words))) for _ in range(docs_per_file)]
        lines = "".join(json.dumps({"text": d}) + "\n" for d in docs).encode()
        kind = i % 4
        if kind == 3:
            docs = docs[:1]
            with open(os.path.join(directory, f"part{i:02d}.txt"), "w") as f:
                f.write(docs[0])
        else:
            name = f"part{i:02d}.jsonl" + ("", ".gz", ".zst")[kind]
            data = (lambda b: b, gzip.compress, zstandard.ZstdCompressor().compress)[kind](lines)
            with open(os.path.join(directory, name), "wb") as f:
                f.write(data)
        everything += docs
    return everything


def tree(directory):
    """Every file of a prepared dataset with its bytes (a draft that a kill left in .staging, which
    the final step clears once it is a minute old, is not part of the dataset)."""
    return {
        os.path.relpath(os.path.join(root, name), directory): open(os.path.join(root, name), "rb").read()
        for root, _, names in os.walk(directory)
        for name in names
        if ".staging" not in os.path.relpath(root, directory).split(os.sep)
    }


def split_streams(directory):
    """The concatenated token ids of each split, read back through the loader's source."""
    out = {}
    for split in records.SPLIT_NAMES:
        source = records.PackedRecords(directory, split)
        rows = [source._record(i) for i in range(len(source))]
        out[split] = np.concatenate([tokens[segments > 0] for tokens, segments in rows])
    return out


@pytest.fixture(scope="module")
def mixed_corpus(tmp_path_factory):
    directory = tmp_path_factory.mktemp("mixed")
    return str(directory), write_mixed_corpus(directory)


def prepare_args(corpus, out, tokenizer="byte", *extra):
    return [f"--input={corpus}/*", f"--output={out}", "--seq-len=64", "--validation-fraction=0.2",
            f"--tokenizer={tokenizer}", *extra]  # fmt: skip


def test_prepared_ids_equal_the_tokenizer_librarys_own_encoding(mixed_corpus, bpe_tokenizer_json, tmp_path):
    from tokenizers import Tokenizer

    corpus, docs = mixed_corpus
    out = str(tmp_path / "bpe")
    fbt_prepare(prepare_args(corpus, out, bpe_tokenizer_json))
    library = Tokenizer.from_file(bpe_tokenizer_json)
    eos = library.token_to_id("<|endoftext|>")
    meta = records.read_meta(out)
    assert meta["eos_id"] == eos and meta["vocab_size"] == library.get_vocab_size(with_added_tokens=True)
    assert meta["tokenizer_identity"].startswith("hf:") and meta["units"] > 1
    streams = split_streams(out)
    for split in records.SPLIT_NAMES:
        held_out = split == "validation"
        expected = [e.ids + [eos] for e in library.encode_batch([d for d in docs if is_validation(d, 0.2) == held_out])]
        assert np.array_equal(streams[split], np.concatenate(expected)), split
        assert meta["documents"][split] == len(expected) and meta["tokens"][split] == sum(map(len, expected))
    # The manifest: every file with its split, size, checksum and counts, adding up to the totals.
    for split in records.SPLIT_NAMES:
        files = [e for e in meta["files"].values() if e["split"] == split]
        assert sum(e["records"] for e in files) == meta["records"][split] == len(records.PackedRecords(out, split))
        assert sum(e["documents"] for e in files) == meta["documents"][split]
    for name, entry in meta["files"].items():
        assert os.path.getsize(os.path.join(out, name)) == entry["bytes"]
        assert records.file_digest(os.path.join(out, name)) == entry["blake2b"]


def test_workers_and_shards_give_the_same_dataset_file_for_file(mixed_corpus, tmp_path):
    corpus, docs = mixed_corpus
    one = str(tmp_path / "one")
    fbt_prepare(prepare_args(corpus, one))
    two_workers = str(tmp_path / "two-workers")
    result = run_command(["fbt-prepare", *prepare_args(corpus, two_workers), "--workers=2"])
    assert result.returncode == 0, result.stderr[-2000:]
    three_shards = str(tmp_path / "three-shards")
    for index in (2, 0, 1):  # any order; the last one writes the manifest
        fbt_prepare([*prepare_args(corpus, three_shards), "--num-shards=3", f"--shard-index={index}"])
        assert os.path.exists(os.path.join(three_shards, "meta.json")) == (index == 1)
    reference = tree(one)
    assert tree(two_workers) == reference and tree(three_shards) == reference
    # The split is the documents' hash split, whoever prepared them.
    meta = records.read_meta(one)
    assert meta["documents"]["validation"] == sum(is_validation(d, 0.2) for d in docs)
    assert meta["documents"]["train"] + meta["documents"]["validation"] == len(docs)


def test_shard_index_from_a_slurm_array(mixed_corpus, tmp_path, monkeypatch):
    corpus, _ = mixed_corpus
    out = str(tmp_path / "slurm")
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "2")
    monkeypatch.setenv("SLURM_ARRAY_TASK_MIN", "1")
    for task in ("2", "1"):
        monkeypatch.setenv("SLURM_ARRAY_TASK_ID", task)
        fbt_prepare(prepare_args(corpus, out))
    monkeypatch.delenv("SLURM_ARRAY_TASK_ID")
    reference = str(tmp_path / "reference")
    fbt_prepare(prepare_args(corpus, reference))
    assert tree(out) == tree(reference)


@pytest.mark.slow
def test_a_killed_preparation_resumes_to_the_same_dataset(tmp_path, bpe_tokenizer_json):
    corpus = str(tmp_path / "corpus")
    write_mixed_corpus(corpus, num_files=16, docs_per_file=120, seed=1, words=600)
    args = prepare_args(corpus, "{out}", bpe_tokenizer_json)
    reference = str(tmp_path / "reference")
    # The kills land at seeded moments of the work itself, after the start-up (which on a fast
    # machine is most of a short preparation): the reference run measures both.
    start = time.perf_counter()
    proc = start_command(["fbt-prepare", *[a.format(out=reference) for a in args]], stderr=subprocess.PIPE)
    wait_for(lambda: os.path.exists(os.path.join(reference, "prepare.json")) or proc.poll() is not None, timeout=120)
    opened = time.perf_counter() - start
    assert proc.wait(timeout=300) == 0, proc.stderr.read()[-2000:]
    work = time.perf_counter() - start - opened
    rng = random.Random(0)
    for attempt, shards in enumerate((1, 2)):
        out = str(tmp_path / f"killed-{attempt}")
        argv = [["fbt-prepare", *[a.format(out=out) for a in args], f"--num-shards={shards}", f"--shard-index={i}"]
                + (["--workers=2"] if shards == 1 else []) for i in range(shards)]  # fmt: skip
        interrupted = 0
        for _ in range(2):  # killed twice at seeded moments, then run to the end
            procs = [start_command(a, start_new_session=True) for a in argv]
            started = os.path.join(out, "prepare.json")
            wait_for(lambda s=started, p=procs[0]: os.path.exists(s) or p.poll() is not None, 120)
            time.sleep(rng.uniform(0.0, 0.8 * work))
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            interrupted += not os.path.exists(os.path.join(out, "meta.json"))
        assert interrupted, "no kill landed before the end: the test would not test resuming"
        for a in argv:
            result = run_command(a)
            assert result.returncode == 0, result.stderr[-2000:]
        assert tree(out) == tree(reference), attempt


def test_sigterm_stops_a_preparation_with_exit_75_and_the_same_command_finishes_it(tmp_path, mixed_corpus):
    corpus, _ = mixed_corpus
    out = str(tmp_path / "out")
    argv = ["fbt-prepare", *prepare_args(corpus, out), "--workers=2"]
    proc = start_command(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    wait_for(lambda: os.path.exists(os.path.join(out, "prepare.json")), timeout=60)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    if proc.returncode == 0:
        pytest.skip("the preparation finished before SIGTERM arrived")
    assert proc.returncode == 75 and err.strip().splitlines()[-1].startswith("fbt-prepare: preempted: "), err
    assert run_command(argv).returncode == 0
    reference = str(tmp_path / "reference")
    fbt_prepare(prepare_args(corpus, reference))
    assert tree(out) == tree(reference)


def test_the_loader_reads_a_sharded_dataset_as_one_set_of_records(mixed_corpus, tmp_path):
    from fbt_jax.data.pipeline import StepBatches

    corpus, _ = mixed_corpus
    out = str(tmp_path / "prep")
    fbt_prepare(prepare_args(corpus, out))
    source = records.PackedRecords(out, "train")
    assert len(records.split_files(source.meta, "train")) > 1
    # Random access across file boundaries equals reading each file on its own, in order.
    from grain.sources import ArrayRecordDataSource

    expected = [r for path in source.paths for r in ArrayRecordDataSource(path)]
    assert [bytes(r) for r in source._read(list(range(len(source))))] == expected
    batches = StepBatches(source, 4, (0, 1, 2, 3), seed=0, shuffle=True)
    per_epoch = len(source) // 4
    seen = np.concatenate([batches.record_indices(s * 4 + np.arange(4)) for s in range(per_epoch)])
    assert len(set(seen.tolist())) == len(seen)  # every record at most once per epoch


def test_inputs_listed_in_a_file_and_given_as_globs_prepare_alike(mixed_corpus, tmp_path):
    corpus, _ = mixed_corpus
    files = [f.path for f in list_inputs(f"{corpus}/*")]
    listing = tmp_path / "inputs.txt"
    listing.write_text("# the corpus\n" + "\n".join(os.path.relpath(p, tmp_path) for p in files) + "\n")
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    fbt_prepare([*prepare_args(corpus, a)])
    fbt_prepare([f"--input=@{listing}", *prepare_args(corpus, b)[1:]])
    meta_a, meta_b = records.read_meta(a), records.read_meta(b)
    assert meta_a["files"] == meta_b["files"] and meta_a["documents"] == meta_b["documents"]
    assert sum(1 for f in files for _ in read_documents(f)) == sum(meta_a["documents"].values())


def failure(args, capsys) -> str:
    """The one line fbt-prepare ends with when it refuses `args` (exit 2)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        fbt_prepare(args)
    assert exit_info.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert lines[-1].startswith("fbt-prepare: ") and "Traceback" not in "".join(lines)
    return lines[-1]


def test_shards_prepared_with_different_tokenizers_are_refused_at_the_final_step(
    mixed_corpus, tmp_path, bpe_tokenizer_json, capsys
):
    """Two machines that each wrote their shard elsewhere (no shared plan), then synced into one
    directory: the shard that would write the manifest finds units of another tokenizer."""
    import shutil

    corpus, _ = mixed_corpus
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    fbt_prepare([*prepare_args(corpus, a), "--num-shards=2", "--shard-index=0"])
    fbt_prepare([*prepare_args(corpus, b, bpe_tokenizer_json), "--num-shards=2", "--shard-index=1"])
    for root, _, names in os.walk(b):
        for name in names:
            if name != "prepare.json":
                target = os.path.join(a, os.path.relpath(os.path.join(root, name), b))
                os.makedirs(os.path.dirname(target), exist_ok=True)
                shutil.copy(os.path.join(root, name), target)
    before = tree(a)
    line = failure([*prepare_args(corpus, a), "--num-shards=2", "--shard-index=0"], capsys)
    assert re.search(r"unit \d+ in .* was prepared with tokenizer_identity 'hf:.*', the plan says 'byte'", line)
    assert tree(a) == before and not os.path.exists(os.path.join(a, "meta.json"))


@pytest.mark.parametrize(
    "change, message",
    [
        (["--seq-len=32"], r"holds a preparation with other seq_len \(64 here, 32 in this command\)"),
        (["--validation-fraction=0.5"], r"holds a preparation with other validation_fraction \(0.2 here, 0.5"),
    ],
    ids=["seq-len", "validation-fraction"],
)
def test_resuming_with_other_settings_is_one_line_and_keeps_what_is_there(
    mixed_corpus, tmp_path, change, message, capsys
):
    from fbt_jax.errors import ConfigError

    corpus, _ = mixed_corpus
    out = str(tmp_path / "out")
    fbt_prepare([*prepare_args(corpus, out), "--num-shards=3", "--shard-index=0"])
    before = tree(out)
    assert re.search(
        message, failure([*prepare_args(corpus, out), *change, "--num-shards=3", "--shard-index=1"], capsys)
    )
    assert tree(out) == before
    with pytest.raises(
        ConfigError, match=r"holds an unfinished preparation \(no meta.json yet\); run the same fbt-prepare"
    ):
        records.read_meta(out)


def test_a_stop_while_the_workers_start_is_held_until_they_have_started():
    # CI once saw a SIGTERM land between a worker's spawn and its start-up data: the worker died
    # with a traceback after the one-line error. The stop now waits for the block to end.
    from fbt_jax.data.workers import sigterm_held

    class Stopped(Exception):
        pass

    def stop(signum, frame):
        raise Stopped

    previous = signal.signal(signal.SIGTERM, stop)
    reached = []
    try:
        with pytest.raises(Stopped):
            with sigterm_held():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)  # the handler would have run here
                reached.append("end of block")
            time.sleep(1)  # the held stop is delivered after the block
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert reached == ["end of block"] and signal.getsignal(signal.SIGTERM) is previous


def test_every_files_first_record_is_checked_before_any_unit(tmp_path, capsys):
    """A .jsonl file whose first line lacks the text field, or a text file that does not start as
    UTF-8, is refused before anything is written, however late it comes among the inputs."""
    corpus, out = tmp_path / "corpus", str(tmp_path / "out")
    write_mixed_corpus(corpus, num_files=4)
    (corpus / "zz.jsonl").write_text('{"txt": "the field is misnamed"}\n{"text": "fine"}\n')
    line = failure(prepare_args(corpus, out), capsys)
    assert re.search(r"zz.jsonl:1 is not a JSON object with a 'text' string", line)
    os.remove(corpus / "zz.jsonl")
    (corpus / "zz.txt").write_bytes("déjà ".encode() * 20000 + b"\xff")  # bad beyond what is checked: later
    (corpus / "zy.txt").write_bytes(b"\x1f\x8b\x08 a gzip file named .txt")
    assert re.search(r"text file .*zy.txt is not UTF-8 text .* at byte 1\)", failure(prepare_args(corpus, out), capsys))
    assert not os.path.exists(out)


def test_a_replaced_input_is_prepared_again_unless_its_unit_was_complete(tmp_path, capsys):
    """fbt-prepare stops on a truncated .gz after the units before it; the user replaces the file, as
    the error advises, and the same command finishes the dataset (it was refused: the plan had the
    old size). A changed file whose unit is complete is refused, naming it."""
    corpus, out, fresh = tmp_path / "corpus", str(tmp_path / "out"), str(tmp_path / "fresh")
    write_mixed_corpus(corpus, num_files=9)
    fbt_prepare(prepare_args(corpus, fresh))
    cut, first = corpus / "part05.jsonl.gz", corpus / "part00.jsonl"
    whole, first_bytes = cut.read_bytes(), first.read_bytes()
    cut.write_bytes(whole[: len(whole) // 2])
    assert re.search(r"part05.jsonl.gz is truncated", failure(prepare_args(corpus, out), capsys))
    plan = json.load(open(os.path.join(out, "prepare.json")))
    unit_of_cut = next(u for u, files in enumerate(plan["units"]) if plan["inputs"][files[-1]][0] >= str(cut))
    assert sorted(os.listdir(os.path.join(out, "progress"))) == [f"{u:05d}.json" for u in range(unit_of_cut)] != []
    cut.write_bytes(whole)
    first.write_bytes(first_bytes + b'{"text": "one more"}\n')
    before = tree(out)
    line = failure(prepare_args(corpus, out), capsys)
    assert re.search(r"part00.jsonl changed since unit 0 of --output .* was prepared from it .*; restore it", line)
    assert tree(out) == before
    first.write_bytes(first_bytes)
    fbt_prepare(prepare_args(corpus, out))
    assert "1 input file(s) changed since the plan was written (" in capsys.readouterr().out
    mine, theirs = split_streams(out), split_streams(fresh)  # the same tokens, split alike
    assert mine.keys() == theirs.keys() and all(np.array_equal(mine[s], theirs[s]) for s in mine)
    mine, theirs = records.read_meta(out), records.read_meta(fresh)
    assert (mine["documents"], mine["tokens"]) == (theirs["documents"], theirs["tokens"])
