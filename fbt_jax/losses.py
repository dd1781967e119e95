"""Token losses: where the readout meets the targets (training, evaluation and fbt-eval).

Sums rather than means, with the summed weight alongside, so that means over many batches, passes
or positions are exact. Masked targets (weight 0) may hold any filler id.
"""

from __future__ import annotations

import functools
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
    embedding_VD = model.readout_table().astype(h_BTD.dtype)
    scale = model.readout_scale()

    def chunk_sums(h_BCD: jax.Array, targets_BC: jax.Array, weights_BC: jax.Array) -> dict[str, jax.Array]:
        nll, correct = fused_readout_xent(h_BCD, embedding_VD, targets_BC, weights_BC, scale, with_correct)
        return {"nll": nll, "correct": correct} if with_correct else {"nll": nll}

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


# The readout and cross-entropy as one differentiable function with a hand-written backward pass.
# Autodiff of log_softmax + take_along_axis reads and writes several (B, T, V) tensors per pass
# (the scatter of the target gradient, the softmax gradient, the scale); at a real vocabulary that
# cost rivals the whole transformer's on CPU. Here the forward pass already forms the logits'
# gradient per unit of loss, G = (softmax(z) − onehot(y)) · w · s, in the same sweep that computes
# the log-sum-exp, and the backward pass is two matmuls with G: dh = g·G·E, dE = g·Gᵀ·h.
# G takes the memory autodiff would keep for the logits; chunking (above) bounds both.
@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def fused_readout_xent(
    h_BTD: jax.Array,
    embedding_VD: jax.Array,
    targets_BT: jax.Array,
    weights_BT: jax.Array,
    scale: float,
    with_correct: bool,
) -> tuple[jax.Array, jax.Array]:
    """(Σ_t w_t · NLL_t, Σ_t w_t · [argmax = target]) of the readout z = s · h Eᵀ (fp32 or wider).

    Equal to `token_nll` of `model.logits(h)` (and its gradients to autodiff's) to rounding; the
    correct count is 0 unless `with_correct` (it has no gradient).
    """
    return _xent_forward(h_BTD, embedding_VD, targets_BT, weights_BT, scale, with_correct)[0]


def _xent_forward(h_BTD, embedding_VD, targets_BT, weights_BT, scale, with_correct):
    acc = jnp.promote_types(h_BTD.dtype, jnp.float32)
    logits_BTV = jnp.einsum("btd,vd->btv", h_BTD, embedding_VD, preferred_element_type=acc)
    if scale != 1.0:
        logits_BTV = logits_BTV * scale
    counted_BT = weights_BT > 0
    w_BT = jnp.where(counted_BT, weights_BT.astype(acc), 0.0)
    safe_targets_BT = jnp.where(counted_BT, targets_BT, 0)  # masked targets may hold any filler
    max_BT1 = jax.lax.stop_gradient(jnp.max(logits_BTV, axis=-1, keepdims=True))
    shifted_BTV = logits_BTV - max_BT1
    lse_BT1 = jnp.log(jnp.sum(jnp.exp(shifted_BTV), axis=-1, keepdims=True))
    target_BT = jnp.take_along_axis(shifted_BTV, safe_targets_BT[..., None], axis=-1)[..., 0]
    nll_BT = jnp.where(counted_BT, lse_BT1[..., 0] - target_BT, 0.0)
    is_target_BTV = jnp.arange(logits_BTV.shape[-1]) == safe_targets_BT[..., None]
    grad_BTV = (jnp.exp(shifted_BTV - lse_BT1) - is_target_BTV) * (w_BT * scale)[..., None]
    correct = jnp.zeros((), acc)
    if with_correct:
        correct = jnp.sum((jnp.argmax(logits_BTV, -1) == targets_BT) * w_BT)
    residuals = (h_BTD, embedding_VD, grad_BTV.astype(h_BTD.dtype), nll_BT, weights_BT)
    return (jnp.sum(nll_BT * w_BT), correct), residuals


def _xent_backward(scale, with_correct, residuals, cotangents):
    del scale, with_correct  # inside G already; the correct count is piecewise constant
    h_BTD, embedding_VD, grad_BTV, nll_BT, weights_BT = residuals
    g = cotangents[0]
    # In the compute dtype, like every other matmul's gradient (bf16 × bf16 → fp32 dots are not
    # implemented on every XLA backend; accelerators accumulate bf16 matmuls in fp32 anyway).
    acc = jnp.promote_types(h_BTD.dtype, jnp.float32)
    d_h_BTD = (jnp.einsum("btv,vd->btd", grad_BTV, embedding_VD).astype(acc) * g).astype(h_BTD.dtype)
    # Contracting G's leading axes with the small h on the left keeps G in its stored layout: the
    # "btv,btd->vd" order made XLA (CPU) first write a transposed copy of the (B·T, V) tensor.
    d_embedding_VD = jnp.einsum("btd,btv->dv", h_BTD, grad_BTV).T.astype(acc) * g
    d_weights_BT = (nll_BT * g).astype(weights_BT.dtype)
    return d_h_BTD, d_embedding_VD.astype(embedding_VD.dtype), None, d_weights_BT


fused_readout_xent.defvjp(_xent_forward, _xent_backward)
