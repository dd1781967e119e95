"""Both ends of the supported stack read each other's work: a checkpoint written under jax 0.11.2
(.ci/lowest.txt) and one written under the newest stack restore bitwise under whichever this is,
and train on (tests/stack/make_fixtures.py made them; .ci/run runs this file on both ends).

Training on is bitwise where the checkpoint's stack is this one. Across stacks the steps' bits
differ by a float32 rounding or so: jax 0.12's XLA:CPU compiles the same HLO (batched dots in
`ynn_fusion`s, YNNPACK's kernels) to other roundings than 0.11.2's (docs/platform-notes.md)."""

from __future__ import annotations

import functools
import glob
import importlib.util
import json
import os
import shutil

import jax
import numpy as np
import pytest
from conftest import losses, optimised_programs, saved_state

from fbt_jax.checkpoint import Checkpointer
from fbt_jax.train.trainer import Trainer

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stack")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = sorted(glob.glob(os.path.join(HERE, "checkpoint-jax*")))


@functools.cache
def make_fixtures():
    """tests/stack/make_fixtures.py as a module, loaded once (it sets the process's XLA_FLAGS)."""
    spec = importlib.util.spec_from_file_location("make_fixtures", os.path.join(HERE, "make_fixtures.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_there_is_a_checkpoint_from_each_end_of_the_stack():
    lowest = dict(line.split("==") for line in lowest_lines())
    written = {json.load(open(os.path.join(path, "expected.json")))["jax"] for path in FIXTURES}
    assert lowest["jax"].strip() in written and len(written) == 2, written


def named(path) -> str:
    """A leaf's path as names and indices: the train state's attributes are a saved tree's keys."""
    return "/".join(make_fixtures()._name(key) for key in path)


@pytest.mark.parametrize("fixture", FIXTURES, ids=os.path.basename)
def test_a_checkpoint_of_either_stack_restores_bitwise_and_trains_on(tmp_path, fixture):
    fixtures = make_fixtures()
    expected = json.load(open(os.path.join(fixture, "expected.json")))
    config = fixtures.fixture_config(str(tmp_path / "run"))
    shutil.copytree(os.path.join(fixture, "checkpoints"), os.path.join(config.workdir, "checkpoints"))
    saved = saved_state(os.path.join(config.workdir, "checkpoints", str(fixtures.SAVED_AT)))
    with optimised_programs():  # the fixture's steps were compiled as fbt-train compiles them
        trainer = Trainer(config, log=lambda *_: None, devices=jax.devices()[:1])
        checkpointer = Checkpointer(os.path.join(config.workdir, "checkpoints"), config.checkpoint)
        assert trainer.restore_or_init(checkpointer)[0] == fixtures.SAVED_AT
        checkpointer.close()
        restored = jax.tree_util.tree_flatten_with_path(jax.tree.map(np.asarray, trainer.state))[0]
        by_name = {named(path): array for path, array in saved}
        assert sorted(named(path) for path, _ in restored) == sorted(by_name)
        for path, array in restored:
            assert array.dtype == by_name[named(path)].dtype, named(path)
            assert np.array_equal(array, by_name[named(path)]), named(path)  # bitwise
        trainer = Trainer(config, log=lambda *_: None, devices=jax.devices()[:1])
        trainer.train(progress=False)
    got = {str(step): loss for step, loss in losses(config.workdir).items()}
    assert sorted(got) == sorted(expected["losses"])  # resumed after the saved step, not from scratch
    if expected["jax"] == jax.__version__:
        assert got == expected["losses"]
        assert fixtures.param_digests(trainer.state) == expected["params"]
    else:
        # Another XLA's roundings over two steps: far below any change a defect would make.
        for step, loss in expected["losses"].items():
            assert got[step] == pytest.approx(loss, rel=1e-6), step
        assert set(fixtures.param_digests(trainer.state)) == set(expected["params"])


def test_the_pins_admit_both_ends_of_the_stack_and_refuse_python_3_11():
    """pyproject.toml's ranges hold .ci/lowest.txt's versions (its lower bounds are those) and the
    newest releases CI's other end installs; `requires-python` keeps pip from offering fbt-jax to
    Python 3.11, where no supported jax exists."""
    import tomllib

    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    project = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["project"]
    pins = {req.name: req.specifier for req in map(Requirement, project["dependencies"])}
    lowest = {name: version.strip() for name, version in (line.split("==") for line in lowest_lines())}
    for name, version in lowest.items():
        if name in pins:
            assert version in pins[name], (name, version, str(pins[name]))
            if name != "numpy":  # the GPU image's numpy, inside ours (>= 2.0; jax 0.11.2 asks >= 2.1)
                assert any(s.operator == ">=" and s.version == version for s in pins[name]), (name, "lower bound")
    for version in ("0.11.2", "0.12.0.1", "0.12.1"):
        assert version in pins["jax"]
    assert "0.11.1" not in pins["jax"] and "0.13.0" not in pins["jax"]
    python = SpecifierSet(project["requires-python"])
    assert "3.12.1" in python and "3.13.0" in python and "3.11.7" not in python
    extras = {name: [Requirement(r) for r in reqs] for name, reqs in project["optional-dependencies"].items()}
    assert {str(r.extras) for r in extras["cuda"]} == {"{'cuda13'}"} and {str(r.extras) for r in extras["cuda12"]} == {
        "{'cuda12'}"
    }
    for extra in ("tpu", "cuda", "cuda12"):
        assert all(r.specifier == pins["jax"] for r in extras[extra]), extra  # the same jax as the base pins


def lowest_lines() -> list[str]:
    with open(os.path.join(ROOT, ".ci", "lowest.txt")) as f:
        return [line.split("#")[0].strip() for line in f if "==" in line.split("#")[0]]
