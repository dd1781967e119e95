"""The reference attention: explicit einsums over the materialised mask (`xla`, also named
`einsum`), and `jax.nn.dot_product_attention` with the same mask (`dot_product`).

Shapes: q_BTNH (N query heads), k_BSGH and v_BSGH (G kv heads, N = G·R), mask_B1TS boolean.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def xla_attention(q_BTNH: jax.Array, k_BSGH: jax.Array, v_BSGH: jax.Array, mask_B1TS: jax.Array) -> jax.Array:
    """softmax(q·kᵀ/√H, masked)·v in at least fp32, grouped kv heads without repeating them."""
    B, T, N, H = q_BTNH.shape
    G = k_BSGH.shape[2]
    cd = q_BTNH.dtype
    acc = jnp.promote_types(cd, jnp.float32)
    # Query head n uses kv head n // R: split N into (G, R) instead of repeating the kv heads.
    q_BTGRH = q_BTNH.reshape(B, T, G, N // G, H)
    scores_BGRTS = jnp.einsum("btgrh,bsgh->bgrts", q_BTGRH, k_BSGH, preferred_element_type=acc) * (H**-0.5)
    scores_BGRTS = jnp.where(mask_B1TS[:, :, None], scores_BGRTS, jnp.finfo(acc).min)
    probs_BGRTS = jax.nn.softmax(scores_BGRTS, axis=-1).astype(cd)
    out_BTGRH = jnp.einsum("bgrts,bsgh->btgrh", probs_BGRTS, v_BSGH)
    return out_BTGRH.reshape(B, T, N, H)


def dot_product_attention(q_BTNH: jax.Array, k_BSGH: jax.Array, v_BSGH: jax.Array, mask_B1TS: jax.Array) -> jax.Array:
    """jax.nn.dot_product_attention with the mask: XLA's attention on every backend (a mask keeps
    it off cuDNN's kernel; `cudnn` is the flash path)."""
    return jax.nn.dot_product_attention(q_BTNH, k_BSGH, v_BSGH, mask=mask_B1TS, scale=q_BTNH.shape[-1] ** -0.5)
