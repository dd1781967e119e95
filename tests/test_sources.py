"""The files of a corpus and the documents in them: every format yields exactly what was written, as a
stream (flat memory), and every bad input is one line naming the file and the fix."""

import gzip
import json
import os
import re
import tracemalloc
import uuid

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from fbt_jax.data import sources
from fbt_jax.data.sources import InputFile, check_input, list_inputs, read_documents
from fbt_jax.errors import ConfigError

DOCS = [
    "plain words",
    "unicode: café, naïve, 中文, emoji 🚀, combining é",
    "newlines\ninside\n\nthe document\n",
    "windows\r\nline ends and a tab\t",
    '{"looks": "like json"}',
    "  leading and trailing spaces  ",
    "a longer one " * 50,
]


def jsonl(docs, key="text") -> bytes:
    return b"".join(json.dumps({key: d, "id": i}).encode() + b"\n" for i, d in enumerate(docs))


def zstd_frames(data: bytes, frames: int = 2, checksum: bool = False) -> bytes:
    """`data` as `frames` zstd frames, concatenated (as `cat a.zst b.zst` or pzstd write them)."""
    step = -(-len(data) // frames)
    compressor = zstandard.ZstdCompressor(write_checksum=checksum)
    return b"".join(compressor.compress(data[i : i + step]) for i in range(0, len(data), step))


def write(path, data: bytes) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return str(path)


def write_parquet(path, docs, row_groups=3, **columns) -> str:
    table = pa.table({"text": docs, **columns})
    pq.write_table(table, path, row_group_size=-(-len(docs) // row_groups))
    assert pq.ParquetFile(path).num_row_groups == row_groups
    return str(path)


def read_all(file, **kwargs) -> list[str]:
    return list(read_documents(file, **kwargs))


def error(call, *args, **kwargs) -> str:
    """The one-line message of the ConfigError that `call` raises (a generator is run to its end)."""
    with pytest.raises(ConfigError) as info:
        result = call(*args, **kwargs)
        if hasattr(result, "__next__"):
            list(result)
    message = str(info.value)
    assert "\n" not in message
    return message


# --- every format, the same documents ---------------------------------------------------------------------


def test_every_format_yields_exactly_the_documents_written(tmp_path):
    for i, doc in enumerate(DOCS):
        write(tmp_path / "txt" / f"doc{i:02d}.txt", doc.encode())
    data = jsonl(DOCS)
    formats = {
        "a.jsonl": data,
        "b.jsonl": b"".join(json.dumps({"text": d}, ensure_ascii=False).encode() + b"\n\n" for d in DOCS),
        "c.jsonl.gz": gzip.compress(data),
        "d.jsonl.gz": gzip.compress(data[:100]) + gzip.compress(data[100:]),  # two gzip members
        "e.jsonl.zst": zstd_frames(data, frames=1),
        "f.jsonl.zst": zstd_frames(data, frames=2),
        "g.jsonl.zst": zstd_frames(data, frames=3, checksum=True),
    }
    for name, content in formats.items():
        write(tmp_path / "lines" / name, content)
    stream = zstandard.ZstdCompressor().stream_writer(open(tmp_path / "lines" / "h.jsonl.zst", "wb"))
    stream.write(data)  # written as a stream: no content size in the frame header
    stream.close()
    write_parquet(tmp_path / "i.parquet", DOCS, row_groups=3, id=list(range(len(DOCS))))

    txt = list_inputs(f"{tmp_path}/txt/*.txt")
    assert [d for f in txt for d in read_all(f)] == DOCS
    for file in [*list_inputs(f"{tmp_path}/lines/*"), *list_inputs(f"{tmp_path}/*.parquet")]:
        check_input(file)
        assert read_all(file) == DOCS, file.path
        assert read_all(file.path) == DOCS  # a path does as well as an InputFile


def test_other_suffixes_are_one_document_and_empty_documents_are_kept(tmp_path):
    source = write(tmp_path / "code.py", b"def f():\n    return 1\n")
    assert read_all(source) == ["def f():\n    return 1\n"]
    assert read_all(write(tmp_path / "a.jsonl", jsonl(["", "x", ""]))) == ["", "x", ""]
    assert read_all(write_parquet(tmp_path / "a.parquet", ["", "x", ""])) == ["", "x", ""]
    custom = write(tmp_path / "c.jsonl", jsonl(["one", "two"], key="content"))
    assert read_all(custom, text_key="content") == ["one", "two"]


def test_parquet_is_read_batch_by_batch_from_the_text_column_only(tmp_path, monkeypatch):
    path = write_parquet(tmp_path / "a.parquet", [f"doc {i}" for i in range(12)], row_groups=3, extra=[0] * 12)
    calls, batches = [], []
    iter_batches = pq.ParquetFile.iter_batches

    def spy(self, *args, **kwargs):
        calls.append(kwargs)
        for batch in iter_batches(self, *args, **kwargs):
            batches.append(batch.num_rows)
            yield batch

    def whole_table(*args, **kwargs):
        raise AssertionError("the whole table (or a whole row group set) was read")

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", spy)
    for name in ("read", "read_row_groups"):
        monkeypatch.setattr(pq.ParquetFile, name, whole_table)
    monkeypatch.setattr(pq, "read_table", whole_table)
    monkeypatch.setattr(sources, "_PARQUET_BATCH_ROWS", 2)
    documents = read_documents(path)
    assert next(documents) == "doc 0"
    assert batches == [2]  # the first document came before the rest of the file was read
    assert list(documents) == [f"doc {i}" for i in range(1, 12)]
    assert calls == [{"batch_size": 2, "columns": ["text"]}] and batches == [2] * 6


# --- memory stays flat --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def large_docs():
    """About 20 MB of JSON lines of distinct, compressible documents, and their count."""
    block = " ".join(f"word{i % 97} token{i % 13}" for i in range(70))
    lines = b"".join(json.dumps({"text": f"{i:08d} {block}"}).encode() + b"\n" for i in range(20_000))
    return lines, 20_000


def peak_while_reading(path, count) -> int:
    tracemalloc.start()
    try:
        seen = sum(1 for _ in read_documents(path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert seen == count
    return peak


@pytest.mark.parametrize("suffix", [".jsonl.zst", ".jsonl.gz"])
def test_compressed_files_are_read_as_a_stream(tmp_path, large_docs, suffix):
    lines, count = large_docs
    assert len(lines) > 20e6
    compress = zstd_frames if suffix == ".jsonl.zst" else lambda data: gzip.compress(data, compresslevel=1)
    path = write(tmp_path / f"big{suffix}", compress(lines))
    assert peak_while_reading(path, count) < 4e6  # the python heap: a few MB, not the 20 MB file


def test_parquet_is_read_as_a_stream(tmp_path, large_docs):
    lines, count = large_docs
    docs = [json.loads(line)["text"] for line in lines.splitlines()]
    path = write_parquet(tmp_path / "big.parquet", docs, row_groups=10)
    del docs
    assert peak_while_reading(path, count) < 4e6
    arrow_peak = 0  # arrow's own buffers (outside the python heap): one row group, not the table
    for i, _ in enumerate(read_documents(path)):
        if i % 500 == 0:
            arrow_peak = max(arrow_peak, pa.total_allocated_bytes())
    assert arrow_peak < 0.3 * len(lines)


# --- listing the files ---------------------------------------------------------------------------------


def test_globs_are_comma_separated_recursive_sorted_and_deduplicated(tmp_path):
    for name in ("b.txt", "a.jsonl", "deep/er/c.txt", "deep/d.txt", "skip.md"):
        write(tmp_path / name, b"x" * len(name))
    files = list_inputs(f" {tmp_path}/*.txt , {tmp_path}/**/*.txt,{tmp_path}/a.jsonl,{tmp_path}/b.txt ")
    names = ["a.jsonl", "b.txt", "deep/d.txt", "deep/er/c.txt"]
    assert files == [InputFile(str(tmp_path / n), len(n)) for n in names]
    odd = write(tmp_path / "odd[1].txt", b"x")  # a plain path matches itself, glob characters and all
    assert list_inputs(odd) == [InputFile(odd, 1)]


def test_a_listing_file_names_globs_relative_to_itself(tmp_path, monkeypatch):
    for name in ("corpus/a.txt", "corpus/sub/b.jsonl", "other/c.txt"):
        write(tmp_path / name, b"{}")
    listing = tmp_path / "lists" / "corpus.txt"
    write(listing, f"# the corpus\n\n../corpus/**/*\n  {tmp_path}/other/c.txt  \n../corpus/a.txt\n".encode())
    monkeypatch.chdir(tmp_path / "corpus")  # relative to the listing, not to the working directory
    paths = [f.path for f in list_inputs(f"@{listing}")]
    assert paths == [str(tmp_path / n) for n in ("corpus/a.txt", "corpus/sub/b.jsonl", "other/c.txt")]


def test_remote_files_go_through_fsspec(tmp_path):
    fs = fsspec.filesystem("memory")
    root = f"memory://test-{uuid.uuid4().hex}"  # the in-memory store is shared by the whole process
    try:
        fs.pipe(f"{root}/corpus/a.jsonl.zst", zstd_frames(jsonl(DOCS)))
        fs.pipe(f"{root}/corpus/sub/b.txt", DOCS[1].encode())
        with open(write_parquet(tmp_path / "c.parquet", DOCS), "rb") as f:
            fs.pipe(f"{root}/corpus/c.parquet", f.read())
        fs.pipe(f"{root}/list.txt", b"corpus/**/*.txt\ncorpus/*.jsonl.zst\n")
        files = list_inputs(f"{root}/corpus/**/*.txt,{root}/corpus/*.parquet, {root}/corpus/*.zst")
        assert [os.path.basename(f.path) for f in files] == ["a.jsonl.zst", "c.parquet", "b.txt"]
        assert list_inputs(f"@{root}/list.txt") == [files[0], files[2]]
        assert [f.size for f in files] == [fs.info(f.path)["size"] for f in files]
        for file in files:
            check_input(file)
        assert [read_all(f) for f in files] == [DOCS, DOCS, [DOCS[1]]]
        assert "matches no file" in error(list_inputs, f"{root}/none/*.txt")
    finally:
        fs.rm(root, recursive=True)


# --- errors: one line each, naming the file and the fix ---------------------------------------------


def test_a_glob_that_matches_nothing_names_the_flag(tmp_path):
    assert error(list_inputs, f"{tmp_path}/*.txt", flag="--input") == (
        f"--input='{tmp_path}/*.txt' matches no file; check the path, or give a glob of corpus files, "
        "e.g. 'corpus/**/*.jsonl.zst'"
    )
    write(tmp_path / "a.txt", b"x")
    assert "line 2 ('b/*.txt') matches no file" in error(list_inputs, "@" + write(tmp_path / "l", b"a.txt\nb/*.txt"))


@pytest.fixture
def deny(monkeypatch):
    """Make a path unreadable: chmod 000, or as root (whom file modes do not stop) a fake `os.access`."""
    denied, real_access = [], os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: str(p) not in denied and real_access(p, mode, **kw))

    def deny(path):
        denied.append(str(path))
        if os.geteuid() != 0:
            os.chmod(path, 0)

    yield deny
    for path in denied:
        os.chmod(path, 0o755)


def test_a_glob_in_an_unreadable_directory_names_it_not_no_match(tmp_path, deny):
    locked = tmp_path / "locked"
    deeper = tmp_path / "corpus" / "part2"
    for directory in (locked, deeper):
        directory.mkdir(parents=True)
        if os.geteuid() != 0:  # a file the directory's mode hides (root reads it anyway)
            write(directory / "a.txt", b"hidden")
        deny(directory)
    for pattern, blocked in ((f"{locked}/*.txt", locked), (f"{tmp_path}/corpus/*/*.txt", deeper)):
        message = error(list_inputs, pattern)
        assert message == (
            f"data.path={pattern!r}: the directory {blocked} cannot be read by this user, so its files cannot be "
            f"listed; fix its permissions (e.g. chmod u+rx {blocked})"
        )
    assert "matches no file" in error(list_inputs, f"{tmp_path}/missing/*.txt")  # absent, not unreadable


def test_unreadable_and_empty_files_are_named(tmp_path, deny):
    write(tmp_path / "a.txt", b"x")
    deny(write(tmp_path / "b.txt", b"x"))
    assert error(list_inputs, f"{tmp_path}/*.txt") == (
        f"input file {tmp_path}/b.txt is not readable; fix its permissions or drop it from data.path"
    )
    write(tmp_path / "empty" / "c.jsonl", b"")
    assert error(list_inputs, f"{tmp_path}/empty/*") == (
        f"input file {tmp_path}/empty/c.jsonl is empty; delete it or drop it from data.path"
    )
    assert error(read_all, str(tmp_path / "gone.txt")).startswith(
        f"input file {tmp_path}/gone.txt cannot be read (FileNotFoundError: [Errno 2] No such file or directory"
    )


def test_a_listing_that_is_missing_or_lists_nothing(tmp_path):
    assert error(list_inputs, f"@{tmp_path}/list.txt") == (
        f"data.path='@{tmp_path}/list.txt': the listing file does not exist; give a file listing one glob per line"
    )
    write(tmp_path / "list.txt", b"# only a comment\n\n   \n")
    assert error(list_inputs, f"@{tmp_path}/list.txt") == (
        f"data.path='@{tmp_path}/list.txt': the listing file lists no file; write one glob or path per line "
        "(# for comments)"
    )
    assert error(list_inputs, " , ").startswith("data.path is empty;")


@pytest.mark.parametrize("line", [b"not json", b'["text"]', b'{"body": "x"}', b'{"content": 3}', b'"content"'])
def test_a_jsonl_line_without_the_text_string_is_named(tmp_path, line):
    path = write(tmp_path / "a.jsonl", b'{"content": "fine"}\n\n' + line + b"\n")
    assert error(read_all, path, text_key="content") == (
        f"{path}:3 is not a JSON object with a 'content' string; write one "
        '{"content": "..."} object per line, or drop the file from data.path'
    )


def test_text_that_is_not_utf8_names_the_file_and_byte(tmp_path):
    path = write(tmp_path / "a.txt", "héllo ".encode() + b"\xff rest")
    assert error(read_all, path) == (
        f"text file {path} is not UTF-8 text (invalid start byte at byte 7); convert it to UTF-8 or drop it "
        "from data.path"
    )
    path = write(tmp_path / "b.jsonl.zst", zstd_frames(jsonl(["ok"]) + b'{"text": "\xe9"}\n'))
    first = len(jsonl(["ok"]))
    assert error(read_all, path).startswith(
        f"{path}:2 is not UTF-8 text (invalid continuation byte at byte {first + 10})"
    )
    path = write(tmp_path / "c.txt.gz", gzip.compress(b"text"))  # compressed, but not named .jsonl.gz
    assert "(a compressed file must be .jsonl.gz or .jsonl.zst)" in error(read_all, path)


@pytest.mark.parametrize("suffix", [".jsonl.gz", ".jsonl.zst"])
def test_a_truncated_compressed_file_is_an_error_not_a_shorter_corpus(tmp_path, suffix):
    docs = [f"document {i} " + "words " * (i % 7) for i in range(400)]
    compress = (lambda d: gzip.compress(d, mtime=0)) if suffix == ".jsonl.gz" else zstd_frames
    data = compress(jsonl(docs))
    if suffix == ".jsonl.zst":  # the end of a frame with a checksum too
        data = zstd_frames(jsonl(docs), frames=2) + zstd_frames(jsonl(docs[:3]), frames=1, checksum=True)
        docs = docs + docs[:3]
    assert read_all(write(tmp_path / f"whole{suffix}", data)) == docs
    for cut in (12, len(data) // 3, len(data) // 2 + 7, len(data) - 5, len(data) - 1):
        path = write(tmp_path / f"cut{cut}{suffix}", data[:cut])
        got = []
        with pytest.raises(ConfigError) as info:
            got.extend(read_documents(path))
        assert got == docs[: len(got)]  # all of them, when the cut is in the stream's trailer
        name = "gzip" if suffix == ".jsonl.gz" else "zstd"
        assert str(info.value) == (
            f"{path} is truncated: its {name} data ends mid-stream, after {len(got)} line(s) (at compressed "
            f"byte {cut}); re-download it or drop it from data.path"
        )


@pytest.mark.parametrize("suffix", [".jsonl.gz", ".jsonl.zst"])
def test_damaged_compressed_data_and_bad_magic_are_one_line(tmp_path, suffix):
    docs = [f"document {i} " + "words " * (i % 7) for i in range(400)]
    whole = gzip.compress(jsonl(docs)) if suffix == ".jsonl.gz" else zstd_frames(jsonl(docs), checksum=True)
    name = "gzip" if suffix == ".jsonl.gz" else "zstd"
    for where in (len(whole) // 4, len(whole) // 2, 3 * len(whole) // 4):
        # the bytes after a damaged spot often decode to text that is not JSON, before the checksum
        # fails at the end of the stream: the damage is what is reported
        data = bytearray(whole)
        data[where : where + 16] = b"\xa5" * 16
        message = error(read_all, write(tmp_path / f"bad{where}{suffix}", bytes(data)))
        assert message.startswith(f"{tmp_path}/bad{where}{suffix} is damaged: bad {name} data (")
        assert re.search(
            r"\), after \d+ line\(s\) \(at compressed byte \d+\); re-download it or drop it from data.path$", message
        )
    plain = write(tmp_path / f"plain{suffix}", jsonl(docs))
    expected = (
        f"{plain} is not a {name} file (it starts with b'{{\"te'); re-download it, or rename it to match its format "
        "(.txt, .jsonl, .jsonl.gz, .jsonl.zst, .parquet), or drop it from data.path"
    )
    assert error(check_input, plain) == expected
    assert error(read_all, plain) == expected


def test_parquet_without_a_text_column_or_with_nulls(tmp_path):
    path = write_parquet(tmp_path / "a.parquet", ["x"] * 3, row_groups=1, id=[1, 2, 3])
    assert error(check_input, path, text_key="body") == (
        f"{path} has no column 'body'; its columns are ['text', 'id']: set the text key to the one holding the "
        "text, or drop the file from data.path"
    )
    assert error(read_all, path, text_key="id") == (
        f"{path}: the column 'id' holds int64, not strings; set the text key to a string column, or drop the file "
        "from data.path"
    )
    nulls = write_parquet(tmp_path / "b.parquet", ["a", "b", "c", None, "e", "f"], row_groups=3)
    got = []
    with pytest.raises(ConfigError) as info:
        got.extend(read_documents(nulls))
    assert got == ["a", "b", "c"]
    assert str(info.value) == (
        f"{nulls} row 3 (from 0): the 'text' column is null; drop or fill the null rows, or drop the file from "
        "data.path"
    )
    broken = write(tmp_path / "c.parquet", b"PAR1 this is not parquet")
    assert error(check_input, broken).startswith(f"{broken} is not a Parquet file, or is damaged (")
    dictionary = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": pa.array(["p", "q", "p"]).dictionary_encode()}), dictionary)
    assert read_all(str(dictionary)) == ["p", "q", "p"]
