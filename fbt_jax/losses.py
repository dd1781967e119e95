"""Token losses: where the readout meets the targets (training, evaluation and fbt-eval).

Sums rather than means, with the summed weight alongside, so that means over many batches, passes
or positions are exact. Masked targets (weight 0) may hold any filler id.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def token_nll_BT(logits_BTV: jax.Array, targets_BT: jax.Array, weights_BT: jax.Array) -> jax.Array:
    """Per-token weighted cross-entropy (fp32 or wider); exactly 0 where the weight is 0."""
    acc = jnp.promote_types(logits_BTV.dtype, jnp.float32)
    logprobs_BTV = jax.nn.log_softmax(logits_BTV.astype(acc), axis=-1)
    counted_BT = weights_BT > 0
    # Masked targets may hold any filler (e.g. -100): gather a valid index there, then drop it,
    # since an out-of-range gather gives NaN and NaN × 0 is still NaN.
    safe_targets_BT = jnp.where(counted_BT, targets_BT, 0)
    nll_BT = -jnp.take_along_axis(logprobs_BTV, safe_targets_BT[..., None], axis=-1)[..., 0]
    return jnp.where(counted_BT, nll_BT * weights_BT.astype(acc), 0.0)


def token_nll(logits_BTV: jax.Array, targets_BT: jax.Array, weights_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Summed weighted cross-entropy and summed weight (fp32), for exact means over batches."""
    acc = jnp.promote_types(logits_BTV.dtype, jnp.float32)
    return jnp.sum(token_nll_BT(logits_BTV, targets_BT, weights_BT)), jnp.sum(weights_BT.astype(acc))


def mean_loss(nll: jax.Array, weight: jax.Array) -> jax.Array:
    """Mean over tokens with non-zero weight (0 when there are none)."""
    return nll / jnp.maximum(weight, 1e-8)


def token_loss(logits_BTV: jax.Array, targets_BT: jax.Array, weights_BT: jax.Array) -> jax.Array:
    """Mean cross-entropy over tokens with non-zero weight (masked targets have weight 0)."""
    return mean_loss(*token_nll(logits_BTV, targets_BT, weights_BT))


def readout_nll(
    model: Any, h_BTD: jax.Array, targets_BT: jax.Array, weights_BT: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Summed NLL and weight of the model's tied readout of the top states `h_BTD`."""
    return token_nll(model.logits(h_BTD), targets_BT, weights_BT)


def readout_stats(model: Any, h_BTD: jax.Array, targets_BT: jax.Array, weights_BT: jax.Array) -> dict[str, jax.Array]:
    """Summed NLL, correct argmax predictions and weight of the readout of `h_BTD` (evaluation)."""
    logits_BTV = model.logits(h_BTD)
    nll, weight = token_nll(logits_BTV, targets_BT, weights_BT)
    correct_BT = (jnp.argmax(logits_BTV, -1) == targets_BT) * weights_BT
    return {"nll": nll, "correct": jnp.sum(correct_BT), "weight": weight}
