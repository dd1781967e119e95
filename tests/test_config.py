"""Config files build and validate; every bad field stops early with one line naming it."""

import pytest
from conftest import load_config, set_fields

from fbt_jax.errors import ConfigError
from fbt_jax.model import ModelConfig, abstract_model, count_params
from fbt_jax.validation import validate_config


def test_tiny_config_is_valid():
    schedule = validate_config(load_config("tiny"))
    assert schedule.pass_counts == (1, 2, 3)


def test_1b_config_builds_abstractly_at_about_1b_parameters():
    config = load_config("fbt_1b")
    validate_config(config, num_devices=8)
    model = abstract_model(ModelConfig.from_config(config.model))
    assert abs(count_params(model) / 1e9 - 1.0) <= 0.05


def test_fuse_from_range_follows_seq_len_overrides():
    config = load_config("tiny")
    config.data.seq_len = 64
    assert config.passes.fuse_from_max == 32
    config.data.seq_len = 10
    assert config.passes.fuse_from_max == 5


BAD = [
    ({"model.num_heads": 5}, "model.num_heads=5 does not divide model.embed_dim=64"),
    ({"model.num_kv_heads": 3}, "model.num_kv_heads=3 does not divide model.num_heads=4"),
    ({"model.vocab_size": 5}, "model.vocab_size=5 is smaller than the data's vocabulary (6 tokens"),
    ({"model.fusion": "mul"}, "model.fusion='mul' is unknown"),
    ({"model.compute_dtype": "fp8"}, "model.compute_dtype='fp8' is unknown"),
    ({"model.num_layers": 0}, "model.num_layers=0 must be a positive integer"),
    ({"passes.schedule": "0:1=0.5,2=0.6"}, "passes.schedule: probabilities"),
    ({"passes.schedule": "0:0"}, "K=0 is below 1"),
    (
        {"passes.fuse_from_max": 16},
        "fuse-from range passes.fuse_from_min..fuse_from_max = 1..16 is outside the sequence",
    ),
    ({"passes.fuse_from_min": 0}, "is outside the sequence"),
    ({"passes.noise_std": -0.1}, "passes.noise_std=-0.1 is negative"),
    ({"passes.prefix_mixin_prob": 1.5}, "passes.prefix_mixin_prob=1.5 must be in [0, 1]"),
    ({"passes.loss_weights": (1.0, 1.0)}, "passes.loss_weights has 2 entries but up to K=3"),
    ({"passes.loss_weights": (0.0, 1.0, 1.0)}, "zero total weight"),
    ({"train.steps": 0}, "train.steps=0 must be a positive integer"),
    ({"optimizer.warmup_steps": 10_000}, "optimizer.warmup_steps=10000 must be in [0, train.steps=3000)"),
    ({"optimizer.learning_rate": 0.0}, "optimizer.learning_rate=0.0 must be positive"),
    ({"eval.num_passes": (0, 1)}, "eval.num_passes=(0, 1) must list integers K >= 1"),
    ({"eval.num_passes": (1, 2.5)}, "eval.num_passes=(1, 2.5) must list integers K >= 1"),
    ({"seed": -1}, "seed=-1 must be an integer in [0, 2**31)"),
    ({"model.norm_eps": -1.0}, "model.norm_eps=-1.0 must be positive"),
    ({"optimizer.b2": 1.5}, "optimizer.b2=1.5 must be in [0, 1)"),
    ({"model.param_dtype": "float16"}, "model.param_dtype='float16' is unknown"),
    ({"passes.schedule": "0:1; 5000:2"}, "at or after train.steps=3000"),
    ({"eval.fuse_from": 20}, "eval.fuse_from=20 is outside the sequence"),
    ({"eval.contraction_passes": 1}, "eval.contraction_passes=1: a contraction rate needs at least 2 passes"),
    ({"eval.contraction_passes": 14}, "passes 4..17 go beyond data.seq_len - eval.fuse_from + 1 = 16"),
    ({"eval.contraction_every_steps": -1}, "eval.contraction_every_steps=-1 is negative"),
    ({"data.group": "Q8"}, "data.group='Q8' is unknown"),
    ({"data.task": "copy"}, "data.task='copy' is unknown"),
    ({"workdir": ""}, "workdir is empty"),
]


@pytest.mark.parametrize("overrides, message", BAD, ids=[next(iter(o)) for o, _ in BAD])
def test_bad_config_gives_one_clear_line(overrides, message):
    config = load_config("tiny")
    set_fields(config, overrides)
    with pytest.raises(ConfigError) as err:
        validate_config(config)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_batch_must_divide_over_devices():
    config = load_config("tiny")
    config.train.batch_size = 12
    with pytest.raises(ConfigError, match="train.batch_size=12 is not divisible by the data-parallel size 8"):
        validate_config(config, num_devices=8)


def test_config_files_cannot_add_misspelt_fields():
    config = load_config("tiny")
    with pytest.raises(AttributeError, match="embed_dims"):
        config.model.embed_dims = 128
