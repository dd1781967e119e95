"""The explicit FLOP count agrees with XLA's own count of the compiled forward."""

import jax
import jax.numpy as jnp
import pytest
from conftest import small_model_config
from flax import nnx

from fbt_jax.feedback import kpass_forward
from fbt_jax.flops import feedback_overhead_per_token, forward_flops, train_step_flops
from fbt_jax.model import build_model


@pytest.mark.slow
@pytest.mark.parametrize("num_passes", [1, 3])
def test_forward_flops_match_xla_cost_analysis(num_passes):
    cfg = small_model_config(vocab_size=512, embed_dim=256, num_heads=8, num_kv_heads=2, mlp_dim=512)
    graphdef, params = nnx.split(build_model(cfg, seed=0), nnx.Param)
    B, T = 4, 64

    def forward(params, tokens):
        model = nnx.merge(graphdef, params)
        return [model.logits(h) for h in kpass_forward(model, tokens, jnp.ones((B,), jnp.int32), num_passes)]

    compiled = jax.jit(forward).lower(params, jnp.zeros((B, T), jnp.int32)).compile()
    xla_flops = compiled.cost_analysis()["flops"]
    assert xla_flops == pytest.approx(forward_flops(cfg, T, num_passes) * B * T, rel=0.03)


def test_training_is_three_forwards_and_feedback_overhead_is_two_d_squared():
    cfg = small_model_config(
        embed_dim=2048, num_layers=18, num_heads=16, num_kv_heads=8, mlp_dim=5376, vocab_size=100_352
    )
    assert train_step_flops(cfg, 2, 10, 2) == 3 * 2 * 10 * forward_flops(cfg, 10, 2)
    assert forward_flops(cfg, 10, 2) - 2 * forward_flops(cfg, 10, 1) == 2 * 2 * 2048**2
    assert feedback_overhead_per_token(cfg, 2048) < 0.01
