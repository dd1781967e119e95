"""Reading another run: init_from takes a run's parameters (not its optimizer state or step) and
names the difference when the model does not match."""

import jax
import numpy as np
import pytest
from conftest import checkpointed_config

from fbt_jax.errors import ConfigError
from fbt_jax.train.trainer import Trainer


def test_init_from_takes_parameters_only(tmp_path):
    source = checkpointed_config(tmp_path, name="trunk", steps=4)
    trunk = Trainer(source, log=lambda *_: None)
    trunk.train(progress=False)
    config = checkpointed_config(tmp_path, name="sweep", steps=4)
    config.init_from = source.workdir
    config.passes.schedule = "0:2"  # e.g. a different pass mixture on the same trunk
    messages = []
    sweep = Trainer(config, log=messages.append)
    assert sweep.restore_or_init(None)[0] == 0
    for a, b in zip(jax.tree.leaves(sweep.state.params), jax.tree.leaves(trunk.state.params)):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    assert int(sweep.state.step) == 0
    assert all(float(np.abs(np.asarray(m)).max()) == 0 for m in jax.tree.leaves(sweep.state.opt_state[1][0].mu))
    assert any("initialised parameters from" in m for m in messages)
    config.init_from = str(tmp_path / "nothing")
    with pytest.raises(ConfigError, match="is not a directory"):
        Trainer(config, log=lambda *_: None).restore_or_init(None)


@pytest.mark.slow
def test_init_from_another_model_names_the_difference(tmp_path):
    source = checkpointed_config(tmp_path, name="trunk", steps=2)
    Trainer(source, log=lambda *_: None).train(progress=False)
    config = checkpointed_config(tmp_path, name="wider", steps=2)
    config.init_from = source.workdir
    config.model.embed_dim = 128
    with pytest.raises(ConfigError, match=r"model.embed_dim: checkpoint 64, config 128"):
        Trainer(config, log=lambda *_: None).restore_or_init(None)
