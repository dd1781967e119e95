"""The K-pass objective against the sequential recurrence (docs/method.md §4, §5), causality, gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import small_model_config
from flax import nnx

from fbt_jax.feedback import (
    PassOptions,
    draw_fuse_from,
    feedback_inputs,
    kpass_forward,
    kpass_loss,
    sequential_feedback,
)
from fbt_jax.losses import token_loss
from fbt_jax.model import build_model

T = 10


def _tokens(batch=2, length=T, seed=1, vocab=16):
    return jax.random.randint(jax.random.PRNGKey(seed), (batch, length), 0, vocab)


def _max_diff_per_position(a_BTD, b_BTD):
    return np.asarray(jnp.max(jnp.abs(a_BTD - b_BTD), axis=(0, 2)))


@pytest.mark.parametrize("fuse_from", [1, 3, 6])
def test_enough_passes_reproduce_the_sequential_recurrence(small_model, fuse_from):
    tokens = _tokens()
    p_B = jnp.full((2,), fuse_from)
    reference = sequential_feedback(small_model, tokens, p_B)
    enough = T - fuse_from + 1
    for num_passes in (enough, enough + 2):  # more passes change nothing
        states = kpass_forward(small_model, tokens, p_B, num_passes)
        assert _max_diff_per_position(states[-1], reference).max() <= 1e-4


@pytest.mark.parametrize("fuse_from", [1, 4])
def test_fewer_passes_are_exact_only_before_p_plus_k_minus_1(small_model, fuse_from):
    tokens = _tokens()
    p_B = jnp.full((2,), fuse_from)
    reference = sequential_feedback(small_model, tokens, p_B)
    for num_passes in (1, 2, 3):
        diff = _max_diff_per_position(kpass_forward(small_model, tokens, p_B, num_passes)[-1], reference)
        exact_until = fuse_from + num_passes - 1
        assert diff[:exact_until].max() <= 1e-4, (num_passes, diff)
        assert diff[exact_until:].min() > 1e-2, (num_passes, diff)  # the rest really differs


def test_every_pass_k_is_exact_before_p_plus_k_minus_1(small_model):
    tokens, p_B = _tokens(), jnp.array([2, 2])
    reference = sequential_feedback(small_model, tokens, p_B)
    for k, h in enumerate(kpass_forward(small_model, tokens, p_B, 5), start=1):
        assert _max_diff_per_position(h, reference)[: 2 + k - 1].max() <= 1e-4


def test_per_example_fuse_from_in_one_batch(small_model):
    tokens = _tokens(batch=3)
    p_B = jnp.array([1, 4, 8])
    reference = sequential_feedback(small_model, tokens, p_B)
    states = kpass_forward(small_model, tokens, p_B, T)
    assert float(jnp.max(jnp.abs(states[-1] - reference))) <= 1e-4
    # Rows are independent: row 1 alone gives the same states.
    alone = sequential_feedback(small_model, tokens[1:2], p_B[1:2])
    assert float(jnp.max(jnp.abs(alone[0] - reference[1]))) <= 1e-5


def test_additive_fusion_ablation_is_exact_too():
    model = build_model(small_model_config(fusion="add"), seed=3)
    tokens, p_B = _tokens(), jnp.array([2, 5])
    reference = sequential_feedback(model, tokens, p_B)
    assert float(jnp.max(jnp.abs(kpass_forward(model, tokens, p_B, T - 1)[-1] - reference))) <= 1e-4


def test_exactness_in_float64():
    with jax.enable_x64(True):
        model = build_model(small_model_config(param_dtype="float64", compute_dtype="float64"), seed=2)
        tokens = _tokens()
        for fuse_from in (1, 5):
            p_B = jnp.full((2,), fuse_from)
            reference = sequential_feedback(model, tokens, p_B)
            states = kpass_forward(model, tokens, p_B, T - fuse_from + 1)
            assert states[-1].dtype == jnp.float64
            assert float(jnp.max(jnp.abs(states[-1] - reference))) <= 1e-9


@pytest.mark.parametrize("num_passes", [1, 2, 3])
def test_logits_are_causal_for_every_pass_count(small_model, num_passes):
    tokens = _tokens()
    p_B = jnp.array([1, 3])
    t = 4
    changed = tokens.at[:, t + 1 :].set((tokens[:, t + 1 :] + 7) % 16)
    logits = small_model.logits(kpass_forward(small_model, tokens, p_B, num_passes)[-1])
    logits_changed = small_model.logits(kpass_forward(small_model, changed, p_B, num_passes)[-1])
    assert float(jnp.max(jnp.abs(logits[:, : t + 1] - logits_changed[:, : t + 1]))) == 0.0
    assert float(jnp.max(jnp.abs(logits[:, t + 1 :] - logits_changed[:, t + 1 :]))) > 1e-3


def _batch(tokens):
    return {"inputs": tokens, "targets": jnp.roll(tokens, -1, axis=1), "weights": jnp.ones(tokens.shape)}


def _grads(model, batch, p_B, num_passes, options=PassOptions(), which=None):
    graphdef, params = nnx.split(model, nnx.Param)

    def loss_fn(params):
        loss, metrics = kpass_loss(nnx.merge(graphdef, params), batch, p_B, num_passes, options)
        return loss if which is None else metrics[which]

    return jax.grad(loss_fn)(params)


def test_fusion_gets_gradient_only_with_feedback_passes(small_model):
    batch, p_B = _batch(_tokens()), jnp.array([1, 3])
    for num_passes in (1, 2, 3):
        grads = _grads(small_model, batch, p_B, num_passes)
        norms = [float(jnp.linalg.norm(g[...])) for g in jax.tree.leaves(grads["fusion"])]
        assert len(norms) == 2  # W_U and W_G
        if num_passes == 1:
            assert norms == [0.0, 0.0]
        else:
            assert min(norms) > 1e-6
        assert float(jnp.linalg.norm(grads["blocks"][0]["mlp"]["up_DF"][...])) > 0


def test_stop_gradient_cuts_later_losses_from_earlier_passes(small_model):
    tokens, p_B = _tokens(), jnp.array([1, 3])
    batch = _batch(tokens)
    graphdef, params = nnx.split(small_model, nnx.Param)
    h1 = kpass_forward(small_model, tokens, p_B, 1)[0]

    def pass2_loss_from_constant_h1(params):
        model = nnx.merge(graphdef, params)
        e = model.embed(tokens)
        u = feedback_inputs(model, e, h1, p_B, jnp.broadcast_to(jnp.arange(T), tokens.shape))
        return token_loss(model.logits(model.stack(u)), batch["targets"], batch["weights"])

    reference = jax.grad(pass2_loss_from_constant_h1)(params)
    cut = _grads(small_model, batch, p_B, 2, PassOptions(stop_gradient=True), which="loss_pass_2")
    through = _grads(small_model, batch, p_B, 2, PassOptions(stop_gradient=False), which="loss_pass_2")
    diff_cut = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(cut), jax.tree.leaves(reference)))
    diff_through = max(
        float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(through), jax.tree.leaves(reference))
    )
    assert diff_cut <= 1e-6
    assert diff_through > 1e-4  # without the switch, pass 2's loss does train pass 1's states


def test_loss_is_the_weighted_mean_of_pass_losses(small_model):
    batch, p_B = _batch(_tokens()), jnp.array([1, 3])
    loss, metrics = kpass_loss(small_model, batch, p_B, 3)
    per_pass = jnp.array([metrics[f"loss_pass_{k}"] for k in (1, 2, 3)])
    assert float(jnp.abs(loss - per_pass.mean())) <= 1e-6
    weighted, _ = kpass_loss(small_model, batch, p_B, 3, PassOptions(loss_weights=(1.0, 0.0, 3.0, 5.0)))
    assert float(jnp.abs(weighted - (per_pass[0] + 3 * per_pass[2]) / 4)) <= 1e-6


def test_masked_targets_do_not_count(small_model):
    tokens, p_B = _tokens(), jnp.array([1, 1])
    batch = _batch(tokens)
    masked = {**batch, "weights": batch["weights"].at[:, 5:].set(0.0), "targets": batch["targets"].at[:, 5:].set(0)}
    logits = small_model.logits(kpass_forward(small_model, tokens, p_B, 2)[-1])
    expected = token_loss(logits[:, :5], batch["targets"][:, :5], jnp.ones((2, 5)))
    _, metrics = kpass_loss(small_model, masked, p_B, 2)
    assert float(jnp.abs(metrics["loss_pass_2"] - expected)) <= 1e-6


@pytest.mark.parametrize("filler", [-100, 16])  # PyTorch's ignore index, and V (out of range)
def test_masked_targets_may_hold_out_of_range_fillers(small_model, filler):
    tokens, p_B = _tokens(), jnp.array([1, 1])
    batch = _batch(tokens)
    clean = {**batch, "weights": batch["weights"].at[:, 5:].set(0.0)}
    filled = {**clean, "targets": batch["targets"].at[:, 5:].set(filler)}
    graphdef, params = nnx.split(small_model, nnx.Param)

    def loss_fn(params, batch):
        return kpass_loss(nnx.merge(graphdef, params), batch, p_B, 2)[0]

    (loss_a, grads_a), (loss_b, grads_b) = (jax.value_and_grad(loss_fn)(params, b) for b in (clean, filled))
    assert np.isfinite(float(loss_b)) and float(loss_a) == float(loss_b)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b)))


def test_sequential_reference_respects_segments(small_model):
    a, b = _tokens(batch=1, length=4, seed=3), _tokens(batch=1, length=6, seed=4)
    packed = jnp.concatenate([a, b], axis=1)
    positions = jnp.concatenate([jnp.arange(4), jnp.arange(6)])[None]
    segments = jnp.array([[1] * 4 + [2] * 6])
    p_B = jnp.array([1])
    h = sequential_feedback(small_model, packed, p_B, positions, segments)
    assert float(jnp.max(jnp.abs(h[:, :4] - sequential_feedback(small_model, a, p_B)))) <= 1e-5
    assert float(jnp.max(jnp.abs(h[:, 4:] - sequential_feedback(small_model, b, p_B)))) <= 1e-5
    k_pass = kpass_forward(small_model, packed, p_B, 6, positions_BT=positions, segment_ids_BT=segments)[-1]
    assert float(jnp.max(jnp.abs(k_pass - h))) <= 1e-4


def test_misuse_is_refused(small_model):
    tokens, p_B = _tokens(), jnp.array([1, 1])
    with pytest.raises(ValueError, match="at least one pass"):
        kpass_forward(small_model, tokens, p_B, 0)
    with pytest.raises(ValueError, match="needs a noise_rng"):
        kpass_forward(small_model, tokens, p_B, 2, PassOptions(noise_std=0.1))
    with pytest.raises(ValueError, match="fewer than K=3"):
        kpass_loss(small_model, _batch(tokens), p_B, 3, PassOptions(loss_weights=(1.0, 1.0)))


def test_noise_jitter_touches_only_the_carried_state(small_model):
    tokens, p_B = _tokens(), jnp.array([1, 1])
    noisy = PassOptions(noise_std=0.5)
    clean = kpass_forward(small_model, tokens, p_B, 2)
    a = kpass_forward(small_model, tokens, p_B, 2, noisy, jax.random.PRNGKey(0))
    b = kpass_forward(small_model, tokens, p_B, 2, noisy, jax.random.PRNGKey(0))
    c = kpass_forward(small_model, tokens, p_B, 2, noisy, jax.random.PRNGKey(1))
    assert float(jnp.max(jnp.abs(a[0] - clean[0]))) == 0.0  # pass 1 has no carried state
    assert float(jnp.max(jnp.abs(a[1] - b[1]))) == 0.0  # same key, same noise
    assert float(jnp.max(jnp.abs(a[1] - clean[1]))) > 1e-3
    assert float(jnp.max(jnp.abs(a[1] - c[1]))) > 1e-3


def test_prefix_mixin_draws():
    rng = jax.random.PRNGKey(0)
    assert np.all(np.asarray(draw_fuse_from(rng, 512, 0.0, 3, 9)) == 1)
    always = np.asarray(draw_fuse_from(rng, 4096, 1.0, 3, 9))
    assert always.min() == 3 and always.max() == 9 and len(np.unique(always)) == 7
    half = np.asarray(draw_fuse_from(rng, 4096, 0.5, 3, 9))
    assert 0.45 < np.mean(half >= 3) < 0.55


def test_packed_conversations_fuse_each_reply_and_are_exact_where_the_recurrence_is(small_model):
    """Chat rows (docs/post-training.md): three conversations packed in one row, each read plainly up to
    its reply and fused from the reply's first token (a per-token mask). The sequential recurrence with
    the mask equals each conversation alone fused from its prompt length (soft decoding of that prompt),
    and pass k equals it exactly at each reply's first k − 1 tokens and before, and nowhere after."""
    prompts, replies = (3, 2, 4), (4, 5, 3)
    lengths = [p + r for p, r in zip(prompts, replies)]
    tokens = _tokens(batch=1, length=sum(lengths) + 2, seed=7)  # two padding tokens at the end
    segments = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)] + [np.zeros(2, int)])
    positions = np.concatenate([np.arange(n) for n in lengths] + [np.arange(2)])
    fuse = np.concatenate([np.r_[np.zeros(p, int), np.ones(r, int)] for p, r in zip(prompts, replies)] + [[0, 0]])
    segments, positions, fuse = (jnp.asarray(x)[None] for x in (segments, positions, fuse))
    reference = sequential_feedback(small_model, tokens, fuse, positions, segments)
    starts = np.cumsum([0, *lengths])
    for i, (prompt, start) in enumerate(zip(prompts, starts)):
        alone = sequential_feedback(small_model, tokens[:, start : start + lengths[i]], jnp.array([prompt]))
        assert float(jnp.max(jnp.abs(reference[:, start : start + lengths[i]] - alone))) <= 1e-4
    for k in (1, 2, 3):
        diff = _max_diff_per_position(
            kpass_forward(small_model, tokens, fuse, k, positions_BT=positions, segment_ids_BT=segments)[-1], reference
        )
        for prompt, start, n in zip(prompts, starts, lengths):
            exact_until = prompt + k - 1
            assert diff[start : start + exact_until].max() <= 1e-4, (k, diff)
            assert diff[start + exact_until : start + n].min() > 1e-3, (k, diff)  # the rest really differs
