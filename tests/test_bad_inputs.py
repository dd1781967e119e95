"""Bad input, catalogued (issue #9): every command refuses a bad input the same way.

Each case runs a real command (fbt-train, fbt-eval, fbt-decode, fbt-prepare, launch/local.sh) as a
subprocess and checks that

(a) it exits with the documented code (fbt_jax/errors.py EXIT_CODES: 2 config/flags/input,
    5 checkpoint restore, 6 workdir in use; argparse usage errors exit 2 as well);
(b) stderr is one line `<program>: ...` that names the problem and the fix (the case's pattern):
    no progress bar, warning or traceback before it (under launch/local.sh: each failed process's
    own line, then the launcher's);
(c) it fails before anything is compiled (fbt-train logs "compiled train step" when it compiles);
(d) every file that existed beforehand (the case's own inputs, the shared trained run, corpus and
    prepared data) is byte-identical afterwards. New files may appear (a failed run may create its
    workdir); the one file whose bytes may change is a workdir's `.fbt-train.lock`, for the cases
    where the failing run took the lock before it failed: the lock records its holder (pid, host,
    time) and is meaningless once no live process holds it.

Shared inputs are made once per module, lazily: a tiny trained run with checkpoints at steps 2 and 4
(read-only, for decode/eval/init_from; copied when a case may write into it), a small text corpus,
and that corpus prepared by fbt-prepare.
"""

from __future__ import annotations

import dataclasses
import fcntl
import glob
import gzip
import hashlib
import io
import json
import os
import random
import re
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Callable

import pytest
from conftest import cpu_env, run_command

# The cases are many short commands: two groups, one per pytest-xdist worker (tests/scheduling.py),
# each making the shared inputs it names.
XDIST_PARTS = 2
PROGRAM_NAMES = {"launch/local.sh": "local.sh"}
LOCK_NAME = ".fbt-train.lock"
# A run compiles its programs only after every check has passed.
COMPILE_MARKERS = ("compiled train step", "compiled eval")

TRAIN = [
    "fbt-train",
    "--config=configs/tiny.py",
    "--config.train.steps=4",
    "--config.optimizer.warmup_steps=1",
    "--config.checkpoint.every_steps=2",
    "--config.eval.num_batches=1",
]
NEW = [*TRAIN, "--config.workdir={tmp}/run"]  # a fresh workdir
TEXT = [*NEW, "--config.data.source=text", "--config.model.vocab_size=257"]  # byte tokenizer: 257 ids
RESUME = [*TRAIN, "--config.workdir={copy}"]  # the trained run's config, on a copy of it
DECODE = ["fbt-decode", "--checkpoint={run}", "--prompt=1 2 3", "--max-new-tokens=4"]
EVAL = ["fbt-eval", "--checkpoint={run}", "--output={tmp}/eval"]
PREPARE = ["fbt-prepare", "--output={tmp}/prepared", "--seq-len=16"]


def environment(devices: int = 1, tmp: str = "") -> dict[str, str]:
    cache = os.path.join(tmp, "cache") if tmp else os.environ.get("FBT_JAX_CACHE", "")
    return cpu_env(devices, PYTHON=sys.executable, FBT_JAX_CACHE=cache)


def run(argv: list[str], env: dict[str, str], timeout: int = 300) -> subprocess.CompletedProcess:
    return run_command(argv, env, timeout=timeout)


# --- shared inputs, made once per module on first use ----------------------------------------------


class Shared(dict):
    """Placeholder → path for the shared inputs; each is made the first time a case names it."""

    def __init__(self, root: str):
        super().__init__()
        self.root = root

    def __missing__(self, key: str) -> str:
        make = {"corpus": self._corpus, "prep": self._prepared, "run": self._trained_run}.get(key)
        if make is None:
            raise KeyError(key)
        self[key] = make(os.path.join(self.root, key))
        return self[key]

    def _corpus(self, path: str) -> str:
        os.makedirs(path)
        rng = random.Random(0)
        words = "the quick brown fox jumps over a lazy dog and then runs far away from home".split()
        for i in range(30):
            with open(os.path.join(path, f"doc{i:02d}.txt"), "w", encoding="utf-8") as f:
                f.write(" ".join(rng.choice(words) for _ in range(150)) + "\n")
        return path

    def _prepared(self, path: str) -> str:
        argv = ["fbt-prepare", f"--input={self['corpus']}/*.txt", f"--output={path}", "--seq-len=16"]
        result = run([*argv, "--validation-fraction=0.3"], environment())
        assert result.returncode == 0, result.stderr[-2000:]
        return path

    def _trained_run(self, path: str) -> str:
        result = run([*TRAIN, f"--config.workdir={path}"], environment(), timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        assert sorted(os.listdir(os.path.join(path, "checkpoints"))) == ["2", "4"]
        return path


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Shared:
    return Shared(str(tmp_path_factory.mktemp("shared")))


# --- case set-up: inputs made in the case's own directory ------------------------------------------


def write(path: str, data: bytes | str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)


def copy_run(tmp: str, shared: Shared) -> None:
    shutil.copytree(shared["run"], os.path.join(tmp, "copy"))


def prepared_without_validation(tmp: str, shared: Shared) -> None:
    argv = ["fbt-prepare", f"--input={shared['corpus']}/*.txt", f"--output={tmp}/noval", "--seq-len=16"]
    result = run([*argv, "--validation-fraction=0"], environment())
    assert result.returncode == 0, result.stderr[-2000:]


def copy_prepared(tmp: str, shared: Shared) -> str:
    target = os.path.join(tmp, "data")
    shutil.copytree(shared["prep"], target)
    files = sorted(glob.glob(os.path.join(target, "*.train.array_record")), key=os.path.getsize)
    return files[-1]  # the largest of its train records files


def garble(offset_fraction: float, length: int | None) -> Callable[[str, Shared], None]:
    """Overwrite part (or, with length None, all) of the prepared train records with noise."""

    def setup(tmp: str, shared: Shared) -> None:
        path = copy_prepared(tmp, shared)
        data = bytearray(open(path, "rb").read())
        start = int(len(data) * offset_fraction)
        size = len(data) - start if length is None else min(length, len(data) - start)
        data[start : start + size] = random.Random(1).randbytes(size)
        write(path, bytes(data))

    return setup


def truncate(keep_fraction: float) -> Callable[[str, Shared], None]:
    def setup(tmp: str, shared: Shared) -> None:
        path = copy_prepared(tmp, shared)
        os.truncate(path, int(os.path.getsize(path) * keep_fraction))

    return setup


def garble_meta(tmp: str, shared: Shared) -> None:
    path = os.path.join(os.path.dirname(copy_prepared(tmp, shared)), "meta.json")
    write(path, b'{"format_version": 1, "vocab_size": 25')


def text_file(name: str, data: bytes | str) -> Callable[[str, Shared], None]:
    def setup(tmp: str, shared: Shared) -> None:
        write(os.path.join(tmp, name), data)

    return setup


def unreadable_file(name: str) -> Callable[[str, Shared], None]:
    def setup(tmp: str, shared: Shared) -> None:
        path = os.path.join(tmp, name)
        write(path, "some text that cannot be read " * 10)
        os.chmod(path, 0)

    return setup


def unreadable_dir(name: str, prepared: bool = False) -> Callable[[str, Shared], None]:
    """A directory (a copy of the prepared data, or some text files) that its owner cannot read."""

    def setup(tmp: str, shared: Shared) -> None:
        path = os.path.join(tmp, name)
        if prepared:
            shutil.copytree(shared["prep"], path)
        else:
            write(os.path.join(path, "a.txt"), "some text " * 20)
        os.chmod(path, 0)

    return setup


def remove_records_file(tmp: str, shared: Shared) -> None:
    os.remove(copy_prepared(tmp, shared))


JSONL = "".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(400)).encode()


def parquet_bytes(columns: dict) -> bytes:
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    buffer = io.BytesIO()
    pq.write_table(pa.table(columns), buffer)
    return buffer.getvalue()


def zstd_bytes(data: bytes) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor(write_checksum=True).compress(data)


def read_only_workdir(tmp: str, shared: Shared) -> None:
    path = os.path.join(tmp, "ro")
    write(os.path.join(path, "notes.txt"), "kept\n")
    os.chmod(path, stat.S_IRUSR | stat.S_IXUSR)


def damage_checkpoints(tmp: str, shared: Shared) -> None:
    """Every array file of every checkpoint of a copy of the run replaced by noise."""
    copy_run(tmp, shared)
    rng = random.Random(2)
    for root, _, files in os.walk(os.path.join(tmp, "copy", "checkpoints")):
        if os.path.basename(root) == "d":  # OCDBT data files
            for name in files:
                path = os.path.join(root, name)
                write(path, rng.randbytes(os.path.getsize(path)))


def steps(*setups: Callable[[str, Shared], None]) -> Callable[[str, Shared], None]:
    def setup(tmp: str, shared: Shared) -> None:
        for s in setups:
            s(tmp, shared)

    return setup


# --- the catalogue -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    argv: list[str]  # argv[0] is the program; {tmp}, {file}, {dir}, {copy}, {run}, {prep}, {corpus} are filled in
    code: int
    message: str  # regex the last stderr line must contain (after `<program>: `)
    setup: Callable[[str, Shared], None] | None = None
    devices: int = 1
    takes_lock: bool = False  # fbt-train took the workdir's lock before failing (may rewrite its holder line)
    needs_permissions: bool = False  # relies on file permissions, which root ignores
    env: tuple[tuple[str, str], ...] = ()  # extra environment variables ({file} etc. filled in)
    xfail: str = ""  # "needs fix in <file>: <what>"


def case(id: str, argv: list[str], code: int, message: str, **kwargs) -> Case:
    return Case(id, argv, code, message, **kwargs)


def file_case(id: str, argv: list[str], flag: str, name: str, data: bytes | str | None, message: str) -> Case:
    """`argv` with `flag` naming the file `name` in the case's directory, which holds `data` (None:
    some text, but the file is unreadable); exit 2."""
    if data is None:
        setup, kwargs = unreadable_file(name), {"needs_permissions": True}
    else:
        setup, kwargs = text_file(name, data), {}
    return case(id, [*argv, f"{flag}={{tmp}}/{name}"], 2, message, setup=setup, **kwargs)


def prepared_case(id: str, setup: Callable[[str, Shared], None], message: str) -> Case:
    """Training on a copy of the prepared data ({tmp}/data) that `setup` damaged; exit 2."""
    return case(id, [*TEXT, "--config.data.path={tmp}/data"], 2, message, setup=setup)


def resume_case(id: str, overrides: list[str], code: int, message: str, setup=copy_run) -> Case:
    """Resuming a copy of the trained run ({copy}, made by `setup`) with `overrides`; the failing run
    took the copy's lock first."""
    return case(id, [*RESUME, *overrides], code, message, setup=setup, takes_lock=True)


CASES = [
    # fbt-train: flags and config fields
    case("train-no-config", ["fbt-train"], 2, r"--config must have a value"),
    case("train-missing-config-file", [*NEW[:1], "--config=configs/nope.py"], 2, r"No such file.*configs/nope\.py"),
    case("train-unknown-field", [*NEW, "--config.train.stepz=3"], 2, r"unknown config field stepz.*\"steps\""),
    case("train-unknown-section", [*NEW, "--config.optimiser.learning_rate=0.1"], 2, r"unknown config field optimiser"),
    case("train-unknown-top-level-field", [*NEW, "--config.seeed=1"], 2, r"unknown config field seeed.*\"seed\""),
    case("train-steps-not-an-int", [*NEW, "--config.train.steps=abc"], 2, r"--config.train.steps=abc: invalid literal"),
    case("train-lr-not-a-number", [*NEW, "--config.optimizer.learning_rate=fast"], 2, r"learning_rate=fast"),
    case("train-steps-zero", [*NEW, "--config.train.steps=0"], 2, r"train.steps=0 must be a positive integer"),
    case("train-steps-negative", [*NEW, "--config.train.steps=-5"], 2, r"train.steps=-5 must be a positive integer"),
    case("train-batch-zero", [*NEW, "--config.train.batch_size=0"], 2, r"batch_size=0 must be a positive integer"),
    case("train-batch-negative", [*NEW, "--config.train.batch_size=-8"], 2, r"batch_size=-8 must be a positive"),
    case("train-embed-dim-zero", [*NEW, "--config.model.embed_dim=0"], 2, r"model.embed_dim=0 must be a positive"),
    case("train-seq-len-zero", [*NEW, "--config.data.seq_len=0"], 2, r"data.seq_len=0 is too short; use at least 2"),
    case("train-heads-zero", [*NEW, "--config.model.num_heads=0"], 2, r"model.num_heads=0 must be a positive"),
    case("train-heads-not-dividing", [*NEW, "--config.model.num_heads=3"], 2, r"num_heads=3 does not divide.*choose"),
    case("train-unknown-dtype", [*NEW, "--config.model.param_dtype=float16"], 2, r"'float16' is unknown; use one of"),
    case("train-attention-unknown", [*NEW, "--config.model.attention_impl=flash"], 2, r"'flash' is unknown; use one"),
    case(
        "train-attention-cudnn-on-a-cpu",
        [*NEW, "--config.model.attention_impl=cudnn"],
        2,
        r"attention_impl=cudnn: cuDNN runs on GPUs only \(this backend is cpu\); .*use one of: xla, dot_product",
    ),
    case(
        "train-attention-pallas-with-a-sliding-window",
        [
            *TEXT,
            "--config.data.path={prep}",
            "--config.model.attention_impl=pallas_gpu",
            "--config.model.sliding_window=8",
        ],
        2,
        r"pallas_gpu: the Pallas-Triton kernel has no sliding window; for float32 packed rows, sliding window 8",
    ),
    case(
        "train-batch-not-divisible-by-data-parallel",
        [*NEW, "--config.mesh.data=8", "--config.train.batch_size=12"],
        2,
        r"batch_size=12 is not divisible by the data-parallel size 8.*use a multiple of 8",
        devices=8,
    ),
    case("train-lr-inf", [*NEW, "--config.optimizer.learning_rate=inf"], 2, r"learning_rate=inf is not a finite"),
    case(
        "dry-run-topology-rejected",
        [*NEW, "--config.dry_run=True", "--config.dry_run_topology=v5e:3x3"],
        2,
        r"dry_run_topology='v5e:3x3': the TPU compiler rejects it \(INVALID_ARGUMENT.*e\.g\. v5e:8x8, v5p:4x4x4",
    ),
    case(
        "dry-run-slices-without-topology",
        [*NEW, "--config.dry_run=True", "--config.dry_run_num_slices=2"],
        2,
        r"dry_run_num_slices=2: slices of a dry_run_topology",
    ),
    case("train-lr-nan", [*NEW, "--config.optimizer.learning_rate=nan"], 2, r"learning_rate=nan is not a finite"),
    case("train-noise-nan", [*NEW, "--config.passes.noise_std=nan"], 2, r"passes.noise_std=nan is not a finite"),
    case("train-lr-negative", [*NEW, "--config.optimizer.learning_rate=-1"], 2, r"learning_rate=-1.0 must be positive"),
    case("train-warmup-too-long", [*NEW, "--config.optimizer.warmup_steps=4"], 2, r"warmup_steps=4.*shorten"),
    case(
        "train-schedule-weights-not-summing-to-one",
        [*NEW, "--config.passes.schedule=0:1=0.5,2=0.3"],
        2,
        r"sum to 0.8, not 1; rescale them",
    ),
    case("train-schedule-k-zero", [*NEW, "--config.passes.schedule=0:0"], 2, r"K=0 is below 1"),
    case("train-schedule-k-negative", [*NEW, "--config.passes.schedule=0:-1=1"], 2, r"K=-1 is below 1"),
    case("train-schedule-no-start", [*NEW, "--config.passes.schedule=2"], 2, r"lacks 'start:'; write phases as"),
    case("train-schedule-late-first-phase", [*NEW, "--config.passes.schedule=2:1"], 2, r"must start at 0"),
    # fbt-train: paths and URLs
    case("train-workdir-gs-one-slash", [*NEW, "--config.workdir=gs:/bucket"], 2, r"not a valid URL; write it as gs://"),
    case("train-workdir-gs-no-bucket", [*NEW, "--config.workdir=gs://"], 2, r"names no valid bucket"),
    case("train-workdir-gs-bad-bucket", [*NEW, "--config.workdir=gs://UPPER_case!"], 2, r"names no valid bucket"),
    case("train-workdir-s3", [*NEW, "--config.workdir=s3://x/y"], 2, r"scheme s3://, which is not supported; use"),
    case("train-checkpoint-dir-s3", [*NEW, "--config.checkpoint.dir=s3://x/y"], 2, r"checkpoint.dir='s3://x/y'"),
    case("train-data-cache-url", [*NEW, "--config.data.cache_dir=gs://bucket/c"], 2, r"must be a local directory"),
    case("train-workdir-is-a-file", [*NEW, "--config.workdir={file}"], 2, r"workdir='.*a-file' is a file; give a dir"),
    case(
        "train-workdir-under-a-file",
        [*NEW, "--config.workdir={file}/run"],
        2,
        r"workdir='.*a-file/run' cannot be created: .*a-file is a file; give a directory",
    ),
    case(
        "train-compilation-cache-is-a-file",
        [*NEW, "--config.train.compilation_cache_dir={file}"],
        2,
        r"--config.train.compilation_cache_dir='.*a-file' is a file; give a directory",
    ),
    case(
        "train-compilation-cache-variable-is-a-file",
        NEW,
        2,
        r"^fbt-train: config error: JAX_COMPILATION_CACHE_DIR='.*a-file' is a file; unset it or point it at a directory",
        env=(("JAX_COMPILATION_CACHE_DIR", "{file}"),),
    ),
    case("train-profile-window-outside", [*NEW, "--config.train.profile_steps=2:99"], 2, r"outside the run's steps"),
    case("train-profile-window-malformed", [*NEW, "--config.train.profile_steps=10"], 2, r"is not START:END; give"),
    case(
        "train-checkpoint-dir-is-a-file",
        [*NEW, "--config.checkpoint.dir={file}"],
        2,
        r"--config.checkpoint.dir='.*a-file' is a file; give a directory",
    ),
    case(
        "train-data-cache-under-a-file",
        [*NEW, "--config.data.cache_dir={file}/cache"],
        2,
        r"--config.data.cache_dir='.*' cannot be created: .*a-file is a file",
    ),
    case(
        "train-workdir-read-only",
        [*NEW, "--config.workdir={tmp}/ro"],
        2,
        r"^fbt-train: config error: --config.workdir='.*/ro' is not writable",
        setup=read_only_workdir,
        needs_permissions=True,
    ),
    # fbt-train: data
    case("train-unknown-source", [*NEW, "--config.data.source=csv"], 2, r"data.source='csv' is unknown; use one of"),
    case("train-tfds-without-name", [*NEW, "--config.data.source=tfds"], 2, r"needs data.tfds_name"),
    case("train-task-vocab-too-small", [*NEW, "--config.data.group=S5"], 2, r"vocab_size=6 is smaller.*=120 or larger"),
    case(
        "train-text-vocab-too-small",
        [*NEW, "--config.data.source=text", "--config.data.path={corpus}/*.txt"],
        2,
        r"vocab_size=6 is smaller.*257 tokens for data.tokenizer='byte'.*vocab_size=257 or larger",
    ),
    case("train-text-no-path", TEXT, 2, r"needs data.path"),
    case("train-text-no-file", [*TEXT, "--config.data.path={tmp}/none/*.txt"], 2, r"matches no file; check the path"),
    file_case(
        "train-text-empty-file",
        TEXT,
        "--config.data.path",
        "empty.txt",
        b"",
        r"empty\.txt is empty; delete it or drop it from data.path",
    ),
    file_case(
        "train-text-not-utf8",
        TEXT,
        "--config.data.path",
        "latin1.txt",
        "caf\xe9 cr\xe8me br\xfbl\xe9e ".encode("latin-1") * 20,
        r"latin1\.txt is not UTF-8 text .*; convert it to UTF-8 or drop it from data.path",
    ),
    file_case(
        "train-text-bad-jsonl",
        TEXT,
        "--config.data.path",
        "docs.jsonl",
        '{"text": "fine"}\n{"body": "no text field"}\n',
        r"docs\.jsonl:2 is not a JSON object with a 'text' string; write one",
    ),
    file_case(
        "train-text-unreadable", TEXT, "--config.data.path", "locked.txt", None, r"is not readable; fix its permissions"
    ),
    case(
        "train-tokenizer-missing",
        [*TEXT, "--config.data.path={corpus}/*.txt", "--config.data.tokenizer={tmp}/none.model"],
        2,
        r"neither 'byte' nor an existing tokenizer \(a SentencePiece .model, a tokenizer.json or a save_pretrained directory\); give 'byte' or",
    ),
    case(
        "train-prepared-seq-len-differs",
        [*TEXT, "--config.data.path={prep}", "--config.data.seq_len=32"],
        2,
        r"has seq_len 16 but data.seq_len=32; prepare it again with this length or set data.seq_len",
    ),
    case(
        "train-prepared-vocab-too-small",
        [*NEW, "--config.data.source=text", "--config.data.path={prep}"],
        2,
        r"vocab_size=6 is smaller than the data's vocabulary \(257 tokens for the prepared data",
    ),
    case(
        # Nothing held out and no eval batches: the contraction monitor still reads the split (issue #58).
        "train-prepared-no-validation-split-for-the-monitor",
        [*TEXT, "--config.data.path={tmp}/noval", "--config.eval.num_batches=0"],
        2,
        r"validation split in .*noval is empty, and the contraction monitor \(eval.contraction_passes=4; 0 turns it "
        r"off\) reads it; prepare the data again with fbt-prepare --validation-fraction above 0, or turn off",
        setup=prepared_without_validation,
    ),
    case("train-prepared-no-meta", [*TEXT, "--config.data.path={dir}"], 2, r"no meta.json\); run fbt-prepare"),
    prepared_case(
        "train-prepared-meta-garbled",
        garble_meta,
        r"meta.json cannot be read \(JSONDecodeError.*prepare the data again",
    ),
    prepared_case(
        "train-records-garbled-in-the-middle",
        garble(1 / 3, 4096),
        r"train.array_record are damaged .*prepare the data again with fbt-prepare",
    ),
    prepared_case(
        "train-records-garbled-whole",
        garble(0, None),
        r"train.array_record are damaged .*prepare the data again with fbt-prepare",
    ),
    prepared_case(
        "train-records-truncated",
        truncate(0.5),
        r"train.array_record hold \d+ bytes, but fbt-prepare wrote \d+; .*prepare the data again",
    ),
    prepared_case("train-records-emptied", truncate(0), r"train.array_record hold 0 bytes, but fbt-prepare wrote \d+"),
    # fbt-train: checkpoints of the trained run (resumed on a copy; init_from reads the original)
    resume_case(
        "train-resume-another-model",
        ["--config.model.embed_dim=128"],
        2,
        r"different model \(model.embed_dim: checkpoint 64, config 128\); use a new workdir, or the original",
    ),
    resume_case(
        "train-resume-another-optimizer",
        ["--config.optimizer.grad_clip_norm=0"],
        2,
        r"another layout \(optimizer.grad_clip_norm: checkpoint 1.0, config 0.0\); resume with the original",
    ),
    resume_case(
        "train-resume-changed-seed",
        ["--config.seed=1"],
        2,
        r"changed seed: 0 -> 1.*--config.checkpoint.allow_resume_changes=True",
    ),
    resume_case(
        "train-resume-changed-batch",
        ["--config.train.batch_size=16"],
        2,
        r"changed train.batch_size: 32 -> 16.*--config.checkpoint.allow_resume_changes=True",
    ),
    resume_case(
        "train-resume-damaged-checkpoints",
        [],
        5,
        r"checkpoint error: none of the 2 checkpoint\(s\) .* nothing was changed\. .*restart_from_scratch",
        setup=damage_checkpoints,
    ),
    case(
        "train-init-from-missing",
        [*NEW, "--config.init_from={tmp}/none"],
        2,
        r"init_from='.*/none' is not a directory; give a run's workdir",
    ),
    case(
        "train-init-from-without-checkpoints",
        [*NEW, "--config.init_from={dir}"],
        2,
        r"init_from='.*' holds no checkpoint; train with --config.checkpoint.every_steps > 0 first",
    ),
    case(
        "train-init-from-another-model",
        [*NEW, "--config.init_from={run}", "--config.model.embed_dim=128"],
        2,
        r"checkpoints/4 was written by a different model \(model.embed_dim: checkpoint 64, config 128\).*init_from",
    ),
    # fbt-decode
    case("decode-missing-checkpoint", [*DECODE[:1], "--checkpoint={tmp}/none", *DECODE[2:]], 2, r"is not a directory"),
    case("decode-checkpoint-is-a-file", ["fbt-decode", "--checkpoint={file}", "--prompt=1"], 2, r"is not a directory"),
    case("decode-checkpoint-bad-url", ["fbt-decode", "--checkpoint=gs:/x", "--prompt=1"], 2, r"not a valid URL"),
    case(
        "decode-no-checkpoint-in-dir",
        ["fbt-decode", "--checkpoint={dir}", "--prompt=1"],
        2,
        r"holds no checkpoint; train with --config.checkpoint.every_steps > 0 first",
    ),
    case(
        "decode-damaged-checkpoints",
        ["fbt-decode", "--checkpoint={copy}", "--prompt=1"],
        5,
        r"checkpoint error: .*none of its 2 checkpoint\(s\) restores \(.*\)[;.] \S",
        setup=damage_checkpoints,
    ),
    case("decode-unknown-mode", [*DECODE, "--mode=beam"], 2, r"--mode='beam' is unknown; use one of"),
    case(
        "decode-prompt-longer-than-context",
        [*DECODE, "--context-len=16", "--max-new-tokens=32"],
        2,
        r"3 tokens \+ --max-new-tokens=32 exceeds the context of 16 tokens.*shorten the prompt",
    ),
    case(
        "decode-generation-beyond-the-trained-length",
        [*DECODE, "--max-new-tokens=32"],
        2,
        r"exceeds the context of 16 tokens \(the run trained on 16\); shorten the prompt or the generation, or raise",
    ),
    case("decode-max-new-tokens-zero", [*DECODE, "--max-new-tokens=0"], 2, r"--max-new-tokens=0 must be at least 1"),
    case("decode-max-new-tokens-negative", [*DECODE, "--max-new-tokens=-3"], 2, r"--max-new-tokens=-3 must be"),
    case("decode-temperature-negative", [*DECODE, "--temperature=-1"], 2, r"--temperature=-1.0 must be a finite"),
    case("decode-temperature-nan", [*DECODE, "--temperature=nan"], 2, r"--temperature=nan must be a finite"),
    case("decode-top-p-zero", [*DECODE, "--top-p=0"], 2, r"--top-p=0.0 must be in \(0, 1\]"),
    case("decode-top-p-above-one", [*DECODE, "--top-p=1.5"], 2, r"--top-p=1.5 must be in \(0, 1\]"),
    case("decode-top-k-negative", [*DECODE, "--top-k=-1"], 2, r"--top-k=-1 is negative; use 0"),
    case("decode-prefill-passes-zero", [*DECODE, "--prefill-passes=0"], 2, r"--prefill-passes=0 must be at least 1"),
    case("decode-context-len-negative", [*DECODE, "--context-len=-1"], 2, r"--context-len=-1 is negative; use 0"),
    case("decode-output-is-a-directory", [*DECODE, "--output={dir}"], 2, r"is a directory; give a file path"),
    case("decode-output-dir-missing", [*DECODE, "--output={tmp}/no/out.jsonl"], 2, r"does not exist; create it"),
    case(
        "decode-prompts-file-missing",
        [*DECODE[:2], "--prompts-file={tmp}/prompts.txt"],
        2,
        r"--prompts-file='.*prompts.txt' cannot be read \(No such file or directory\)",
    ),
    file_case(
        "decode-prompts-file-not-utf8",
        DECODE[:2],
        "--prompts-file",
        "prompts.txt",
        b"1 2 \xff\xfe\n",
        r"is not UTF-8 text",
    ),
    case("decode-no-prompt", DECODE[:2], 2, r"no prompt given; use --prompt or --prompts-file"),
    case("decode-empty-prompt", [*DECODE[:2], "--prompt= "], 2, r"a --prompt is empty"),
    case("decode-prompt-not-token-ids", [*DECODE[:2], "--prompt=a b"], 2, r"'a b' is not space-separated token ids"),
    case(
        "decode-token-outside-vocab",
        [*DECODE[:2], "--prompt=1 99", "--max-new-tokens=4"],
        2,
        r"token id 99 is outside the vocabulary",
    ),
    case("decode-stop-outside-vocab", [*DECODE, "--stop=99"], 2, r"--stop=99 is outside .*give a token id below 6"),
    case("decode-flag-not-an-int", [*DECODE, "--max-new-tokens=abc"], 2, r"error: argument --max-new-tokens: invalid"),
    case("decode-no-checkpoint-flag", ["fbt-decode", "--prompt=1"], 2, r"error: the following arguments are required"),
    # fbt-eval
    case("eval-missing-checkpoint", ["fbt-eval", "--checkpoint={tmp}/none", "--output={tmp}/e"], 2, r"not a directory"),
    case(
        "eval-damaged-checkpoints",
        ["fbt-eval", "--checkpoint={copy}", "--output={tmp}/eval"],
        5,
        r"checkpoint error: .*none of its 2 checkpoint\(s\) restores \(.*\)[;.] \S",
        setup=damage_checkpoints,
    ),
    case("eval-output-is-a-file", [*EVAL[:2], "--output={file}"], 2, r"--output='.*' is a file; give a directory"),
    case("eval-output-under-a-file", [*EVAL[:2], "--output={file}/e"], 2, r"cannot be created: .* is a file"),
    case(
        "eval-max-depth-beyond-twice-seq-len",
        [*EVAL, "--max-depth=33"],
        2,
        r"--max-depth=33 exceeds twice the evaluation length 16.*use --max-depth <= 32",
    ),
    case("eval-max-depth-negative", [*EVAL, "--max-depth=-1"], 2, r"--max-depth=-1 must be at least 1"),
    case("eval-max-depth-zero", [*EVAL, "--max-depth=0"], 2, r"--max-depth=0 must be at least 1 \(leave it out"),
    case("eval-batch-size-zero", [*EVAL, "--batch-size=0"], 2, r"--batch-size=0 must be at least 1"),
    case("eval-seq-len-too-short", [*EVAL, "--seq-len=2"], 2, r"--seq-len=2 is too short; use at least 4"),
    case("eval-no-output-flag", EVAL[:2], 2, r"error: the following arguments are required: --output"),
    # fbt-prepare
    case("prepare-no-input", PREPARE, 2, r"give exactly one of --input .* or --tfds-name"),
    case(
        "prepare-input-missing",
        [*PREPARE, "--input={tmp}/none/*.txt"],
        2,
        r"--input='.*' matches no file; check the path",
    ),
    file_case(
        "prepare-input-empty",
        PREPARE,
        "--input",
        "empty.txt",
        b"",
        r"empty\.txt is empty; delete it or drop it from --input",
    ),
    file_case(
        "prepare-input-not-utf8",
        PREPARE,
        "--input",
        "latin1.txt",
        "na\xefve fa\xe7ade ".encode("latin-1") * 20,
        r"is not UTF-8 text .*; convert it to UTF-8 or drop it from --input",
    ),
    file_case(
        "prepare-input-unreadable",
        PREPARE,
        "--input",
        "locked.txt",
        None,
        r"is not readable; fix its permissions or drop it from --input",
    ),
    file_case(
        "prepare-input-too-short",
        PREPARE,
        "--input",
        "short.txt",
        "tiny\n",
        r"has \d+ tokens, fewer than one sequence of seq_len\+1 = 17; use more text or a shorter",
    ),
    case(
        "prepare-output-exists",
        [*PREPARE[:1], "--output={dir}", *PREPARE[2:], "--input={corpus}/*.txt"],
        2,
        r"already exists and is not an fbt-prepare output \(it holds kept.txt\); choose a new directory",
    ),
    case(
        "prepare-output-under-a-file",
        [*PREPARE[:1], "--output={file}/p", *PREPARE[2:], "--input={corpus}/*.txt"],
        2,
        r"cannot be created: .* is a file",
    ),
    case(
        "prepare-output-bad-url",
        [*PREPARE[:1], "--output=gs:/b", *PREPARE[2:], "--input={corpus}/*.txt"],
        2,
        r"not a valid URL",
    ),
    case(
        "prepare-seq-len-too-short",
        [*PREPARE[:2], "--seq-len=1", "--input={corpus}/*.txt"],
        2,
        r"--seq-len 1 is too short; use at least 2",
    ),
    case("prepare-seq-len-not-an-int", [*PREPARE[:2], "--seq-len=abc"], 2, r"error: argument --seq-len: invalid int"),
    case(
        "prepare-tokenizer-missing",
        [*PREPARE, "--input={corpus}/*.txt", "--tokenizer={tmp}/none.model"],
        2,
        r"--tokenizer='.*none.model' is neither 'byte' nor an existing tokenizer \(a SentencePiece .model, a tokenizer.json or a save_pretrained directory\); give",
    ),
    case(
        "prepare-tokenizer-not-a-model",
        [*PREPARE, "--input={corpus}/*.txt", "--tokenizer={file}"],
        2,
        r"--tokenizer='.*' is not a readable SentencePiece model \(.*\); give 'byte' or",
    ),
    case(
        "prepare-validation-fraction-above-one",
        [*PREPARE, "--input={corpus}/*.txt", "--validation-fraction=1.5"],
        2,
        r"--validation-fraction=1.5 must be in \[0, 1\); give the share",
    ),
    case(
        "prepare-workers-zero",
        [*PREPARE, "--input={corpus}/*.txt", "--workers=0"],
        2,
        r"--workers=0 must be at least 1",
    ),
    case(
        "prepare-shard-outside-the-count",
        [*PREPARE, "--input={corpus}/*.txt", "--num-shards=2", "--shard-index=2"],
        2,
        r"shard index 2 is outside the 2 shard\(s\) .*; use an index in 0..1",
    ),
    file_case(
        "prepare-tokenizer-json-malformed",
        [*PREPARE, "--input={corpus}/*.txt"],
        "--tokenizer",
        "tokenizer.json",
        '{"model": {"type": "BPE", ',
        r"--tokenizer: '.*tokenizer.json' is not a valid tokenizer.json \(.*\); give a tokenizer.json saved by",
    ),
    file_case(
        "prepare-parquet-without-the-column",
        PREPARE,
        "--input",
        "shard.parquet",
        parquet_bytes({"body": ["some text"] * 50}),
        r"shard.parquet has no column 'text'; its columns are \['body'\]",
    ),
    file_case(
        "prepare-gzip-truncated",
        PREPARE,
        "--input",
        "web.jsonl.gz",
        gzip.compress(JSONL)[:-200],
        r"web.jsonl.gz is truncated: its gzip data ends mid-stream, after \d+ line\(s\) \(at compressed byte \d+\)",
    ),
    file_case(
        "prepare-zstd-truncated",
        PREPARE,
        "--input",
        "web.jsonl.zst",
        zstd_bytes(JSONL)[:-100],
        r"web.jsonl.zst is truncated: .*after \d+ line\(s\)",
    ),
    case(
        "prepare-input-in-an-unreadable-directory",
        [*PREPARE, "--input={tmp}/locked/*.txt"],
        2,
        r"the directory .*locked cannot be read by this user, so its files cannot be listed; fix its permissions",
        setup=unreadable_dir("locked"),
        needs_permissions=True,
    ),
    # fbt-train on prepared data and mixtures
    prepared_case(
        "train-records-file-missing", remove_records_file, r"train.array_record are missing \(meta.json lists them\)"
    ),
    case(
        "train-prepared-dir-unreadable",
        [*TEXT, "--config.data.path={tmp}/locked"],
        2,
        r"cannot be read: permission denied on .*locked; fix its permissions",
        setup=unreadable_dir("locked", prepared=True),
        needs_permissions=True,
    ),
    case(
        "train-mixture-negative-weight",
        [*NEW, "--config.data.source=mixture", "--config.data.mixture=a={prep}:0.5,b={prep}:-0.5"],
        2,
        r"data.mixture: the weight of 'b=.*:-0.5' is -0.5; weights must be >= 0",
    ),
    case(
        "train-mixture-weights-sum-to-zero",
        [*NEW, "--config.data.source=mixture", "--config.data.mixture=a={prep}:0,b={prep}:0"],
        2,
        r"the weights sum to 0; give at least one dataset a positive weight",
    ),
    case(
        "train-mixture-not-prepared",
        [*NEW, "--config.data.source=mixture", "--config.data.mixture=a={prep}:1,b={dir}:1"],
        2,
        r"data.mixture: b=.*a-dir is not a prepared dataset|a-dir holds no prepared data",
    ),
    # launch/local.sh
    case("local-no-process-count", ["launch/local.sh"], 2, r"NUM_PROCESSES is missing; usage: launch/local.sh"),
    case("local-bad-process-count", ["launch/local.sh", "zero"], 2, r"must be a positive integer \(got 'zero'\)"),
    case(
        "local-bad-config-field",
        ["launch/local.sh", "2", *NEW[1:], "--config.train.stepz=3"],
        2,
        r"process \d exited with status 2: fbt-train: unknown config field stepz.*\"steps\"",
    ),
]


def snapshot(roots: list[str]) -> dict[str, str]:
    """path → digest of every file under `roots`."""
    out = {}
    for root in roots:
        for directory, _, files in os.walk(root):
            for name in files:
                path = os.path.join(directory, name)
                try:
                    with open(path, "rb") as f:
                        out[path] = hashlib.blake2b(f.read(), digest_size=16).hexdigest()
                except PermissionError:  # an unreadable input of a case: compared by its mode
                    out[path] = f"mode {os.stat(path).st_mode:o}"
    return out


def check(case: Case, tmp: str, shared: Shared) -> None:
    """Run one case in its directory `tmp` (which also holds an existing file and directory)."""
    os.makedirs(os.path.join(tmp, "a-dir"))
    write(os.path.join(tmp, "a-dir", "kept.txt"), "an existing directory's file\n")
    write(os.path.join(tmp, "a-file"), "an existing file\n")
    if case.setup is not None:
        case.setup(tmp, shared)
    values = {
        "tmp": tmp,
        "file": os.path.join(tmp, "a-file"),
        "dir": os.path.join(tmp, "a-dir"),
        "copy": os.path.join(tmp, "copy"),  # made by the copy_run set-up
    }

    class Fill(dict):
        def __missing__(self, key: str) -> str:
            return shared[key]

    argv = [arg.format_map(Fill(values)) for arg in case.argv]
    roots = [tmp, *shared.values()]
    before = snapshot(roots)
    start = time.perf_counter()
    env = {**environment(case.devices, tmp), **{k: v.format_map(Fill(values)) for k, v in case.env}}
    result = run(argv, env)
    seconds = time.perf_counter() - start
    after = snapshot(roots)
    output = result.stdout + result.stderr
    where = f"{' '.join(argv)}\n--- exit {result.returncode} after {seconds:.1f}s; stderr:\n{result.stderr[-3000:]}"

    assert result.returncode == case.code, where
    assert "Traceback" not in output, where
    lines = [line.strip() for line in re.split(r"[\r\n]", result.stderr) if line.strip()]
    program = PROGRAM_NAMES.get(argv[0], argv[0])
    # One line; under the launcher, one per process that failed and then the launcher's own.
    before_last = lines[:-1] if program == "local.sh" else []
    assert lines and all(line.startswith("fbt-train: ") for line in before_last), f"more than one line\n{where}"
    assert len(lines) == len(before_last) + 1 and lines[-1].startswith(f"{program}: "), f"not one line\n{where}"
    assert re.search(case.message, lines[-1]), f"message does not match {case.message!r}\n{where}"
    assert not any(marker in output for marker in COMPILE_MARKERS), where
    changed = sorted(
        path
        for path, digest in before.items()
        if after.get(path) != digest and not (case.takes_lock and os.path.basename(path) == LOCK_NAME)
    )
    missing = [path for path in before if path not in after]
    assert not changed and not missing, f"changed: {changed}, removed: {missing}\n{where}"


def params() -> list:
    """One pytest param per case; a case waiting for a fix elsewhere is a strict xfail."""
    out = []
    for c in CASES:
        marks = [pytest.mark.xfail(strict=True, reason=c.xfail)] if c.xfail else []
        out.append(pytest.param(c, id=c.id, marks=marks))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("case", params())
def test_bad_input_is_one_line_and_a_documented_exit_code(case, shared, tmp_path):
    if case.needs_permissions and os.geteuid() == 0:
        pytest.skip("runs as root, which ignores file permissions: the input cannot be made unreadable/read-only")
    try:
        check(case, str(tmp_path), shared)
    finally:
        for directory, _, _ in os.walk(tmp_path):  # let pytest clean up what a case made read-only
            os.chmod(directory, stat.S_IRWXU)


def test_the_catalogue_is_large_and_names_unique():
    assert len(CASES) >= 45
    assert len({c.id for c in CASES}) == len(CASES)


# --- cases that need more than a table row -------------------------------------------------------------


def test_a_workdir_held_by_a_live_run_exits_6_and_keeps_its_lock(tmp_path):
    """The lock of a live run (here: held by this test process) is read, never rewritten."""
    workdir = tmp_path / "busy"
    workdir.mkdir()
    lock_path = workdir / LOCK_NAME
    lock_path.write_text("pid 4242 on host elsewhere, since 2024-01-01 00:00:00")
    (workdir / "metrics.jsonl").write_text('{"step": 1}\n')
    with open(lock_path, "a+", encoding="utf-8") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        before = snapshot([str(workdir)])
        result = run([*TRAIN, f"--config.workdir={workdir}"], environment(1, str(tmp_path)))
        after = snapshot([str(workdir)])
    last = [line for line in result.stderr.splitlines() if line.strip()][-1]
    assert result.returncode == 6, result.stderr[-2000:]
    assert last.startswith("fbt-train: workdir ") and "in use by a live fbt-train (pid 4242 on host elsewhere" in last
    assert "choose another --config.workdir" in last and "Traceback" not in result.stderr
    assert not any(marker in result.stdout + result.stderr for marker in COMPILE_MARKERS)
    assert {p: d for p, d in after.items() if p in before} == before  # the lock file too


def test_records_damaged_beyond_the_checked_size_fail_in_one_line_when_read(shared, tmp_path):
    """Files too large to be checksummed at every start (records.VERIFY_MAX_BYTES) are checked by
    size only; damage inside them is reported as one line when a batch reads it."""
    from fbt_jax.data import records
    from fbt_jax.errors import ConfigError

    path = copy_prepared(str(tmp_path), shared)
    data = bytearray(open(path, "rb").read())
    middle = data.find(b"\0" * 1024) // 2  # the middle of its records (ArrayRecord pads its blocks with zeros)
    data[middle : middle + 256] = random.Random(1).randbytes(256)
    write(path, bytes(data))
    limit = records.VERIFY_MAX_BYTES
    records.VERIFY_MAX_BYTES = 0
    try:
        source = records.PackedRecords(os.path.dirname(path), "train")
    finally:
        records.VERIFY_MAX_BYTES = limit
    with pytest.raises(ConfigError, match=r"train.array_record are damaged .*prepare the data again") as err:
        for start in range(0, len(source), 64):
            source.examples(list(range(start, min(start + 64, len(source)))))
    assert "\n" not in str(err.value)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def screen(text: str) -> list[str]:
    """What a terminal shows of `text`: each line as its last carriage return left it."""
    return [line.rsplit("\r", 1)[-1].rstrip() for line in text.split("\n")]


def test_a_progress_bar_is_cleared_before_an_error_and_kept_after_success():
    """On a terminal the error's one line is alone (the bar's last frame used to stay above it); on
    a pipe or a log file no bar is drawn at all, so the catalogue's single line holds there too."""
    from fbt_jax import progress

    terminal = Terminal()
    with pytest.raises(ValueError), progress.shown(10, desc="prepare", file=terminal) as bar:
        bar.update(3)
        bar.refresh()
        raise ValueError("bad input")
    assert "prepare:  30%" in terminal.getvalue() and screen(terminal.getvalue())[-1] == ""
    terminal = Terminal()
    with progress.shown(2, desc="prepare", file=terminal) as bar:
        bar.update(2)
    assert [line for line in screen(terminal.getvalue()) if line][-1].startswith("prepare: 100%")
    pipe = io.StringIO()
    with progress.shown(2, desc="prepare", file=pipe) as bar:
        bar.update(2)
    assert pipe.getvalue() == ""
