"""How fast does fbt-prepare tokenise, and does its memory stay flat as the corpus grows?

Measures, in one run, on real text available offline (the Python standard library's .py sources,
one document a file, written into 16 .jsonl.zst files):

1. the tokens/s `fbt-prepare` reports (its own log line: tokenise + pack + write, timed inside
   the preparation, so interpreter start-up and planning are left out) for three tokenizers:
   `byte`, a SentencePiece model (~4000 pieces) and a byte-level BPE tokenizer.json (~8000 ids),
   both trained here at the start on part of the corpus; each on one pinned core
   (`taskset -c 0`, RAYON_NUM_THREADS=1, --workers=1) and with --workers=2 unpinned. Every run is
   a subprocess; the configurations are interleaved round by round and the medians reported. The
   datasets of one tokenizer must be the same file for file whatever the workers (else exit 1).
2. the peak RSS of a one-worker BPE preparation (the child's own ru_maxrss, from wait4) of a
   corpus S (a quarter of the corpus, in 4 files) and of a corpus 4S holding S's documents four
   times over (each copy made distinct by a marker line) in four times as many files of the same
   size, as corpora grow: it should not grow with the corpus. Then the same two corpora each in
   one file, i.e. one unit 4× larger, to show what memory does within a unit. S's files are larger
   than one encode batch (preparation.BATCH_BYTES of text); in --smoke they are not, and the
   batch, hence the peak, grows with the unit (the tokenizers library's encodings take some 90
   bytes a token while a batch is encoded).

    python benchmarks/prepare_throughput.py [--rounds 3] [--smoke] [--write-docs PATH]

Prints two tables and, last, one JSON line with every figure. `--smoke` runs the same code on a
~1 MB corpus and one round (half a minute, most of it start-up); `--write-docs PATH` rewrites the
`benchmarks/prepare_throughput.py` block of the Markdown file PATH (see docs_block.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import docs_block  # noqa: E402

NUM_FILES = 16
CORPUS_BYTES, SMOKE_CORPUS_BYTES = 24 << 20, 1 << 20
TRAIN_BYTES = 4 << 20  # the tokenizers are trained on (at most) this much of the corpus
SP_VOCAB, SP_SENTENCES, BPE_VOCAB = 4000, 100_000, 8000
SEQ_LEN = 1024
COPIES = 4  # corpus 4S: every document of S four times
# Corpus S (a quarter of the corpus) is written into this many files (a unit each), each larger than
# one encode batch (preparation.BATCH_BYTES of text); 4S into four times as many of the same size.
RSS_FILES = 4
CONFIGS = ("1 core (pinned)", "2 workers")
TOKENS_PER_S = re.compile(r"\(([\d,]+) tokens/s with \d+ worker")


def stdlib_documents(max_bytes: int) -> list[str]:
    """The standard library's .py files (site-packages left out), in sorted order, one document
    each, until `max_bytes` of UTF-8 text."""
    root = os.path.dirname(os.__file__)
    docs, size = [], 0
    for directory, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "dist-packages", "__pycache__"))
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            with open(os.path.join(directory, name), encoding="utf-8", errors="replace") as f:
                text = f.read()
            if text.strip():
                docs.append(text)
                size += len(text.encode("utf-8"))
                if size >= max_bytes:
                    return docs
    return docs


def write_corpus(
    docs: list[str], directory: str, copies: int = 1, num_files: int = NUM_FILES, separate_copies: bool = False
) -> int:
    """`docs` dealt round-robin into `num_files` .jsonl.zst files in `directory` (zstd frames with
    checksums), `copies` times (copy c > 0 ends with a marker line, so no two documents are the
    same): within each file, or with `separate_copies` each copy in files of its own (a corpus
    grown by more files of the same size); returns the bytes of text written."""
    import zstandard

    os.makedirs(directory)
    compressor = zstandard.ZstdCompressor(level=3, write_checksum=True)
    total = 0
    for group in range(copies if separate_copies else 1):
        for i in range(num_files):
            lines = []
            for copy in (group,) if separate_copies else range(copies):
                for text in docs[i::num_files]:
                    text = text if copy == 0 else f"{text}\n# copy {copy}\n"
                    total += len(text.encode("utf-8"))
                    lines.append(json.dumps({"text": text}))
            with open(os.path.join(directory, f"part-{group}-{i:02d}.jsonl.zst"), "wb") as f:
                f.write(compressor.compress(("\n".join(lines) + "\n").encode("utf-8")))
    return total


def leading(docs: list[str], max_bytes: int) -> list[str]:
    """The first documents of `docs`, until `max_bytes` of UTF-8 text (one at least)."""
    out, size = [], 0
    for text in docs:
        if out and size >= max_bytes:
            break
        out.append(text)
        size += len(text.encode("utf-8"))
    return out


def train_sentencepiece(docs: list[str], directory: str) -> str:
    """A SentencePiece (unigram) model of about SP_VOCAB pieces trained on the lines of `docs`
    (at most SP_SENTENCES of them, sampled); returns the .model path."""
    import sentencepiece

    lines_path = os.path.join(directory, "sp_train.txt")
    with open(lines_path, "w", encoding="utf-8") as f:
        for text in docs:
            f.write("\n".join(line for line in text.splitlines() if line.strip()) + "\n")
    sentencepiece.SentencePieceTrainer.train(
        input=lines_path,
        model_prefix=os.path.join(directory, "sp"),
        vocab_size=SP_VOCAB,
        hard_vocab_limit=False,  # a small (smoke) sample may not have SP_VOCAB pieces in it
        input_sentence_size=SP_SENTENCES,
        shuffle_input_sentence=True,
        num_threads=os.cpu_count() or 1,
        minloglevel=2,
    )
    return os.path.join(directory, "sp.model")


def train_bpe(docs: list[str], directory: str) -> str:
    """A byte-level BPE tokenizer.json of about BPE_VOCAB ids (<|endoftext|> first) trained on
    `docs`; returns its path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte, so any text encodes
        show_progress=False,
    )
    tokenizer.train_from_iterator(docs, trainer)
    path = os.path.join(directory, "tokenizer.json")
    tokenizer.save(path)
    return path


def prepare_argv(corpus: str, tokenizer: str, output: str, workers: int) -> list[str]:
    """The fbt-prepare command line: the script next to this Python (`python -m` where it is missing)."""
    script = os.path.join(os.path.dirname(sys.executable), "fbt-prepare")
    head = [script] if os.path.exists(script) else [sys.executable, "-m", "fbt_jax.data.prepare"]
    return [
        *head,
        f"--input={corpus}/*.jsonl.zst",
        f"--output={output}",
        f"--seq-len={SEQ_LEN}",
        f"--tokenizer={tokenizer}",
        f"--workers={workers}",
        "--num-shards=1",
        "--shard-index=0",
    ]


def one_core() -> tuple[list[str], object, str]:
    """How to pin a command to one core: (argv prefix, preexec_fn, what was used)."""
    core = min(os.sched_getaffinity(0))
    if shutil.which("taskset"):
        return ["taskset", "-c", str(core)], None, f"taskset -c {core}"
    print(f"taskset not found: pinning the one-core runs with os.sched_setaffinity(0, {{{core}}}) instead")
    return [], lambda: os.sched_setaffinity(0, {core}), f"os.sched_setaffinity to core {core}"


def run_prepare(argv: list[str], env: dict[str, str], preexec_fn=None) -> tuple[dict, str, object]:
    """Run fbt-prepare to its end, stdout and stderr to files (so that wait4 cannot block on a
    pipe); returns (meta.json, stdout, the child's rusage). Exits on failure."""
    output = next(a.split("=", 1)[1] for a in argv if a.startswith("--output="))
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(argv, stdout=out, stderr=err, env=env, preexec_fn=preexec_fn)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    if proc.returncode != 0:
        sys.exit(
            f"prepare_throughput.py: {' '.join(argv)} failed ({proc.returncode}):\n{stdout[-2000:]}{stderr[-2000:]}"
        )
    with open(os.path.join(output, "meta.json"), encoding="utf-8") as f:
        meta = json.load(f)
    return meta, stdout, usage


def tokens_per_second(stdout: str) -> float:
    match = TOKENS_PER_S.search(stdout)
    if match is None:
        sys.exit(f"prepare_throughput.py: no 'tokens/s with' line in fbt-prepare's output:\n{stdout[-2000:]}")
    return float(match.group(1).replace(",", ""))


def main() -> None:
    args = docs_block.arguments(
        __doc__,
        "prepare_throughput",
        "a ~1 MB corpus and one round: checks that it runs",
        extra=[("--rounds", dict(type=int, default=3))],
    )
    if args.smoke:
        args.rounds = 1
    from fbt_jax.data.preparation import BATCH_BYTES

    begin = time.perf_counter()
    docs = stdlib_documents(SMOKE_CORPUS_BYTES if args.smoke else CORPUS_BYTES)
    prefix, preexec_fn, pinning = one_core()
    base_env = {k: v for k, v in os.environ.items() if k != "RAYON_NUM_THREADS"}
    envs = {CONFIGS[0]: {**base_env, "RAYON_NUM_THREADS": "1"}, CONFIGS[1]: base_env}

    with tempfile.TemporaryDirectory(prefix="prepare-throughput-") as tmp:
        corpus = os.path.join(tmp, "corpus")
        corpus_bytes = write_corpus(docs, corpus)
        train_docs = leading(docs, TRAIN_BYTES)
        train_seconds = {}
        start = time.perf_counter()
        sp_model = train_sentencepiece(train_docs, tmp)
        train_seconds["sentencepiece"] = time.perf_counter() - start
        start = time.perf_counter()
        bpe_json = train_bpe(train_docs, tmp)
        train_seconds["bpe"] = time.perf_counter() - start
        tokenizers = {"byte": "byte", "sentencepiece": sp_model, "bpe": bpe_json}

        rates = {tok: {config: [] for config in CONFIGS} for tok in tokenizers}
        files, info, run = {}, {}, 0
        for _ in range(args.rounds):
            for tok, spec in tokenizers.items():
                for config in CONFIGS:
                    run += 1
                    output = os.path.join(tmp, f"out-{run}")
                    argv = prepare_argv(corpus, spec, output, 1 if config == CONFIGS[0] else 2)
                    pinned = config == CONFIGS[0]
                    meta, stdout, _ = run_prepare(
                        prefix + argv if pinned else argv, envs[config], preexec_fn if pinned else None
                    )
                    rates[tok][config].append(tokens_per_second(stdout))
                    files.setdefault(tok, {}).setdefault(config, []).append(meta["files"])
                    info[tok] = {
                        "vocab_size": meta["vocab_size"],
                        "tokens": meta["tokens"]["train"] + meta["tokens"]["validation"],
                        "files": len(meta["files"]),
                        "units": meta["units"],
                    }
                    shutil.rmtree(output)
        different = [
            tok
            for tok, by_config in files.items()
            if any(entry != by_config[CONFIGS[0]][0] for runs in by_config.values() for entry in runs)
        ]

        rss_docs = leading(docs, corpus_bytes // 4)
        rss_bytes, rss_mib = {}, {}
        # (a) the corpus grows by more files of one size (how corpora grow); (b) one unit grows.
        for name, copies, files, separate in (
            ("S", 1, RSS_FILES, True),
            ("4S", COPIES, RSS_FILES, True),
            ("S, one file", 1, 1, False),
            ("4S, one file", COPIES, 1, False),
        ):
            directory, output = os.path.join(tmp, "rss-corpus"), os.path.join(tmp, "rss-out")
            rss_bytes[name] = write_corpus(rss_docs, directory, copies, files, separate)
            _, _, usage = run_prepare(prepare_argv(directory, bpe_json, output, 1), base_env)
            rss_mib[name] = usage.ru_maxrss / 1024  # KiB on Linux
            shutil.rmtree(output)
            shutil.rmtree(directory)

    medians = {
        tok: {config: statistics.median(r) for config, r in by_config.items()} for tok, by_config in rates.items()
    }
    speedup = {tok: m[CONFIGS[1]] / m[CONFIGS[0]] for tok, m in medians.items()}
    rss_ratio = rss_mib["4S"] / rss_mib["S"]
    unit_ratio = rss_mib["4S, one file"] / rss_mib["S, one file"]
    results = {
        "corpus": {"documents": len(docs), "files": NUM_FILES, "text_bytes": corpus_bytes},
        "rounds": args.rounds,
        "pinning": pinning,
        "tokenizers": info,
        "train_seconds": train_seconds,
        "tokens_per_second": medians,
        "rounds_tokens_per_second": rates,
        "speedup": speedup,
        "rss_corpus_bytes": rss_bytes,
        "rss_corpus_files": RSS_FILES,
        "batch_bytes": BATCH_BYTES,
        "peak_rss_mib": rss_mib,
        "rss_ratio": rss_ratio,
        "rss_unit_ratio": unit_ratio,
        "wall_seconds": time.perf_counter() - begin,
    }

    print(
        f"corpus: {len(docs):,} stdlib .py documents, {corpus_bytes / 2**20:.1f} MiB of text in {NUM_FILES} "
        f".jsonl.zst files; median of {args.rounds} round(s); one core pinned with {pinning}"
    )
    print(f"{'tokenizer':<15}{'vocab':>7}{'1 core tokens/s':>18}{'2 workers tokens/s':>21}{'speed-up':>10}")
    for tok, m in medians.items():
        print(
            f"{tok:<15}{info[tok]['vocab_size']:>7}{m[CONFIGS[0]]:>18,.0f}{m[CONFIGS[1]]:>21,.0f}{speedup[tok]:>9.2f}x"
        )
    print(f"2-worker speed-up for bpe: {speedup['bpe']:.2f}x; target >= 1.7x")
    print(f"{'peak RSS (bpe, 1 worker)':<26}{'text MiB':>10}{'RSS MiB':>10}")
    for name in rss_mib:
        print(f"{'corpus ' + name:<26}{rss_bytes[name] / 2**20:>10.1f}{rss_mib[name]:>10.0f}")
    print(
        f"peak RSS 4S / S: {rss_ratio:.2f}; target <= 1.25 (flat); one unit 4x larger: {unit_ratio:.2f}"
        + ("" if rss_bytes["S"] / RSS_FILES >= BATCH_BYTES else "; here S's units are smaller than one encode batch")
    )
    if different:
        print(
            f"the 1-core and 2-worker datasets differ for {', '.join(different)} (meta.json files): "
            "the figures measure different work",
            file=sys.stderr,
        )
        print(json.dumps(results))
        sys.exit(1)
    if args.write_docs:
        docs_block.write_block(args.write_docs, "prepare_throughput", docs_text(results, args.smoke))
    print(json.dumps(results))


def machine_line(smoke: bool) -> str:
    """docs_block.machine_line's sentence for a CPU-only benchmark (no jax devices involved)."""
    model = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    line = f"Machine: {os.cpu_count()} CPU cores{f' ({model})' if model else ''}; preparation uses no accelerator."
    if smoke:
        line += " Smoke run (tiny sizes, 1–2 rounds): these figures only show that the benchmark runs."
    return line


def docs_text(results: dict, smoke: bool) -> str:
    """The Markdown block: tokens/s per tokenizer and configuration, then the peak RSS line."""
    rows = [
        [
            f"{tok} (vocab {results['tokenizers'][tok]['vocab_size']})",
            f"{m[CONFIGS[0]]:,.0f}",
            f"{m[CONFIGS[1]]:,.0f}",
            f"{results['speedup'][tok]:.2f}×",
        ]
        for tok, m in results["tokens_per_second"].items()
    ]
    table = docs_block.table(["tokenizer", "1 core (pinned) tokens/s", "2 workers tokens/s", "speed-up"], rows)
    corpus, rss, sizes = results["corpus"], results["peak_rss_mib"], results["rss_corpus_bytes"]
    notes = [
        f"Corpus: {corpus['documents']:,} .py files of the Python standard library as documents, "
        f"{corpus['text_bytes'] / 2**20:.1f} MiB of text in {corpus['files']} .jsonl.zst files; "
        f"tokens/s as fbt-prepare reports them (tokenise + pack + write, start-up left out), median of "
        f"{results['rounds']} interleaved round(s); one core = {results['pinning']} with RAYON_NUM_THREADS=1 and "
        "--workers=1. Both configurations wrote the same dataset, file for file. Target for bpe: ≥ 1.7×.",
        f"Peak RSS of fbt-prepare (bpe, 1 worker): {rss['S']:.0f} MiB for corpus S "
        f"({sizes['S'] / 2**20:.1f} MiB of text in {results['rss_corpus_files']} files), {rss['4S']:.0f} MiB for 4S "
        f"({sizes['4S'] / 2**20:.1f} MiB: S's documents four times, in four times as many files of the same size); "
        f"4S / S = {results['rss_ratio']:.2f} (target ≤ 1.25: flat). Within one unit memory is bounded but not "
        f"flat: S in one file {rss['S, one file']:.0f} MiB, 4S in one file {rss['4S, one file']:.0f} MiB "
        f"({results['rss_unit_ratio']:.2f}×); units are at most 256 MiB of input, so a larger corpus only adds units. "
        f"Documents are encoded in batches of at most {results['batch_bytes'] / 2**20:.0f} MiB of text.",
    ]
    return docs_block.block(
        "prepare_throughput", docs_block.run_arguments(sys.argv[1:]), machine_line(smoke), [table], notes
    )


if __name__ == "__main__":
    main()
