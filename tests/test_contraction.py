"""The contraction monitor tells a contracting feedback map from one that does not contract."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import small_model_config
from flax import nnx

from fbt_jax import contraction
from fbt_jax.layers import default_positions
from fbt_jax.model import build_model
from fbt_jax.schedule import DEFAULT_SCHEDULE, PassSchedule
from fbt_jax.train.hooks import ContractionMonitor, Evaluator
from fbt_jax.train.loop import StepEnd
from fbt_jax.train.step import contraction_step, eval_step

B, T, D = 3, 12, 8


def geometric_states(rate: float, passes: int, fuse_from: int = 1) -> list[jax.Array]:
    """States Hᵏ = H* + rateᵏ·Δ at the positions pass k can still change (t ≥ p + k − 2), and
    exactly H* (a fixed point, already exact) before them, as the K-pass forward has them."""
    rng = np.random.default_rng(0)
    # A small Δ keeps ‖Hᵏ‖ about constant, so the relative change shrinks by `rate` per pass.
    fixed, delta = rng.normal(size=(B, T, D)), 0.01 * rng.normal(size=(B, T, D))
    t = np.arange(T)[None, :, None]
    return [
        jnp.asarray(np.where(t >= fuse_from + k - 2, fixed + rate**k * delta, fixed), jnp.float32)
        for k in range(1, passes + 1)
    ]


def measured(states: list[jax.Array], first: int, last: int, fuse_from: int = 1) -> dict[str, float]:
    fuse_from_B = jnp.full((B,), fuse_from, jnp.int32)
    sums = contraction.pass_change_sums(states, first, last, fuse_from_B, default_positions((B, T)))
    return contraction.summarize({k: float(v) for k, v in sums.items()}, first, last)


@pytest.mark.parametrize("rate", [0.5, 0.8])
def test_a_geometrically_contracting_map_gives_its_rate_and_is_contracting(rate):
    # The exact (unchanging) positions grow with k; counted, they would make the rate look smaller.
    out = measured(geometric_states(rate, 8), 4, 7)
    assert out["contraction_rate"] == pytest.approx(rate, rel=2e-2)
    assert out["contracting"] == 1.0
    assert contraction.warning(out, step=10, feedback_trained=True) is None


def test_a_growing_change_is_not_contracting_and_warns():
    out = measured(geometric_states(1.2, 8, fuse_from=2), 4, 7, fuse_from=2)
    assert out["contraction_rate"] == pytest.approx(1.2, rel=2e-2)
    assert out["contracting"] == 0.0
    message = contraction.warning(out, step=10, feedback_trained=True)
    assert message.startswith("warning: at step 10 the feedback map is not contracting (passes 4–7")
    # Before any step trained a feedback pass the map is its initialisation: nothing to warn of.
    assert contraction.warning(out, step=10, feedback_trained=False) is None


def test_unrelated_successive_states_are_not_contracting_even_when_the_rate_dips_below_one():
    # A chaotic map: each pass's states are unrelated to the last (change ≈ √2 of the norm).
    states = [jax.random.normal(jax.random.PRNGKey(k), (B, T, D)) for k in range(8)]
    out = measured(states, 4, 7)
    assert out["pass_change_K7"] > 1.0
    assert out["contracting"] == 0.0


def test_the_rate_is_a_geometric_fit_through_the_first_and_last_change():
    assert contraction.contraction_rate([0.8, 0.4, 0.2]) == pytest.approx(0.5)
    assert contraction.contraction_rate([0.0, 0.0]) == 0.0
    with pytest.raises(ValueError, match="at least 2 passes"):
        contraction.contraction_rate([0.5])


def additive_feedback_model(state_scale: float):
    """A random model whose fusion is e + s·W_U h: for small s the feedback map is a contraction
    (the plain embedding dominates); for large s successive passes are unrelated."""
    model = build_model(small_model_config(vocab_size=16, embed_dim=32, fusion="add"), seed=0)
    model.fusion.state_proj_DD[...] = model.fusion.state_proj_DD[...] * state_scale
    return model


@pytest.mark.slow
@pytest.mark.parametrize("state_scale, contracting", [(0.3, True), (30.0, False)])
def test_the_compiled_monitor_tells_a_contracting_model_from_a_chaotic_one(state_scale, contracting):
    graphdef, params = nnx.split(additive_feedback_model(state_scale), nnx.Param)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (4, 32), 0, 16)
    batch = {"inputs": tokens, "targets": tokens, "weights": jnp.ones(tokens.shape)}
    step = jax.jit(lambda p, b: contraction_step(p, b, graphdef=graphdef, fuse_from=1, monitored=(4, 7)))
    out = contraction.summarize({k: float(v) for k, v in step(params, batch).items()}, 4, 7)
    assert out["contracting"] == float(contracting), out
    if contracting:
        assert out["contraction_rate"] < 0.6 and out["pass_change_K7"] < 0.01
    else:
        assert out["pass_change_K7"] > 1.0
    # The eval program measures the same passes in the same forward as its readouts.
    evaluated = eval_step(params, batch, graphdef=graphdef, num_passes=3, fuse_from=1, monitored=(4, 7))
    assert {"nll_3", "change_sq_7"} <= evaluated.keys()
    again = contraction.summarize({k: float(v) for k, v in evaluated.items() if "_sq_" in k}, 4, 7)
    assert again == pytest.approx(out, rel=1e-5)


def test_the_training_hook_adds_the_monitor_to_the_record_and_warns_when_not_contracting():
    readings = iter(
        [
            {"pass_change_K4": 0.5, "pass_change_K5": 0.25, "contraction_rate": 0.5, "contracting": 1.0},
            {"pass_change_K4": 1.3, "pass_change_K5": 1.4, "contraction_rate": 1.08, "contracting": 0.0},
        ]
    )
    logged = []
    monitor = ContractionMonitor(lambda state: next(readings), every_steps=100, log=logged.append, feedback_from=150)
    assert not monitor.wants(StepEnd(step=50, num_passes=1, last=False, stopping=False))
    assert monitor.wants(StepEnd(step=100, num_passes=1, last=False, stopping=False))
    assert monitor.wants(StepEnd(step=130, num_passes=1, last=True, stopping=False))
    first, second = {"loss": 1.0}, {"loss": 0.9}
    monitor.on_interval(StepEnd(step=100, num_passes=1, last=False, stopping=False), first, state=None)
    assert first["contraction_rate"] == 0.5 and first["loss"] == 1.0 and logged == []
    monitor.on_interval(StepEnd(step=200, num_passes=2, last=False, stopping=False), second, state=None)
    assert second["contracting"] == 0.0
    assert len(logged) == 1 and "at step 200 the feedback map is not contracting" in logged[0]


class NoWriter:
    """A metrics writer that keeps nothing (the hook's eval records are not what is tested)."""

    def write(self, step: int, record: dict, stream: str) -> None:
        pass


def test_no_warning_of_a_map_no_step_has_trained_yet():
    # The README's first run trains K=1 only until step 2250; its monitor measured the untrained
    # map at steps 1500 and 2000 and warned of it (issue #58).
    not_contracting = {"pass_change_K4": 1.3, "pass_change_K5": 1.4, "contraction_rate": 1.08, "contracting": 0.0}
    logged = []
    monitor = ContractionMonitor(
        lambda state: dict(not_contracting), every_steps=500, log=logged.append, feedback_from=2250
    )
    evaluator = Evaluator(lambda state: dict(not_contracting), NoWriter(), 500, logged.append, feedback_from=2250)
    for hook in (monitor, evaluator):
        for step in (1500, 2000, 2250):  # step 2250 has run steps 0..2249: still no feedback pass
            hook.on_interval(StepEnd(step=step, num_passes=1, last=False, stopping=False), {}, state=None)
    assert logged == []
    monitor.on_interval(StepEnd(step=2251, num_passes=2, last=False, stopping=False), {}, state=None)
    assert len(logged) == 1 and "at step 2251 the feedback map is not contracting" in logged[0]
    never = ContractionMonitor(lambda state: dict(not_contracting), 500, logged.append, feedback_from=None)
    never.on_interval(StepEnd(step=3000, num_passes=1, last=True, stopping=False), {}, state=None)
    assert len(logged) == 1  # a K=1-only schedule never trains the map


def test_the_first_feedback_step_is_the_first_step_the_schedule_draws_k_of_two_or_more():
    tiny = PassSchedule.parse(DEFAULT_SCHEDULE, 3000, seed=0)
    first = tiny.first_feedback_step(3000)
    assert first is not None and first >= 2250 and tiny.num_passes(first) >= 2
    assert all(tiny.num_passes(step) == 1 for step in range(first))
    assert tiny.first_feedback_step(2250) is None  # a run that stops before the K ≥ 2 phase
    assert PassSchedule.parse("0.0:1=1.0", 3000, seed=0).first_feedback_step(3000) is None
    assert PassSchedule.parse("0.0:1=0.5,2=0.5", 3000, seed=0).first_feedback_step(3000) < 20
