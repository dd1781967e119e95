"""The data pipeline: per-process streams, resume, text (prepared on first use) and TFDS sources,
and bad data inputs."""

import subprocess
import sys

import numpy as np
import pytest
from conftest import load_config, set_fields, text_config

from fbt_jax.data import records
from fbt_jax.data.pipeline import StepBatches, batch_iterator, make_source
from fbt_jax.data.plan import plan_data
from fbt_jax.errors import ConfigError


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


@pytest.mark.slow
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


@pytest.mark.slow
def test_text_source_prepares_on_first_use_and_trains(tmp_path, prepared):
    corpus, out, _ = prepared
    config = text_config(tmp_path, f"{corpus}/*")
    source = make_source(plan_data(config), "train")
    assert source.vocab_size == 257 and len(source) == len(records.PackedRecords(out, "train"))
    again = make_source(plan_data(config), "train")  # cached: same directory, nothing rebuilt
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
    train, val = make_source(plan_data(config), "train"), make_source(plan_data(config), "validation")
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
        (
            {"data.tokenizer": "/nonexistent.model"},
            "neither 'byte' nor an existing tokenizer (a SentencePiece .model, a tokenizer.json",
        ),
    ],
)
def test_bad_data_inputs_give_one_clear_line(tmp_path, prepared, overrides, message):
    from fbt_jax.train.trainer import Trainer

    corpus, _, _ = prepared
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00abc")
    config = text_config(tmp_path, f"{corpus}/*")
    special = {"EMPTY": str(tmp_path / "empty.txt"), "BINARY": str(tmp_path / "binary.txt"), "TMP": str(tmp_path)}
    set_fields(config, {path: special.get(v, v) if isinstance(v, str) else v for path, v in overrides.items()})
    with pytest.raises(ConfigError) as err:
        Trainer(config, log=lambda *_: None)
    assert message in str(err.value) and "\n" not in str(err.value)
