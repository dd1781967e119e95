"""Token losses against a direct numpy computation: masked targets (any filler id) count nothing,
sums and weights give exact means, and the readout's correct count is a count of argmax hits."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fbt_jax.losses import mean_loss, readout_nll, readout_stats, token_loss, token_nll, token_nll_BT

B, T, V = 2, 5, 7


def batch(seed=0):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(B, T, V)).astype(np.float32) * 3
    targets = rng.integers(0, V, size=(B, T)).astype(np.int32)
    weights = (rng.random((B, T)) < 0.7).astype(np.float32)
    weights[0, 0], weights[1, -1] = 0.0, 2.0  # a masked and a doubly weighted position for sure
    return logits, targets, weights


def numpy_nll_BT(logits, targets, weights):
    """-log softmax(logits)[target] × weight, in float64, with masked positions skipped."""
    logits = logits.astype(np.float64)
    out = np.zeros(targets.shape)
    for b in range(targets.shape[0]):
        for t in range(targets.shape[1]):
            if weights[b, t] > 0:
                row = logits[b, t]
                log_z = row.max() + np.log(np.exp(row - row.max()).sum())
                out[b, t] = (log_z - row[targets[b, t]]) * weights[b, t]
    return out


class Readout:
    """A stand-in model whose readout of the states is the states themselves (not chunked):
    an identity embedding table, unscaled."""

    cfg = types.SimpleNamespace(loss_chunk_size=0)
    embedding_VD = jnp.eye(V)

    def readout_table(self):
        return self.embedding_VD

    def readout_scale(self):
        return 1.0


@pytest.mark.parametrize("filler", [-100, V, 10**6])  # PyTorch's ignore index, V (out of range), far out
def test_token_nll_is_zero_where_the_weight_is_zero_even_for_a_filler_target(filler):
    logits, targets, weights = batch()
    masked = np.where(weights > 0, targets, filler)
    nll_BT = np.asarray(token_nll_BT(jnp.asarray(logits), jnp.asarray(masked), jnp.asarray(weights)))
    assert np.all(np.isfinite(nll_BT))
    assert np.all(nll_BT[weights == 0] == 0.0)
    np.testing.assert_allclose(nll_BT, numpy_nll_BT(logits, targets, weights), rtol=1e-5, atol=1e-6)


def test_token_nll_and_the_mean_equal_a_numpy_reference():
    logits, targets, weights = batch(1)
    nll, weight = token_nll(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(weights))
    reference = numpy_nll_BT(logits, targets, weights)
    assert float(nll) == pytest.approx(reference.sum(), rel=1e-5)
    assert float(weight) == weights.sum()
    assert float(mean_loss(nll, weight)) == pytest.approx(reference.sum() / weights.sum(), rel=1e-5)
    assert float(token_loss(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(weights))) == pytest.approx(
        reference.sum() / weights.sum(), rel=1e-5
    )
    assert float(mean_loss(jnp.float32(0.0), jnp.float32(0.0))) == 0.0  # no counted token: 0, not NaN


def test_sums_over_batches_give_the_exact_mean_of_the_whole():
    logits, targets, weights = batch(2)
    whole = token_nll(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(weights))
    halves = [
        token_nll(jnp.asarray(logits[i : i + 1]), jnp.asarray(targets[i : i + 1]), jnp.asarray(weights[i : i + 1]))
        for i in range(B)
    ]
    assert float(sum(n for n, _ in halves)) == pytest.approx(float(whole[0]), rel=1e-6)
    assert float(sum(w for _, w in halves)) == float(whole[1])


def test_bf16_logits_are_scored_in_fp32():
    logits, targets, weights = batch(3)
    nll_BT = token_nll_BT(jnp.asarray(logits, jnp.bfloat16), jnp.asarray(targets), jnp.asarray(weights))
    assert nll_BT.dtype == jnp.float32


def test_readout_stats_count_the_correct_argmax_predictions_by_hand():
    logits, targets, weights = batch(4)
    targets[0, 1:3] = logits[0, 1:3].argmax(-1)  # make a few predictions right for sure
    weights[0, 1:3] = 1.0
    stats = readout_stats(Readout(), jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(weights))
    correct = 0.0
    for b in range(B):
        for t in range(T):
            if logits[b, t].argmax() == targets[b, t]:
                correct += weights[b, t]
    assert correct >= 2 and float(stats["correct"]) == correct
    assert float(stats["weight"]) == weights.sum()
    nll, weight = readout_nll(Readout(), jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(weights))
    assert float(stats["nll"]) == float(nll) and float(weight) == weights.sum()
    assert float(nll) == pytest.approx(numpy_nll_BT(logits, targets, weights).sum(), rel=1e-5)


def test_gradients_do_not_flow_through_masked_positions():
    logits, targets, weights = batch(5)
    grad = jax.grad(lambda x: token_loss(x, jnp.asarray(np.where(weights > 0, targets, -100)), jnp.asarray(weights)))(
        jnp.asarray(logits)
    )
    assert np.all(np.isfinite(np.asarray(grad)))
    assert np.all(np.asarray(grad)[weights == 0] == 0.0)


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [4, 3])  # 10 positions: chunks that divide them, and a padded last chunk
def test_chunked_readout_gives_the_full_loss_gradients_and_counts(chunk):
    from conftest import small_model_config
    from flax import nnx

    from fbt_jax.feedback import kpass_loss
    from fbt_jax.model import build_model

    length, vocab = 10, 40
    full = build_model(small_model_config(vocab_size=vocab), seed=0)
    chunked = build_model(small_model_config(vocab_size=vocab, loss_chunk_size=chunk), seed=0)
    tokens = jax.random.randint(jax.random.PRNGKey(0), (3, length), 0, vocab)
    weights = (jax.random.uniform(jax.random.PRNGKey(1), (3, length)) > 0.3).astype(jnp.float32)
    targets = jnp.where(weights > 0, jnp.roll(tokens, -1, 1), -100)
    examples = {"inputs": tokens, "targets": targets, "weights": weights}

    def loss(model):  # two passes, prefix mix-in per example
        return kpass_loss(model, examples, jnp.array([1, 3, 5]), 2)[0]

    (loss_full, grads_full), (loss_chunked, grads_chunked) = [nnx.value_and_grad(loss)(m) for m in (full, chunked)]
    np.testing.assert_allclose(loss_chunked, loss_full, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(nnx.state(grads_full)), jax.tree.leaves(nnx.state(grads_chunked)), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)
    h = jax.random.normal(jax.random.PRNGKey(2), (3, length, 32))
    stats_full, stats_chunked = readout_stats(full, h, targets, weights), readout_stats(chunked, h, targets, weights)
    assert float(stats_chunked["correct"]) == float(stats_full["correct"])
    assert float(stats_chunked["weight"]) == float(stats_full["weight"])
    np.testing.assert_allclose(stats_chunked["nll"], stats_full["nll"], rtol=1e-6)


@pytest.mark.parametrize(
    "compute_dtype, scale_logits, rtol", [("float32", True, 1e-5), ("float32", False, 1e-5), ("bfloat16", True, 2e-2)]
)
def test_the_fused_readout_loss_and_its_hand_written_gradients_equal_autodiff_of_the_logits(
    compute_dtype, scale_logits, rtol
):
    """`readout_nll` (one custom-VJP function) against `token_nll(model.logits(h))` differentiated by
    JAX: the loss and the gradients for the states, every parameter and the weights."""
    from conftest import small_model_config
    from flax import nnx

    from fbt_jax.model import build_model

    length, vocab = 6, 40
    model = build_model(
        small_model_config(vocab_size=vocab, compute_dtype=compute_dtype, scale_logits=scale_logits), seed=0
    )
    h = jax.random.normal(jax.random.PRNGKey(2), (3, length, 32)).astype(compute_dtype)
    weights = (jax.random.uniform(jax.random.PRNGKey(1), (3, length)) > 0.3).astype(jnp.float32).at[0, 0].set(2.0)
    targets = jnp.where(weights > 0, jax.random.randint(jax.random.PRNGKey(0), (3, length), 0, vocab), -100)

    def fused(model, h, weights):
        return readout_nll(model, h, targets, weights)[0]

    def reference(model, h, weights):
        return token_nll(model.logits(h), targets, weights)[0]

    results = [nnx.value_and_grad(f, argnums=(0, 1, 2))(model, h, weights) for f in (fused, reference)]
    (loss_fused, grads_fused), (loss_reference, grads_reference) = results
    assert loss_fused.dtype == jnp.float32
    np.testing.assert_allclose(loss_fused, loss_reference, rtol=rtol)
    for name, a, b in zip(("params", "h", "weights"), grads_fused, grads_reference, strict=True):
        for x, y in zip(
            jax.tree.leaves(nnx.state(a) if name == "params" else a),
            jax.tree.leaves(nnx.state(b) if name == "params" else b),
            strict=True,
        ):
            assert x.dtype == y.dtype, name
            scale = float(jnp.max(jnp.abs(y.astype(jnp.float32)))) or 1.0
            np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), atol=rtol * scale)
    assert float(jnp.abs(grads_fused[2][weights == 0]).max()) == 0.0  # masked positions add nothing
