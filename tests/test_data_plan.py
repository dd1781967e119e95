"""The data settings resolved once (issue #45): `plan_data` turns `config.data` into one immutable
plan, reads each prepared dataset's meta.json and the tokenizer once per process, and the trainer
builds its sources from the plan, entering data/pipeline.py only for them."""

import dataclasses
import os
import sys

import pytest
from conftest import load_config, text_config

from fbt_jax.data import plan as plan_module
from fbt_jax.data import records
from fbt_jax.data.plan import plan_data
from fbt_jax.data.tokenizers import load_tokenizer
from fbt_jax.errors import ConfigError


def test_the_plan_is_immutable_and_leaves_the_config_as_it_was(prepared, tmp_path):
    _, out, _ = prepared
    config = text_config(tmp_path, out)
    before = config.to_dict()
    data = plan_data(config)
    assert (data.source, data.seq_len, data.packed, data.vocab_size) == ("text", 32, True, 257)
    assert data.datasets[0].path == out and dict(data.datasets[0].meta)["vocab_size"] == 257
    assert config.to_dict() == before  # nothing written back by the plan
    with pytest.raises(dataclasses.FrozenInstanceError):
        data.seq_len = 64  # type: ignore[misc]
    task = plan_data(load_config("tiny"))
    assert task.task is not None and not task.packed and task.vocab_size == task.task.vocab_size


def test_meta_and_tokenizer_are_read_once_per_process(prepared, bpe_tokenizer_json, tmp_path, monkeypatch):
    _, out, _ = prepared
    reads = []
    real = records.read_meta
    monkeypatch.setattr(records, "read_meta", lambda path: reads.append(path) or real(path))
    monkeypatch.setattr(plan_module, "_METAS", {})
    for _ in range(3):
        plan_data(text_config(tmp_path, out))
    assert reads == [out]
    assert load_tokenizer(bpe_tokenizer_json) is load_tokenizer(bpe_tokenizer_json)
    # A file that changes is read again: a tokenizer saved anew at the same path is a new tokenizer.
    first = load_tokenizer(bpe_tokenizer_json)
    os.utime(bpe_tokenizer_json, ns=(1, 1))
    assert load_tokenizer(bpe_tokenizer_json) is not first


def test_a_trained_runs_record_is_planned_without_reading_its_data(tmp_path):
    config = text_config(tmp_path, str(tmp_path / "gone" / "records"))  # its data is not reachable here
    config.data.tokenizer = "byte"
    data = plan_data(config, read_data=False)
    assert data.tokenizer.vocab_size == 257 and not data.datasets[0].prepared
    with pytest.raises(ConfigError, match="matches no file"):
        plan_data(config)  # the run's own start reads it, and says what is wrong


def test_the_trainer_enters_the_pipeline_only_for_its_sources(prepared, tmp_path):
    """Following `config` from Trainer.__init__: data/pipeline.py is entered twice (the train and
    validation sources), the plan once."""
    from fbt_jax.train.trainer import Trainer

    _, out, _ = prepared
    config = text_config(tmp_path, out)
    config.eval.num_batches = 1
    pipeline_file = os.path.join("fbt_jax", "data", "pipeline.py")
    entries, depth = [], [0]

    def profile(frame, event, arg):
        if event == "call":
            inside = frame.f_code.co_filename.endswith(pipeline_file)
            if inside and depth[0] == 0:
                entries.append(frame.f_code.co_name)
            depth[0] += inside
        elif event == "return" and frame.f_code.co_filename.endswith(pipeline_file):
            depth[0] -= 1

    import jax

    sys.setprofile(profile)
    try:
        Trainer(config, log=lambda *_: None, devices=jax.devices()[:1])
    finally:
        sys.setprofile(None)
    assert entries == ["make_source", "make_source"]
