"""Reading another run: init_from takes a run's parameters (not its optimizer state or step) and
names the difference when the model does not match."""

import jax
import numpy as np
import pytest
from conftest import checkpointed_config
from flax import nnx

from fbt_jax.errors import ConfigError
from fbt_jax.train.trainer import Trainer


def same_model(config):
    """The trunk's model: an untied readout (both token tables) and 2 spare ids beyond the task's 6, so
    that a smaller vocabulary still holds the data."""
    config.model.tie_embeddings = False
    config.model.vocab_size = 8
    return config


@pytest.fixture(scope="module")
def trunk(tmp_path_factory):
    source = same_model(checkpointed_config(tmp_path_factory.mktemp("trunk"), name="trunk", steps=4))
    trained = Trainer(source, log=lambda *_: None)
    trained.train(progress=False)
    return source, trained


def test_init_from_takes_parameters_only(tmp_path, trunk):
    source, trained = trunk
    config = same_model(checkpointed_config(tmp_path, name="sweep", steps=4))
    config.init_from = source.workdir
    config.passes.schedule = "0:2"  # e.g. a different pass mixture on the same trunk
    messages = []
    sweep = Trainer(config, log=messages.append)
    assert sweep.restore_or_init(None)[0] == 0
    for a, b in zip(jax.tree.leaves(sweep.state.params), jax.tree.leaves(trained.state.params)):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    assert int(sweep.state.step) == 0
    assert all(float(np.abs(np.asarray(m)).max()) == 0 for m in jax.tree.leaves(sweep.state.opt_state[1][0].mu))
    assert any("initialised parameters from" in m for m in messages)
    config.init_from = str(tmp_path / "nothing")
    with pytest.raises(ConfigError, match="is not a directory"):
        Trainer(config, log=lambda *_: None).restore_or_init(None)


@pytest.mark.slow
def test_init_from_changes_rotary_window_and_vocabulary_and_refuses_another_network(tmp_path, trunk):
    """A new phase may change the rotary settings and the window and grow the vocabulary: every saved
    parameter arrives bitwise, each new token's rows (embedding and untied readout) are the mean of the
    saved rows, and the phase trains. Another width or a smaller vocabulary is one line."""
    source, trained = trunk
    saved = {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(trained.state.params)}

    config = same_model(checkpointed_config(tmp_path, name="phase", steps=2))
    config.init_from = source.workdir
    config.model.vocab_size = source.model.vocab_size + 3
    config.model.rope_theta, config.model.rope_scaling, config.model.rope_scaling_factor = 5e5, "linear", 4.0
    config.model.sliding_window = 5
    messages = []
    phase = Trainer(config, log=messages.append)
    phase.restore_or_init(None)
    loaded = {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(phase.state.params)}
    assert loaded.keys() == saved.keys()
    for path, value in saved.items():
        if path[-1] in ("embedding_VD", "readout_VD"):
            assert value.shape[0] == source.model.vocab_size and loaded[path].shape[0] == config.model.vocab_size
            np.testing.assert_array_equal(loaded[path][: value.shape[0]], value)
            mean = value.astype(np.float64).mean(axis=0).astype(value.dtype)
            np.testing.assert_array_equal(loaded[path][value.shape[0] :], np.stack([mean] * 3))
        else:
            np.testing.assert_array_equal(loaded[path], value)
    assert "init_from: changed model.rope_theta: 10000.0 → 500000.0" in messages
    assert "init_from: changed model.sliding_window: 0 → 5" in messages
    assert any("3 new token rows" in m for m in messages)
    assert phase.train(progress=False)["start_step"] == 0
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(phase.state.params))

    for field, value, said in [
        ("embed_dim", 128, r"model.embed_dim: checkpoint 64, config 128"),
        ("vocab_size", source.model.vocab_size - 1, rf"model.vocab_size: checkpoint {source.model.vocab_size}"),
    ]:
        other = same_model(checkpointed_config(tmp_path, name=f"other-{field}", steps=2))
        other.init_from = source.workdir
        other.model[field] = value
        with pytest.raises(ConfigError, match=said + r".*init_from may change only rope_theta"):
            Trainer(other, log=lambda *_: None).restore_or_init(None)
