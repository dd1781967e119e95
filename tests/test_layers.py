"""Building blocks: grouped-query attention (the attention implementations: tests/test_attention.py)."""

import jax
import jax.numpy as jnp
from conftest import small_model_config
from flax import nnx

from fbt_jax.feedback import kpass_forward
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
