"""The built-in word-problem task against a direct computation."""

import itertools

import numpy as np
import pytest

from fbt_jax.data.tasks import SyntheticTask, composition_table, group_elements
from fbt_jax.errors import ConfigError


def compose(a, b):
    return tuple(a[b[i]] for i in range(len(a)))


@pytest.mark.parametrize("group, order", [("S3", 6), ("S5", 120), ("A4", 12), ("A5", 60), ("Z7", 7)])
def test_groups_have_the_right_order_and_identity_first(group, order):
    elements = group_elements(group)
    assert len(elements) == order == len(set(elements))
    assert elements[0] == tuple(range(len(elements[0])))
    table = composition_table(group)
    assert all(sorted(row) == list(range(order)) for row in table)  # a Latin square: a group


def test_word_problem_targets_are_prefix_products():
    task = SyntheticTask("word_problem", seq_len=12, seed=5, group="S4")
    elements = group_elements("S4")
    batch = task.examples("train", np.arange(10, 16))
    for inputs, targets in zip(batch["inputs"], batch["targets"]):
        running = elements[0]
        for g, label in zip(inputs, targets):
            running = compose(running, elements[g])
            assert elements[label] == running
    assert batch["weights"].shape == (6, 12) and np.all(batch["weights"] == 1)


def test_examples_are_a_function_of_index_and_splits_differ():
    task = SyntheticTask("word_problem", seq_len=16, seed=0, group="S5")
    whole = task.batch("train", step=3, batch_size=8)["inputs"]
    part = task.examples("train", np.arange(26, 28))["inputs"]
    assert np.array_equal(whole[2:4], part)
    val = task.batch("validation", step=3, batch_size=8)["inputs"]
    train_rows = {tuple(r) for r in task.examples("train", np.arange(512))["inputs"]}
    assert not any(tuple(r) in train_rows for r in val)
    assert not np.array_equal(
        whole, SyntheticTask("word_problem", seq_len=16, seed=1, group="S5").batch("train", 3, 8)["inputs"]
    )


def test_unknown_group_is_a_config_error():
    with pytest.raises(ConfigError, match="data.group='D4' is unknown"):
        group_elements("D4")


def test_composition_matches_itertools_definition():
    table = composition_table("S3")
    elements = group_elements("S3")
    for (i, a), (j, b) in itertools.product(enumerate(elements), repeat=2):
        assert elements[table[i, j]] == compose(a, b)


def test_modular_sum_and_parity_targets():
    for modulus in (2, 5):
        task = SyntheticTask("modular_sum", seq_len=20, seed=1, modulus=modulus)
        batch = task.examples("train", np.arange(8))
        for inputs, targets in zip(batch["inputs"], batch["targets"]):
            assert inputs.max() < modulus
            assert [int(t) for t in targets] == [sum(int(x) for x in inputs[: t + 1]) % modulus for t in range(20)]


def test_delayed_recall_targets_and_mask():
    task = SyntheticTask("delayed_recall", seq_len=12, seed=2, delay=3, task_vocab_size=7)
    batch = task.examples("validation", np.arange(5))
    for inputs, targets, weights in zip(batch["inputs"], batch["targets"], batch["weights"]):
        assert list(weights[:3]) == [0, 0, 0] and all(weights[3:] == 1)
        assert all(targets[t] == inputs[t - 3] for t in range(3, 12))
    assert task.vocab_size == 7


def test_splits_are_disjoint_by_content_even_for_tiny_spaces():
    task = SyntheticTask("modular_sum", seq_len=6, seed=0, modulus=2)  # only 64 distinct sequences
    train = {tuple(r) for r in task.examples("train", np.arange(300))["inputs"]}
    val = {tuple(r) for r in task.examples("validation", np.arange(300))["inputs"]}
    assert train and val and not train & val
