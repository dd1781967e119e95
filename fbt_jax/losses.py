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
    sums = readout_sums(model, h_BTD, targets_BT, weights_BT, with_correct=False)
    return sums["nll"], sums["weight"]


def readout_stats(model: Any, h_BTD: jax.Array, targets_BT: jax.Array, weights_BT: jax.Array) -> dict[str, jax.Array]:
    """Summed NLL, correct argmax predictions and weight of the readout of `h_BTD` (evaluation)."""
    return readout_sums(model, h_BTD, targets_BT, weights_BT, with_correct=True)


def readout_sums(
    model: Any, h_BTD: jax.Array, targets_BT: jax.Array, weights_BT: jax.Array, with_correct: bool
) -> dict[str, jax.Array]:
    """The readout's summed NLL (and correct tokens) and weight, over sequence chunks when
    `model.cfg.loss_chunk_size` is set.

    Chunked, the (B, T, V) logits never exist at once, forward or backward: a scan visits chunks
    of `loss_chunk_size` positions, and each chunk's logits are recomputed in the backward pass
    (`jax.checkpoint`) instead of being stored, so the readout holds (B, chunk, V) at a time.
    The batch axis stays whole, so a batch-sharded h is never resharded.
    """

    def chunk_sums(h_BCD: jax.Array, targets_BC: jax.Array, weights_BC: jax.Array) -> dict[str, jax.Array]:
        logits_BCV = model.logits(h_BCD)
        sums = {"nll": jnp.sum(token_nll_BT(logits_BCV, targets_BC, weights_BC))}
        if with_correct:
            sums["correct"] = jnp.sum((jnp.argmax(logits_BCV, -1) == targets_BC) * weights_BC)
        return sums

    acc = jnp.promote_types(h_BTD.dtype, jnp.float32)
    weight = jnp.sum(weights_BT.astype(acc))
    B, T, D = h_BTD.shape
    chunk = int(getattr(model.cfg, "loss_chunk_size", 0) or 0)
    if not 0 < chunk < T:
        return {**chunk_sums(h_BTD, targets_BT, weights_BT), "weight": weight}
    n = -(-T // chunk)
    pad = n * chunk - T  # padded positions have weight 0: they add nothing

    def chunks(x: jax.Array) -> jax.Array:  # (B, T, ...) -> (n, B, chunk, ...)
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.swapaxes(x.reshape(B, n, chunk, *x.shape[2:]), 0, 1)

    def body(totals: dict[str, jax.Array], xs: tuple) -> tuple[dict[str, jax.Array], None]:
        sums = jax.checkpoint(chunk_sums)(*xs)
        return {k: totals[k] + sums[k].astype(acc) for k in totals}, None

    zeros = {k: jnp.zeros((), acc) for k in (("nll", "correct") if with_correct else ("nll",))}
    totals, _ = jax.lax.scan(body, zeros, (chunks(h_BTD), chunks(targets_BT), chunks(weights_BT)))
    return {**totals, "weight": weight}
