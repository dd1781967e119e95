"""The transformer stack: logical axes, init scales, dtypes, segments, scanned layers and remat."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import small_model_config
from flax import nnx

from fbt_jax import model as model_lib
from fbt_jax.attention import MaskSpec
from fbt_jax.feedback import kpass_forward
from fbt_jax.model import build_model

KNOWN_AXES = {"vocab", "embed", "mlp", "heads", "kv_heads", "head_dim", "norm", "fusion"}


def test_every_parameter_has_logical_axis_names(small_model):
    params = nnx.state(small_model, nnx.Param)
    leaves = jax.tree_util.tree_leaves_with_path(params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    assert len(leaves) == 2 + 2 * 9 + 1 + 1  # fusion(2) + blocks(9 each) + final norm + embedding
    for path, var in leaves:
        axes = var.get_metadata()["out_sharding"]
        assert len(axes) == var[...].ndim, path
        assert set(axes) <= KNOWN_AXES, (path, axes)
    specs = nnx.get_partition_spec(params)
    assert tuple(specs["embedding_VD"]) == ("vocab", "embed")
    assert tuple(specs["blocks"][0]["mlp"]["down_FD"]) == ("mlp", "embed")


def test_residual_outputs_are_depth_scaled():
    cfg = small_model_config(embed_dim=128, num_layers=8, mlp_dim=256)
    model = build_model(cfg, seed=0)
    expected = cfg.embed_dim**-0.5 / math.sqrt(2 * cfg.num_layers)
    down = np.concatenate([np.ravel(b.mlp.down_FD[...]) for b in model.blocks])
    out = np.concatenate([np.ravel(b.attn.o_NHD[...]) for b in model.blocks])
    up = np.concatenate([np.ravel(b.mlp.up_DF[...]) for b in model.blocks])
    assert abs(down.std() / expected - 1) < 0.05 and abs(out.std() / expected - 1) < 0.05
    assert abs(up.std() / cfg.embed_dim**-0.5 - 1) < 0.05


def test_residual_stream_stays_order_one_as_depth_grows():
    # Depth scaling keeps the pre-final-norm residual stream O(1) at init for any depth (without
    # the 1/sqrt(2L) factor its RMS grows like sqrt(L)), so the carried state's scale does not
    # depend on how deep the model is.
    tokens = jnp.arange(16)[None]
    positions = jnp.arange(16)[None]
    spec = MaskSpec(positions)
    rms = {}
    for layers in (2, 8, 32):
        model = build_model(small_model_config(num_layers=layers), seed=0)
        x = model.embed(tokens)
        for block in model.blocks:
            x = block(x, spec)
        rms[layers] = float(jnp.sqrt(jnp.mean(x**2)))
    assert all(0.8 < r < 2.0 for r in rms.values()), rms
    assert rms[32] / rms[2] < 1.2, rms


@pytest.mark.slow
def test_bf16_compute_keeps_fp32_params_and_tracks_fp32():
    fp32 = build_model(small_model_config(), seed=0)
    bf16 = build_model(small_model_config(compute_dtype="bfloat16"), seed=0)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(nnx.state(bf16, nnx.Param)))
    tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 8), 0, 16)
    p_B = jnp.array([1, 1])
    h16 = kpass_forward(bf16, tokens, p_B, 2)[-1]
    assert h16.dtype == jnp.bfloat16 and bf16.logits(h16).dtype == jnp.float32
    h32 = kpass_forward(fp32, tokens, p_B, 2)[-1]
    assert float(jnp.max(jnp.abs(h16.astype(jnp.float32) - h32))) < 0.1


def test_segments_do_not_attend_to_each_other(small_model):
    a = jax.random.randint(jax.random.PRNGKey(1), (1, 5), 0, 16)
    b = jax.random.randint(jax.random.PRNGKey(2), (1, 7), 0, 16)
    packed = jnp.concatenate([a, b], axis=1)
    positions = jnp.concatenate([jnp.arange(5), jnp.arange(7)])[None]
    segments = jnp.array([[1] * 5 + [2] * 7])
    p_B = jnp.array([2])
    h_packed = kpass_forward(small_model, packed, p_B, 3, positions_BT=positions, segment_ids_BT=segments)[-1]
    h_a = kpass_forward(small_model, a, p_B, 3)[-1]
    h_b = kpass_forward(small_model, b, p_B, 3)[-1]
    assert float(jnp.max(jnp.abs(h_packed[:, :5] - h_a))) <= 1e-5
    assert float(jnp.max(jnp.abs(h_packed[:, 5:] - h_b))) <= 1e-5


def _stacked(pure):
    """An unscanned model's parameters (pure dict) in the scanned layout: blocks stacked on axis 0."""
    blocks = pure["blocks"]
    return {**pure, "blocks": jax.tree.map(lambda *layers: jnp.stack(layers), *[blocks[i] for i in sorted(blocks)])}


def _loss_and_grads(model, tokens, p_B):
    from fbt_jax.feedback import kpass_loss

    graphdef, params = nnx.split(model, nnx.Param)
    batch = {"inputs": tokens, "targets": jnp.roll(tokens, -1, 1), "weights": jnp.ones(tokens.shape)}

    def loss_fn(params):
        return kpass_loss(nnx.merge(graphdef, params), batch, p_B, 3)[0]

    return jax.jit(jax.value_and_grad(loss_fn))(params)


@pytest.mark.slow
def test_scanned_layers_and_remat_policies_compute_the_same_function():
    tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 8), 0, 16)
    p_B = jnp.array([1, 3])
    plain = build_model(small_model_config(num_layers=3), seed=0)
    loss, grads = _loss_and_grads(plain, tokens, p_B)
    plain_params = nnx.to_pure_dict(nnx.state(plain, nnx.Param))
    # Every policy once and both layer layouts, in four compiles.
    combos = [("none", True), ("block", False), ("save_matmuls", True), ("save_matmuls_no_batch", False)]
    assert {remat for remat, _ in combos} == set(model_lib.REMAT_POLICIES)
    for remat, scan in combos:
        other = build_model(small_model_config(num_layers=3, remat=remat, scan_layers=scan), seed=0)
        expected_grads = nnx.to_pure_dict(grads)
        if scan:
            state = nnx.state(other, nnx.Param)
            nnx.replace_by_pure_dict(state, _stacked(plain_params))
            nnx.update(other, state)
            expected_grads = _stacked(expected_grads)
        other_loss, other_grads = _loss_and_grads(other, tokens, p_B)
        assert abs(float(other_loss - loss)) <= 1e-6, (remat, scan)
        flat, ref = jax.tree.leaves(nnx.to_pure_dict(other_grads)), jax.tree.leaves(expected_grads)
        assert len(flat) == len(ref)
        assert max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(flat, ref)) <= 1e-5, (remat, scan)


def test_scanned_blocks_carry_the_layers_axis_name():
    model = build_model(small_model_config(num_layers=3, scan_layers=True), seed=0)
    up = nnx.state(model, nnx.Param)["blocks"]["mlp"]["up_DF"]
    assert up.get_metadata()["out_sharding"] == ("layers", "embed", "mlp")
