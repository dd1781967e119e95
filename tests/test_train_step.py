"""The train step (noise, prefix mix-in, determinism), the eval step, and the optimizer."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import load_config, run_config
from flax import nnx

from fbt_jax.feedback import kpass_forward
from fbt_jax.losses import token_nll
from fbt_jax.model import ModelConfig, build_model
from fbt_jax.train.step import eval_step, make_optimizer, optimizer_with, step_settings, train_step
from fbt_jax.train.trainer import Trainer


def test_learning_rate_warms_up_then_decays_and_fusion_is_not_decayed():
    config = load_config("tiny")
    config.optimizer.warmup_steps = 2
    tx, lr = make_optimizer(config)
    o = config.optimizer
    assert float(lr(0)) == 0.0
    assert float(lr(o.warmup_steps)) == pytest.approx(o.learning_rate)
    assert float(lr(config.train.steps)) == pytest.approx(o.learning_rate * o.min_learning_rate_ratio)
    _, params = nnx.split(build_model(ModelConfig.from_config(config.model), seed=0), nnx.Param)
    zero_grads = jax.tree.map(np.zeros_like, params)
    updates, _ = tx.update(zero_grads, tx.init(params), params)
    # With zero gradients only weight decay moves parameters: matrices yes, fusion and norms no.
    assert np.abs(updates["blocks"][0]["mlp"]["up_DF"][...]).max() == 0.0  # lr(0) = 0 at step 0
    state = tx.init(params)
    for _ in range(o.warmup_steps + 1):
        updates, state = tx.update(zero_grads, state, params)
    assert np.abs(updates["blocks"][0]["mlp"]["up_DF"][...]).max() > 0
    assert np.abs(updates["fusion"]["state_proj_DD"][...]).max() == 0.0
    assert np.abs(updates["final_norm"]["scale"][...]).max() == 0.0


@pytest.mark.slow
def test_train_step_applies_noise_and_prefix_mixin_and_eval_is_deterministic(tmp_path):
    config = run_config(tmp_path, "step", schedule="0:2")
    config.passes.prefix_mixin_prob = 1.0
    config.passes.fuse_from_min, config.passes.fuse_from_max = 5, 7
    trainer = Trainer(config, log=lambda *_: None, devices=jax.devices()[:1])
    trainer.init_state()
    batch = trainer.batch("train", 0, config.train.batch_size)

    def run(settings):
        step = functools.partial(
            train_step,
            graphdef=trainer.programs.graphdef,
            make_tx=functools.partial(optimizer_with, config),
            num_passes=2,
        )
        constants = trainer.programs.step_constants
        return jax.jit(step, static_argnames="settings")(trainer.state, batch, constants, settings=settings)[1]

    base = step_settings(config)
    with_noise, again = run(base), run(base)
    without_noise = run(dataclasses.replace(base, pass_options=dataclasses.replace(base.pass_options, noise_std=0.0)))
    assert float(with_noise["loss_pass_2"]) == float(again["loss_pass_2"])  # keyed by (seed, step)
    assert float(with_noise["loss_pass_2"]) != float(without_noise["loss_pass_2"])
    assert float(with_noise["loss_pass_1"]) == float(without_noise["loss_pass_1"])
    fully_fused = run(dataclasses.replace(base, prefix_mixin_prob=0.0))
    assert float(fully_fused["mean_fuse_from"]) == 1.0
    assert 5.0 <= float(with_noise["mean_fuse_from"]) <= 7.0

    # Eval: no noise, fuse-from = eval.fuse_from, pass k of the program = a k-pass forward.
    out = jax.jit(functools.partial(eval_step, graphdef=trainer.programs.graphdef, num_passes=3, fuse_from=4))(
        trainer.state.params, batch
    )
    model = nnx.merge(trainer.programs.graphdef, trainer.state.params)
    states = kpass_forward(model, batch["inputs"], jnp.full((config.train.batch_size,), 4), 3)
    for k, h in enumerate(states, start=1):
        nll, _ = token_nll(model.logits(h), batch["targets"], batch["weights"])
        assert float(out[f"nll_{k}"]) == pytest.approx(float(nll), rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("num_passes", [1, 2])
def test_microbatches_give_the_full_batch_update(tmp_path, num_passes):
    """Gradient accumulation: with prefix mix-in and noise, 2 or 4 microbatches give the loss,
    the gradient norm and the parameters of one full-batch step, to fp32 rounding."""
    config = run_config(tmp_path)
    config.train.batch_size = 8
    config.passes.prefix_mixin_prob, config.passes.noise_std = 0.5, 0.1
    trainer = Trainer(config, log=lambda *_: None, devices=jax.devices()[:1])
    trainer.init_state()
    batch = trainer.batch("train", 3, 8)
    p = trainer.programs
    results = {}
    for microbatches in (1, 2, 4):
        config.train.microbatches = microbatches
        step = functools.partial(
            train_step,
            graphdef=p.graphdef,
            make_tx=functools.partial(optimizer_with, config),
            settings=step_settings(config),
            num_passes=num_passes,
        )
        results[microbatches] = jax.jit(step)(trainer.state, batch, p.step_constants)
    (full_state, full_metrics) = results[1]
    for microbatches in (2, 4):
        state, metrics = results[microbatches]
        np.testing.assert_allclose(metrics["loss"], full_metrics["loss"], rtol=1e-6)
        np.testing.assert_allclose(metrics["grad_norm"], full_metrics["grad_norm"], rtol=1e-5)
        for a, b in zip(jax.tree.leaves(full_state.params), jax.tree.leaves(state.params), strict=True):
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


def test_chat_rows_fuse_where_their_data_says_and_mixed_pretraining_rows_as_drawn(small_model):
    """A batch with a fuse mask (chat data): the step's loss is the K-pass loss fused where the data says
    (its replies), whatever the drawn fuse-from; rows marked -1 (pretraining rows mixed with chat data)
    are fused from their drawn fuse-from as without a mask: the same loss bits, and the same update to
    float32 rounding (two programs: XLA fuses the backward of each differently)."""
    from fbt_jax.feedback import kpass_loss
    from fbt_jax.train.step import TrainState

    config = load_config("tiny")
    config.passes.prefix_mixin_prob, config.passes.fuse_from_min, config.passes.fuse_from_max = 1.0, 3, 5
    config.passes.noise_std = 0.0
    graphdef, params = nnx.split(small_model, nnx.Param)
    tx = optimizer_with(config, make_optimizer(config)[1])
    state = TrainState(step=jnp.asarray(3, jnp.int32), params=params, opt_state=tx.init(params))
    B, T = 4, 12
    tokens = jax.random.randint(jax.random.PRNGKey(5), (B, T + 1), 0, 16)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": jnp.ones((B, T), jnp.float32),
             "segment_ids": jnp.ones((B, T), jnp.int32), "positions": jnp.broadcast_to(jnp.arange(T), (B, T))}  # fmt: skip
    fuse_BT = (jnp.arange(T) >= jnp.array([[2], [6], [9], [4]])).astype(jnp.int32)  # each row's reply
    constants = {k: jnp.asarray(v) for k, v in step_constants_of(config).items()}
    step = jax.jit(functools.partial(train_step, graphdef=graphdef, make_tx=functools.partial(optimizer_with, config),
                                     settings=step_settings(config), num_passes=2))  # fmt: skip
    _, chat = step(state, {**batch, "fuse": fuse_BT}, constants)
    want, _ = kpass_loss(small_model, batch, fuse_BT, 2)
    assert float(chat["loss"]) == pytest.approx(float(want), rel=1e-6)
    plain_state, plain = step(state, batch, constants)
    mixed_state, mixed = step(state, {**batch, "fuse": jnp.full((B, T), -1, jnp.int32)}, constants)
    assert float(mixed["loss"]) == float(plain["loss"]) != float(chat["loss"])
    for a, b in zip(jax.tree.leaves(plain_state), jax.tree.leaves(mixed_state)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def step_constants_of(config):
    from fbt_jax.train.step import step_constants

    return step_constants(config)
