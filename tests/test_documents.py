"""What a preparation reads: the split of documents by a hash of their text, and the plan that cuts a
corpus into units whatever the number of shards (reading the files themselves: test_sources.py)."""

import pytest

from fbt_jax.data.documents import is_validation, text_plan
from fbt_jax.data.shards import assign_units, group_units, shard_from_env
from fbt_jax.errors import ConfigError


def test_the_validation_split_is_a_function_of_the_text():
    texts = [f"document {i}" for i in range(4000)]
    held_out = [t for t in texts if is_validation(t, 0.2)]
    assert abs(len(held_out) / len(texts) - 0.2) < 0.03
    assert held_out == [t for t in texts if is_validation(t, 0.2)]  # the same text, the same split
    assert not any(is_validation(t, 0.0) for t in texts)
    assert set(held_out) <= {t for t in texts if is_validation(t, 0.5)}  # a larger fraction only adds


def test_units_are_consecutive_files_and_shards_balance_them_by_size():
    sizes = [5, 1, 1, 1, 8, 2, 2] * 20
    units = group_units(sizes)
    assert [i for unit in units for i in unit] == list(range(len(sizes)))  # every file once, in order
    target = sum(sizes) / 64
    assert all(sum(sizes[i] for i in unit) >= target for unit in units[:-1])
    unit_sizes = [sum(sizes[i] for i in unit) for unit in units]
    for shards in (1, 2, 3, 7):
        assigned = assign_units(unit_sizes, shards)
        assert sorted(u for s in assigned for u in s) == list(range(len(units)))
        loads = [sum(unit_sizes[u] for u in s) for s in assigned]
        assert max(loads) - min(loads) <= max(unit_sizes)
    assert group_units([1 << 40]) == [[0]] and group_units([]) == []


def test_the_plan_does_not_depend_on_the_shard_count(tmp_path):
    for i in range(12):
        (tmp_path / f"f{i:02d}.txt").write_text("some text " * (i + 1))
    plan = text_plan(f"{tmp_path}/*.txt", "byte", 16, 0.1)
    assert plan["units"] == group_units([size for _, size in plan["inputs"]])
    assert plan["tokenizer_identity"] == "byte" and plan["eos_id"] == 256


@pytest.mark.parametrize(
    "env, flags, message",
    [
        (
            {},
            (2, 2),
            r"shard index 2 is outside the 2 shard\(s\) \(from --num-shards/--shard-index\); use an index in 0..1",
        ),
        (
            {"SLURM_ARRAY_TASK_ID": "4", "SLURM_ARRAY_TASK_COUNT": "4"},
            (None, None),
            r"shard index 4 is outside the 4 .*SLURM",
        ),
        ({"TPU_WORKER_ID": "x"}, (None, None), r"TPU_WORKER_ID='x' is not an integer"),
        ({}, (0, None), r"--num-shards=0 must be at least 1"),
    ],
    ids=["flag", "slurm", "tpu-garbled", "zero-shards"],
)
def test_a_shard_outside_the_count_is_one_line(monkeypatch, env, flags, message):
    for name in ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT", "SLURM_ARRAY_TASK_MIN", "TPU_WORKER_ID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=message):
        shard_from_env(*flags)


def test_a_tpu_slice_gives_each_host_its_shard(monkeypatch):
    monkeypatch.delenv("SLURM_ARRAY_TASK_ID", raising=False)
    monkeypatch.setenv("TPU_WORKER_ID", "3")
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "h0,h1,h2,h3")
    assert shard_from_env(None, None)[:2] == (4, 3)
    assert shard_from_env(8, 5)[:2] == (8, 5)  # flags win
