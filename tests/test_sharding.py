"""Sharded training equals single-device training on every supported mesh; layouts and errors."""

import jax
import numpy as np
import pytest
from conftest import read_jsonl, run_config, set_fields

from fbt_jax import sharding
from fbt_jax.errors import ConfigError
from fbt_jax.train.trainer import Trainer

MESHES = [(8, 1, 1), (2, 4, 1), (2, 2, 2), (1, 4, 2)]
STEPS = 8


def train(config, devices):
    trainer = Trainer(config, log=lambda *_: None, devices=devices)
    trainer.train(progress=False)
    return trainer, read_jsonl(config.workdir)


@pytest.fixture(scope="module")
def single_device_run(tmp_path_factory):
    # K drawn per step from a mix (run_config's schedule): both programs run.
    config = run_config(tmp_path_factory.mktemp("single"), "single", steps=STEPS, mesh=(1, 1, 1))
    trainer, rows = train(config, jax.devices()[:1])
    assert len({r["num_passes"] for r in rows}) == 2
    return jax.device_get(trainer.state.params), rows


@pytest.mark.slow
@pytest.mark.parametrize("mesh", MESHES, ids=["x".join(map(str, m)) for m in MESHES])
def test_sharded_training_matches_one_device(tmp_path, single_device_run, mesh):
    ref_params, ref_rows = single_device_run
    trainer, rows = train(run_config(tmp_path, "sharded", steps=STEPS, mesh=mesh), jax.devices())
    assert [r["num_passes"] for r in rows] == [r["num_passes"] for r in ref_rows]
    # Tolerance: sharding changes only the order of fp32 reductions (≈1e-7 relative each); over
    # 8 Adam steps we measured ≤ 1e-6 in losses and ≤ 3e-7 in parameters. A wrong layout gives
    # errors of percents (see docs/platform-notes), orders of magnitude above these bounds.
    np.testing.assert_allclose([r["loss"] for r in rows], [r["loss"] for r in ref_rows], rtol=2e-5)
    np.testing.assert_allclose([r["grad_norm"] for r in rows], [r["grad_norm"] for r in ref_rows], rtol=2e-5)
    params = jax.device_get(trainer.state.params)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
    check_every_parameter_follows_its_rule(trainer)


def check_every_parameter_follows_its_rule(trainer):
    rules, mesh = trainer.programs.rules, trainer.programs.mesh
    state = trainer.state
    leaves = jax.tree_util.tree_leaves_with_path(state.params, is_leaf=lambda x: isinstance(x, jax.Array))
    abstract = jax.tree.leaves(trainer.programs.abstract_state.params, is_leaf=lambda x: hasattr(x, "get_metadata"))
    assert len(leaves) == len(abstract)
    for (path, array), var in zip(leaves, abstract):
        expected = sharding.logical_to_spec(var.get_metadata()["out_sharding"], rules)
        assert array.sharding.spec == expected, path
        assert array.sharding.mesh.shape == mesh.shape
    # Optimizer moments are laid out exactly like their parameters; the step counter is replicated.
    mu = state.opt_state[1][0].mu
    for p, m in zip(jax.tree.leaves(state.params), jax.tree.leaves(mu)):
        assert m.sharding.spec == p.sharding.spec
    down = state.params["blocks"][0]["mlp"]["down_FD"][...]
    assert down.sharding.spec == jax.sharding.PartitionSpec("tensor", "fsdp")  # Megatron layout


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"mesh.data": 3}, "mesh sizes data×fsdp×tensor = 3×1×1 = 3 do not multiply to the 8 devices"),
        ({"mesh.data": -1, "mesh.fsdp": -1}, "more than one -1"),
        ({"mesh.data": -1, "mesh.fsdp": 3}, "3 does not divide 8"),
        ({"mesh.dcn_data": 3}, "does not divide the 8 devices"),
        ({"train.batch_size": 12}, "train.batch_size=12 is not divisible by the data-parallel size 8"),
        ({"sharding.rules": "mlp=model"}, "names unknown mesh axis 'model'"),
        ({"sharding.rules": "mlps=tensor"}, "'mlps' is not a logical axis"),
        ({"sharding.rules": "mlp=tensor, mlp=fsdp"}, "'mlp' has two rules"),
        ({"sharding.rules": "mlp tensor"}, "is not 'logical=mesh_axis'"),
    ],
)
def test_bad_mesh_configs_give_one_clear_line(tmp_path, overrides, message):
    config = run_config(tmp_path, "bad", steps=STEPS, mesh=(-1, 1, 1))
    set_fields(config, overrides)
    with pytest.raises(ConfigError) as err:
        Trainer(config, log=lambda *_: None)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_conflicting_and_indivisible_layouts_are_errors(tmp_path):
    config = run_config(tmp_path, "conflict", steps=STEPS, mesh=(1, 4, 2))
    config.sharding.rules = "batch=data+fsdp, embed=fsdp, fusion=fsdp"
    with pytest.raises(ConfigError, match=r"parameter fusion/\w+_proj_DD .* mesh axis used twice"):
        Trainer(config, log=lambda *_: None)
    config.sharding.rules = "batch=data, vocab=fsdp"  # vocab 6 over 4 devices
    with pytest.raises(ConfigError, match="embedding_VD has vocab=6, not divisible by its 4 shards"):
        Trainer(config, log=lambda *_: None)
