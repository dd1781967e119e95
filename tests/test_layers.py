"""Building blocks: grouped-query attention and the causal, segmented attention mask."""

import jax
import jax.numpy as jnp
import numpy as np
from conftest import small_model_config
from flax import nnx

from fbt_jax.feedback import kpass_forward
from fbt_jax.layers import attention_mask
from fbt_jax.model import build_model


def test_grouped_kv_heads_equal_full_attention_with_repeated_kv():
    gqa = build_model(small_model_config(num_heads=4, num_kv_heads=2), seed=0)
    mha = build_model(small_model_config(num_heads=4, num_kv_heads=4), seed=1)
    _, gqa_params = nnx.split(gqa, nnx.Param)
    mha_graph, mha_params = nnx.split(mha, nnx.Param)
    mha_params = jax.tree.map(lambda x: x, gqa_params)  # same values everywhere ...
    for i in range(2):  # ... except k/v: head n of the MHA model copies kv head n // 2
        attn = mha_params["blocks"][i]["attn"]
        for name in ("k_DGH", "v_DGH"):
            attn[name] = nnx.Param(jnp.repeat(attn[name][...], 2, axis=1))
    mha = nnx.merge(mha_graph, mha_params)
    tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 8), 0, 16)
    p_B = jnp.array([1, 3])
    a = kpass_forward(gqa, tokens, p_B, 2)[-1]
    b = kpass_forward(mha, tokens, p_B, 2)[-1]
    assert float(jnp.max(jnp.abs(a - b))) <= 1e-5


def test_attention_mask_is_causal_and_segmented():
    positions = jnp.arange(4)[None]
    mask = attention_mask(positions, jnp.array([[1, 1, 2, 2]]))[0, 0]
    assert np.array_equal(np.asarray(mask), np.array([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]], bool))


def test_dot_product_attention_equals_the_einsum_path_in_training_and_every_decoding_mode():
    """model.attention_impl="dot_product" (jax.nn.dot_product_attention) against the einsums:
    a K = 2 loss and its gradients on packed sequences, and generation in every mode."""
    from flax import nnx

    from fbt_jax import decode
    from fbt_jax.feedback import kpass_loss

    einsum = build_model(small_model_config(), seed=0)
    fused = build_model(small_model_config(attention_impl="dot_product"), seed=0)
    tokens = jax.random.randint(jax.random.PRNGKey(3), (2, 10), 0, 16)
    segments = jnp.array([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2], [0] * 10])
    positions = jnp.array([[0, 1, 2, 0, 1, 2, 3, 0, 1, 2], list(range(10))])
    batch = {
        "inputs": tokens,
        "targets": jnp.roll(tokens, -1, 1),
        "weights": jnp.ones((2, 10)),
        "segment_ids": segments,
        "positions": positions,
    }

    def loss(model):
        return kpass_loss(model, batch, jnp.array([1, 2]), 2)[0]

    (loss_e, grads_e), (loss_d, grads_d) = [nnx.value_and_grad(loss)(m) for m in (einsum, fused)]
    np.testing.assert_allclose(loss_d, loss_e, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(nnx.state(grads_e)), jax.tree.leaves(nnx.state(grads_d)), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)
    prompts, lengths = tokens[:, :5], jnp.array([5, 3])
    for mode in decode.MODES:
        state_e = decode.prefill(einsum, prompts, lengths, 12, mode)
        state_d = decode.prefill(fused, prompts, lengths, 12, mode)
        np.testing.assert_allclose(state_d.logits_BV, state_e.logits_BV, rtol=1e-4, atol=1e-5)
        out_e, _ = decode.generate(einsum, prompts, lengths, 6, mode)
        out_d, _ = decode.generate(fused, prompts, lengths, 6, mode)
        assert np.array_equal(out_d, out_e), mode
