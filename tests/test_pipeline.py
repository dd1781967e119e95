"""Prepared text and TFDS sources, packing, per-process streams, resume, and bad inputs."""

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import small_model_config
from test_config import ROOT, load_config

from fbt_jax.data import records
from fbt_jax.data.documents import is_validation, read_documents, text_files
from fbt_jax.data.packing import pack_documents, record_to_example
from fbt_jax.data.pipeline import StepBatches, batch_iterator, make_source
from fbt_jax.errors import ConfigError
from fbt_jax.feedback import kpass_forward
from fbt_jax.model import build_model

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def write_corpus(directory, num_docs=60, seed=0):
    rng = np.random.default_rng(seed)
    os.makedirs(directory, exist_ok=True)
    docs = [" ".join(rng.choice(WORDS, size=rng.integers(3, 60))) for _ in range(num_docs)]
    with open(os.path.join(directory, "docs.jsonl"), "w") as f:
        for doc in docs[: num_docs // 2]:
            f.write(json.dumps({"text": doc}) + "\n")
    for i, doc in enumerate(docs[num_docs // 2 :]):
        with open(os.path.join(directory, f"doc{i}.txt"), "w") as f:
            f.write(doc)
    return docs


def text_config(tmp_path, path, seq_len=32):
    config = load_config("tiny")
    config.workdir = str(tmp_path / "run")
    config.data.source = "text"
    config.data.path = str(path)
    config.data.seq_len = seq_len
    config.data.validation_fraction = 0.2
    config.model.vocab_size = 257
    return config


def test_packing_keeps_every_token_once_and_restarts_segments():
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 50, size=n) for n in (3, 17, 5, 40, 1, 8, 12)]
    recs = list(pack_documents(docs, seq_len=15))
    assert all(r.shape == (2, 16) for r in recs)
    tokens = np.concatenate([r[0][r[1] > 0] for r in recs])
    assert np.array_equal(tokens, np.concatenate(docs))  # every token once, in order
    for r in recs:
        ex = record_to_example(r)
        seg = r[1]
        for t in range(15):
            if seg[t] == 0:
                assert ex["weights"][t] == 0  # padding never scored
            elif t == 0 or seg[t] != seg[t - 1]:
                assert ex["positions"][t] == 0  # positions restart at each document
            else:
                assert ex["positions"][t] == ex["positions"][t - 1] + 1
            assert ex["weights"][t] == float(seg[t] > 0 and seg[t + 1] == seg[t])  # never across documents
        assert np.array_equal(ex["targets"], r[0][1:])


def test_packed_documents_do_not_see_each_other_in_the_model():
    model = build_model(small_model_config(), seed=0)
    a, b = np.arange(1, 6), np.arange(7, 14)
    (record,) = list(pack_documents([a, b], seq_len=12))
    ex = record_to_example(record)
    batch = {k: jnp.asarray(v)[None] for k, v in ex.items()}
    p = jnp.array([2])
    h = kpass_forward(
        model, batch["inputs"], p, 3, positions_BT=batch["positions"], segment_ids_BT=batch["segment_ids"]
    )[-1]
    alone_a = kpass_forward(model, jnp.asarray(a)[None], p, 3)[-1]
    alone_b = kpass_forward(model, jnp.asarray(b[:-1])[None], p, 3)[-1]  # b's last token is only a target
    assert float(jnp.max(jnp.abs(h[:, :5] - alone_a))) <= 1e-5
    assert float(jnp.max(jnp.abs(h[:, 5:11] - alone_b))) <= 1e-5


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    corpus = tmp_path_factory.mktemp("corpus")
    docs = write_corpus(corpus)
    out = str(tmp_path_factory.mktemp("prep") / "records")
    result = subprocess.run(
        ["fbt-prepare", f"--input={corpus}/*", f"--output={out}", "--seq-len=32", "--validation-fraction=0.2"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    return corpus, out, docs


def test_prepared_splits_hold_every_document_once_and_never_overlap(prepared):
    corpus, out, _ = prepared
    meta = records.read_meta(out)
    expected = list(read_documents(text_files(f"{corpus}/*")))
    for split in ("train", "validation"):
        source = records.PackedRecords(out, split)
        assert meta["records"][split] == len(source)
        stream = np.concatenate(
            [tokens[segments > 0] for tokens, segments in (source._record(i) for i in range(len(source)))]
        )
        documents = [
            bytes(piece[:-1].tolist()).decode() for piece in np.split(stream, np.flatnonzero(stream == 256) + 1)[:-1]
        ]
        held_out = split == "validation"
        assert documents == [d for d in expected if is_validation(d, 0.2) == held_out]
    assert meta["documents"]["train"] + meta["documents"]["validation"] == len(expected)
    assert 0 < meta["documents"]["validation"] < len(expected)


@pytest.mark.parametrize("num_processes", [2, 4])
def test_process_streams_are_disjoint_and_cover_an_epoch(prepared, num_processes):
    _, out, _ = prepared
    source = records.PackedRecords(out, "train")
    batch_size = 8
    per_process = batch_size // num_processes
    steps_per_epoch = len(source) // batch_size
    seen = []
    for p in range(num_processes):
        rows = tuple(range(p * per_process, (p + 1) * per_process))
        batches = StepBatches(source, batch_size, rows, seed=3, shuffle=True)
        seen.append(
            [int(i) for s in range(steps_per_epoch) for i in batches.record_indices(s * batch_size + np.asarray(rows))]
        )
    flat = [i for stream in seen for i in stream]
    assert len(flat) == len(set(flat)) == steps_per_epoch * batch_size  # disjoint, no repeats in the epoch
    assert set(flat) <= set(range(len(source)))
    whole = StepBatches(source, len(source), tuple(range(len(source))), seed=3, shuffle=True)
    assert sorted(whole.record_indices(np.arange(len(source)))) == list(range(len(source)))  # a permutation
    assert list(whole.record_indices(np.arange(len(source)))) != list(range(len(source)))  # shuffled
    nxt = list(whole.record_indices(np.arange(len(source), 2 * len(source))))
    assert sorted(nxt) == list(range(len(source))) and nxt != list(whole.record_indices(np.arange(len(source))))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resumed_pipeline_continues_identically(prepared, num_workers):
    _, out, _ = prepared
    source = records.PackedRecords(out, "train")
    batches = StepBatches(source, 4, (0, 1, 2, 3), seed=1, shuffle=True)
    uninterrupted = batch_iterator(batches, 0, num_workers=num_workers)
    first = [next(uninterrupted) for _ in range(7)]
    uninterrupted.close() if hasattr(uninterrupted, "close") else None
    resumed = batch_iterator(batches, 4, num_workers=num_workers)
    again = [next(resumed) for _ in range(3)]
    resumed.close() if hasattr(resumed, "close") else None
    for a, b in zip(first[4:], again):
        assert a.keys() == b.keys() == {"inputs", "targets", "weights", "segment_ids", "positions"}
        for key in a:
            assert np.array_equal(a[key], b[key])


def test_text_source_prepares_on_first_use_and_trains(tmp_path, prepared):
    corpus, out, _ = prepared
    config = text_config(tmp_path, f"{corpus}/*")
    source = make_source(config, "train")
    assert source.vocab_size == 257 and len(source) == len(records.PackedRecords(out, "train"))
    again = make_source(config, "train")  # cached: same directory, nothing rebuilt
    assert again.directory == source.directory
    from fbt_jax.train.trainer import Trainer

    config.train.steps = 3
    config.optimizer.warmup_steps = 1
    config.passes.schedule = "0:2"
    config.eval.num_batches = 1
    config.train.batch_size = config.eval.batch_size = 8
    summary = Trainer(config, log=lambda *_: None).train(progress=False)
    assert np.isfinite(summary["eval"]["loss_K2"])


def test_tfds_dataset_is_read_without_tensorflow(tmp_path):
    data_dir = str(tmp_path / "tfds")
    code = f"""
import tensorflow_datasets as tfds
class FbtTinyText(tfds.core.GeneratorBasedBuilder):
    VERSION = tfds.core.Version("1.0.0")
    def _info(self):
        return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({{"text": tfds.features.Text()}}))
    def _split_generators(self, dl_manager):
        return {{"train": self._generate_examples(0, 40), "validation": self._generate_examples(40, 48)}}
    def _generate_examples(self, lo, hi):
        for i in range(lo, hi):
            yield i, {{"text": f"document number {{i}} " * (i % 5 + 1)}}
FbtTinyText(data_dir={data_dir!r}).download_and_prepare(file_format="array_record")
"""
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    config = load_config("tiny")
    config.workdir = str(tmp_path / "run")
    config.data.source = "tfds"
    config.data.tfds_name = "fbt_tiny_text"
    config.data.tfds_data_dir = data_dir
    config.data.seq_len = 24
    config.model.vocab_size = 257
    train, val = make_source(config, "train"), make_source(config, "validation")
    meta = train.meta
    assert meta["source"]["kind"] == "tfds" and meta["documents"] == {"train": 40, "validation": 8}
    text = bytes(t for i in range(len(val)) for t, s in zip(*val._record(i)) if s > 0 and t < 256).decode()
    assert "document number 40 " in text and "document number 3 " not in text
    assert "tensorflow" not in sys.modules  # read without TensorFlow (it is not even installed)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"data.path": "/nonexistent/*.txt"}, "matches no file"),
        ({"data.path": "EMPTY"}, "is empty"),
        ({"data.path": "BINARY"}, "is not UTF-8 text"),
        (
            {"data.source": "tfds", "data.tfds_name": "no_such_dataset_xyz", "data.tfds_data_dir": "TMP"},
            "is not prepared in",
        ),
        ({"data.source": "tfds", "data.tfds_name": "no_such_dataset_xyz"}, "needs data.tfds_data_dir"),
        ({"model.vocab_size": 100}, "smaller than the data's vocabulary (257 tokens for data.tokenizer='byte')"),
        ({"data.seq_len": 100_000}, "fewer than one sequence of seq_len+1 = 100001"),
        (
            {"data.source": "task", "data.task": "delayed_recall", "data.delay": 40},
            "cannot be filled by data.seq_len=32",
        ),
        ({"data.tokenizer": "/nonexistent.model"}, "neither 'byte' nor an existing SentencePiece model"),
    ],
)
def test_bad_data_inputs_give_one_clear_line(tmp_path, prepared, overrides, message):
    from fbt_jax.train.trainer import Trainer

    corpus, _, _ = prepared
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00abc")
    config = text_config(tmp_path, f"{corpus}/*")
    special = {"EMPTY": str(tmp_path / "empty.txt"), "BINARY": str(tmp_path / "binary.txt"), "TMP": str(tmp_path)}
    for path, value in overrides.items():
        section, name = path.split(".")
        config[section][name] = special.get(value, value) if isinstance(value, str) else value
    with pytest.raises(ConfigError) as err:
        Trainer(config, log=lambda *_: None)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_sentencepiece_tokenizer_by_path(tmp_path, prepared):
    import sentencepiece

    corpus, _, _ = prepared
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus / "doc0.txt"),
        model_prefix=str(tmp_path / "sp"),
        vocab_size=40,
        character_coverage=1.0,
        model_type="bpe",
        minloglevel=2,
    )
    config = text_config(tmp_path, f"{corpus}/*")
    config.data.tokenizer = str(tmp_path / "sp.model")
    config.model.vocab_size = 32
    from fbt_jax.train.trainer import Trainer

    with pytest.raises(ConfigError, match="smaller than the data's vocabulary"):
        Trainer(config, log=lambda *_: None)
    config.model.vocab_size = 64
    source = make_source(config, "train")
    assert source.meta["tokenizer"].endswith("sp.model") and source.vocab_size <= 64
    assert 0 < int(source.example(0)["inputs"].max()) < source.vocab_size
