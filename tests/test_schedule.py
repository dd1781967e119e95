"""Pass-count schedule (docs/method.md §6): determinism, realised mixture, phase boundaries, errors."""

import subprocess
import sys

import pytest

from fbt_jax.errors import ConfigError
from fbt_jax.schedule import DEFAULT_SCHEDULE, PassSchedule

PRINT_KS = (
    "from fbt_jax.schedule import PassSchedule;"
    "s = PassSchedule.parse('0.0:1=0.5,2=0.3,3=0.2', 2000, seed=7);"
    "print(','.join(str(s.num_passes(i)) for i in range(2000)))"
)


def test_same_seed_same_sequence_across_fresh_processes():
    runs = [
        subprocess.run([sys.executable, "-c", PRINT_KS], capture_output=True, text=True, check=True).stdout
        for _ in range(2)
    ]
    here = PassSchedule.parse("0.0:1=0.5,2=0.3,3=0.2", 2000, seed=7)
    assert runs[0] == runs[1] == ",".join(str(here.num_passes(i)) for i in range(2000)) + "\n"
    other_seed = PassSchedule.parse("0.0:1=0.5,2=0.3,3=0.2", 2000, seed=8)
    assert [other_seed.num_passes(i) for i in range(2000)] != [here.num_passes(i) for i in range(2000)]


def test_realised_mixture_matches_target_over_10000_steps():
    single = PassSchedule.parse("0:1=0.75,2=0.22,3=0.03", 10_000, seed=0)
    for k, target in {1: 0.75, 2: 0.22, 3: 0.03}.items():
        assert abs(single.realised_mixture(0, 10_000)[k] - target) <= 0.02
    default = PassSchedule.parse(DEFAULT_SCHEDULE, 10_000, seed=1)
    realised, expected = default.realised_mixture(0, 10_000), default.expected_mixture(10_000)
    assert expected == pytest.approx({1: 0.75, 2: 0.22, 3: 0.03})
    for k in (1, 2, 3):
        assert abs(realised[k] - expected[k]) <= 0.02
    assert default.expected_num_passes(10_000) == pytest.approx(0.75 + 0.25 * (2 * 0.88 + 3 * 0.12))


def test_phases_switch_at_the_right_step():
    s = PassSchedule.parse("0:1; 100:2; 0.5:3=1.0", 1000, seed=3)
    assert [ph.start_step for ph in s.phases] == [0, 100, 500]
    assert {s.num_passes(i) for i in range(0, 100)} == {1}
    assert {s.num_passes(i) for i in range(100, 500)} == {2}
    assert {s.num_passes(i) for i in range(500, 1000)} == {3}
    assert s.pass_counts == (1, 2, 3)
    assert s.expected_num_passes(1000) == pytest.approx((100 * 1 + 400 * 2 + 500 * 3) / 1000)
    default = PassSchedule.parse(DEFAULT_SCHEDULE, 400, seed=0)
    assert {default.num_passes(i) for i in range(300)} == {1} and default.phase_at(300).start_step == 300


@pytest.mark.parametrize(
    "spec, message",
    [
        ("0:1=0.5,2=0.4", "sum to 0.9, not 1"),
        ("0:0=1.0", "K=0 is below 1"),
        ("0:1; 0.75:2=0.88,3=0.2", "sum to 1.08, not 1"),
        ("10:1", "first phase starts at step 10"),
        ("0:1; 0.5:2; 0.25:3", "must increase"),
        ("0:1; 1.5:2", "must lie in [0, 1)"),
        ("0:1; x:2", "neither a step"),
        ("1=1.0", "lacks 'start:'"),
        ("0:two=1.0", "is not 'K=probability'"),
        ("0:1=0.5,1=0.5", "appears twice"),
        ("", "non-empty string"),
        ("0:1; 5000:2", "at or after train.steps=1000"),
    ],
)
def test_bad_schedules_name_the_problem(spec, message):
    with pytest.raises(ConfigError, match="passes.schedule") as err:
        PassSchedule.parse(spec, 1000, seed=0)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_fraction_starts_are_floored_and_collisions_explained():
    s = PassSchedule.parse("0.0:1; 0.25:2; 0.35:3", 10, seed=0)
    assert [ph.start_step for ph in s.phases] == [0, 2, 3]
    with pytest.raises(ConfigError, match="fractions are floored to steps of train.steps=10"):
        PassSchedule.parse("0.0:1; 0.05:2", 10, seed=0)
