"""Linear probes: is the quantity a position must produce linearly readable inside the stack?

The paper's probe (docs/method.md §9): on state tracking and delayed recall, one feedback pass
makes the answer at position t linearly readable at the first layer, where a plain pass leaves
it near chance. Here a multinomial logistic regression is fitted on one split's activations and
scored on another's, for

- every layer, pooled over the scored positions (`probes`), and
- the first layer at each position t separately (`probes_by_position`), one probe per position
  (all fitted at once with `vmap`), which shows where the plain pass stops being able to answer.

Three feedback settings, all fully fused from position 1: K = 1 (no feedback), K = 2 (one
feedback pass, as trained), and the exact recurrence (K = T passes: every position fed the
fully computed state of the one before, as latent-feedback decoding sees it).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fbt_jax.attention import MaskSpec
from fbt_jax.errors import ConfigError
from fbt_jax.feedback import last_pass_inputs
from fbt_jax.layers import default_positions


def feedback_settings(seq_len: int) -> dict[str, int]:
    """Probe setting → number of passes: none, one feedback pass, the exact recurrence."""
    return {"K1": 1, "K2": 2, "exact": seq_len}


def layer_features(model: Any, tokens: jax.Array, num_passes: int) -> list[np.ndarray]:
    """Each block's output (layer 0 … L−1) in the last of `num_passes` passes, fully fused."""
    if model.cfg.scan_layers:
        raise ConfigError("layer probes need an unscanned model (model.scan_layers=False)")
    positions = default_positions(tokens.shape)
    fully_fused = jnp.ones(tokens.shape[0], jnp.int32)
    _, u = last_pass_inputs(model, model.embed(tokens), fully_fused, num_passes, positions)
    spec = MaskSpec(positions, None, model.cfg.sliding_window)
    x = u.astype(model.compute_dtype)
    outputs = []
    for block in model.blocks:
        x = block(x, spec)
        outputs.append(np.asarray(x, np.float32))
    return outputs


def _fit_and_score(
    train_x: jax.Array, train_y: jax.Array, test_x: jax.Array, test_y: jax.Array, classes: int, steps: int
) -> jax.Array:
    """Held-out accuracy of a multinomial logistic regression (standardised features, Adam)."""
    mean, std = train_x.mean(0), train_x.std(0) + 1e-6
    xtr, xte = (train_x - mean) / std, (test_x - mean) / std
    params = {"w": jnp.zeros((xtr.shape[1], classes)), "b": jnp.zeros(classes)}
    tx = optax.adam(0.05)

    def loss_fn(p: dict) -> jax.Array:
        logits = xtr @ p["w"] + p["b"]
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, train_y).mean()
        return nll + 1e-4 * jnp.sum(p["w"] ** 2)

    def body(_: Any, carry: tuple) -> tuple:
        params, opt = carry
        updates, opt = tx.update(jax.grad(loss_fn)(params), opt, params)
        return optax.apply_updates(params, updates), opt

    params = jax.lax.fori_loop(0, steps, body, (params, tx.init(params)))[0]
    return jnp.mean(jnp.argmax(xte @ params["w"] + params["b"], -1) == test_y)


def linear_probe(
    train_x: np.ndarray, train_y: np.ndarray, test_x: np.ndarray, test_y: np.ndarray, steps: int = 300
) -> float:
    """Held-out accuracy of one linear probe (features (N, D), integer labels (N,))."""
    classes = int(max(train_y.max(), test_y.max())) + 1
    fit = jax.jit(_fit_and_score, static_argnums=(4, 5))
    args = [jnp.asarray(a) for a in (train_x, train_y, test_x, test_y)]
    return float(fit(*args, classes, steps))


def probes(model: Any, train: dict[str, np.ndarray], test: dict[str, np.ndarray]) -> dict[str, Any]:
    """Per-layer probe accuracy for the label at every scored position, K = 1 and K = 2, and the
    majority-class chance level."""
    result: dict[str, Any] = {}
    tr_mask, te_mask = train["weights"] > 0, test["weights"] > 0
    counts = np.bincount(test["targets"][te_mask])
    result["chance"] = float(counts.max() / counts.sum())
    for name in ("K1", "K2"):
        passes = feedback_settings(train["inputs"].shape[1])[name]
        tr_layers = layer_features(model, jnp.asarray(train["inputs"]), passes)
        te_layers = layer_features(model, jnp.asarray(test["inputs"]), passes)
        result[name] = [
            linear_probe(a[tr_mask], train["targets"][tr_mask], b[te_mask], test["targets"][te_mask])
            for a, b in zip(tr_layers, te_layers)
        ]
    return result


def probes_by_position(
    model: Any, train: dict[str, np.ndarray], test: dict[str, np.ndarray], layer: int = 0, steps: int = 300
) -> dict[str, Any]:
    """For each feedback setting, the accuracy of a separate probe at every position t of layer
    `layer`'s output for position t's target; `chance` per position (majority class of the test
    labels there); positions with no scored target (e.g. the first `delay` of delayed recall) are
    left out and listed in `positions`."""
    seq_len = train["inputs"].shape[1]
    scored = [t for t in range(seq_len) if train["weights"][:, t].all() and test["weights"][:, t].all()]
    classes = int(max(train["targets"].max(), test["targets"].max())) + 1
    # One probe per position, all fitted together (positions are the vmapped axis).
    fit_all = jax.jit(jax.vmap(lambda a, b, c, d: _fit_and_score(a, b, c, d, classes, steps)))
    result: dict[str, Any] = {"layer": layer, "positions": scored}
    labels_tr = jnp.asarray(train["targets"][:, scored].T)  # (T', N)
    labels_te = jnp.asarray(test["targets"][:, scored].T)
    result["chance"] = [float(np.bincount(test["targets"][:, t]).max() / len(test["targets"])) for t in scored]
    for name, passes in feedback_settings(seq_len).items():
        tr = layer_features(model, jnp.asarray(train["inputs"]), passes)[layer][:, scored].transpose(1, 0, 2)
        te = layer_features(model, jnp.asarray(test["inputs"]), passes)[layer][:, scored].transpose(1, 0, 2)
        result[name] = [float(a) for a in fit_all(jnp.asarray(tr), labels_tr, jnp.asarray(te), labels_te)]
    return result
