"""Decoding with a KV cache: each mode against an independent reference, sampling, bad requests."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from fbt_jax import decode
from fbt_jax.errors import ConfigError
from fbt_jax.feedback import feedback_inputs, kpass_forward, sequential_feedback
from fbt_jax.layers import default_positions

T = 12
LENGTHS = np.array([3, 7, 5])


@pytest.fixture(scope="module")
def model(small_model):
    return small_model


@pytest.fixture(scope="module")
def tokens():
    return jax.random.randint(jax.random.PRNGKey(4), (3, T), 0, 16)


def padded_prompts(tokens):
    width = int(LENGTHS.max())
    mask = np.arange(width)[None, :] < LENGTHS[:, None]
    return jnp.where(mask, tokens[:, :width], 0)  # right-padded with junk-free zeros


def teacher_forced(model, tokens, mode, cache_len=T + 2):
    """States of every position of each row: prefill its prompt, then feed its own next tokens."""
    state = decode.prefill(model, padded_prompts(tokens), jnp.asarray(LENGTHS), cache_len, mode)
    states = {b: {int(LENGTHS[b]) - 1: state.h_last_BD[b]} for b in range(3)}
    logits = {b: {int(LENGTHS[b]) - 1: state.logits_BV[b]} for b in range(3)}
    step = jax.jit(decode.step, static_argnames="mode")
    for i in range(T - int(LENGTHS.min())):
        positions = np.minimum(LENGTHS + i, T - 1)
        state = step(model, state, tokens[np.arange(3), positions], mode=mode)
        for b in range(3):
            if LENGTHS[b] + i < T:
                states[b][int(LENGTHS[b]) + i] = state.h_last_BD[b]
                logits[b][int(LENGTHS[b]) + i] = state.logits_BV[b]
    return states, logits


def compare(model, states, logits, reference_h, first=None):
    worst = 0.0
    for b in range(3):
        for t, h in states[b].items():
            if first is not None and t < first[b]:
                continue
            worst = max(worst, float(jnp.max(jnp.abs(h - reference_h[b, t]))))
            ref_logits = model.logits(reference_h[b, t][None, None])[0, 0]
            worst = max(worst, float(jnp.max(jnp.abs(logits[b][t] - ref_logits))))
    return worst


def test_soft_decoding_reproduces_the_recurrence_and_enough_passes(model, tokens):
    states, logits = teacher_forced(model, tokens, "soft")
    fuse_from = jnp.asarray(LENGTHS)  # fusion starts at the first generated position
    assert compare(model, states, logits, sequential_feedback(model, tokens, fuse_from)) <= 1e-4
    enough = T - int(LENGTHS.min()) + 1
    assert compare(model, states, logits, kpass_forward(model, tokens, fuse_from, enough)[-1]) <= 1e-4


def test_standard_decoding_reproduces_the_one_pass_forward(model, tokens):
    states, logits = teacher_forced(model, tokens, "standard")
    assert compare(model, states, logits, kpass_forward(model, tokens, jnp.ones(3, jnp.int32), 1)[0]) <= 1e-4


@pytest.mark.slow
def test_fused_decoding_is_a_two_pass_prefill_then_soft_steps(model, tokens):
    states, logits = teacher_forced(model, tokens, "fused")
    # Reference without a cache: for each row, the prompt's pass-2 inputs (fully fused from
    # position 1), then generated positions fused with the previous state, one at a time.
    # The inputs are kept at full length T (zeros not yet written): attention is causal, so the
    # positions after t never reach t, and one compiled stack serves every step.
    stack = nnx.jit(lambda m, u: m.stack(u))
    reference = jnp.zeros((3, T, model.cfg.embed_dim))
    for b in range(3):
        n = int(LENGTHS[b])
        e = model.embed(tokens[b : b + 1])
        positions = default_positions((1, n))
        prompt = feedback_inputs(model, e[:, :n], model.stack(e[:, :n], positions), jnp.ones(1, jnp.int32), positions)
        u = jnp.zeros((1, T, model.cfg.embed_dim)).at[:, :n].set(prompt)
        for t in range(n, T):
            h = stack(model, u)
            u = u.at[:, t].set(model.fusion(e[:, t : t + 1], h[:, t - 1 : t])[:, 0])
        reference = reference.at[b].set(stack(model, u)[0])
    assert compare(model, states, logits, reference) <= 1e-4


@pytest.mark.slow
def test_generation_is_deterministic_greedy_and_reproducible_sampling(model, tokens):
    prompts = padded_prompts(tokens)
    run = lambda **kw: decode.generate(model, prompts, jnp.asarray(LENGTHS), 6, "soft", **kw)  # noqa: E731
    greedy_a, count = run()
    greedy_b, _ = run()
    assert np.array_equal(greedy_a, greedy_b) and list(count) == [6, 6, 6]
    sampled_a, _ = run(temperature=1.0, top_k=5, top_p=0.9, seed=3)
    sampled_b, _ = run(temperature=1.0, top_k=5, top_p=0.9, seed=3)
    sampled_c, _ = run(temperature=1.0, seed=4)
    assert np.array_equal(sampled_a, sampled_b) and not np.array_equal(sampled_a, sampled_c)
    # Greedy generation is what teacher forcing with its own argmax gives.
    state = decode.prefill(model, prompts, jnp.asarray(LENGTHS), int(LENGTHS.max()) + 6, "soft")
    for i in range(6):
        token = jnp.argmax(state.logits_BV, -1)
        assert np.array_equal(token, greedy_a[:, i])
        state = decode.step(model, state, token, "soft")


def test_stop_tokens_end_a_row(model, tokens):
    prompts = padded_prompts(tokens)
    free, _ = decode.generate(model, prompts, jnp.asarray(LENGTHS), 6, "standard")
    stop = int(free[0, 1])
    stopped, count = decode.generate(model, prompts, jnp.asarray(LENGTHS), 6, "standard", stop_tokens=(stop,))
    first = int(np.flatnonzero(np.asarray(free[0]) == stop)[0])
    assert int(count[0]) == first + 1 and np.all(np.asarray(stopped[0, first + 1 :]) == 0)


def test_sampling_filters():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    draws = np.array([int(decode.sample(logits, jax.random.PRNGKey(i), 1.0, top_k=2)[0]) for i in range(200)])
    assert set(draws) <= {0, 1}
    draws = np.array([int(decode.sample(logits, jax.random.PRNGKey(i), 1.0, top_p=0.7)[0]) for i in range(200)])
    assert set(draws) == {0, 1}  # 0.5 < 0.7 needs the second token, not the third
    assert int(decode.sample(logits, jax.random.PRNGKey(0))[0]) == 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"mode": "hard"}, "decoding mode 'hard' is unknown"),
        ({"max_new_tokens": 6, "cache_len": 8}, "does not fit the cache"),
        ({"bad_token": 99}, "token id 99 is outside the vocabulary [0, 16)"),
    ],
)
def test_bad_requests_give_one_clear_line(model, tokens, kwargs, message):
    prompts = padded_prompts(tokens)
    if "bad_token" in kwargs:
        prompts = prompts.at[1, 2].set(kwargs.pop("bad_token"))
    mode = kwargs.pop("mode", "soft")
    with pytest.raises(ConfigError) as err:
        decode.generate(model, prompts, jnp.asarray(LENGTHS), kwargs.pop("max_new_tokens", 4), mode, **kwargs)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.slow
def test_soft_and_standard_decoding_are_exact_for_imported_model_features(tokens):
    """Sliding window, q/k/v biases, an untied readout, an explicit head dim and Llama 3 rotary
    scaling (what imported models bring) through the KV cache: the same references hold."""
    from conftest import small_model_config

    from fbt_jax.model import build_model

    cfg = small_model_config(
        head_dim=12, qkv_bias=True, sliding_window=4, tie_embeddings=False, scale_logits=False,
        rope_scaling="llama3", rope_scaling_factor=8.0, rope_original_max_positions=8,
    )  # fmt: skip
    model = build_model(cfg, seed=1)
    for i, block in enumerate(model.blocks):  # biases start at zero: give them values that count
        for name in ("q_bias_NH", "k_bias_GH", "v_bias_GH"):
            bias = getattr(block.attn, name)
            bias[...] = jax.random.normal(jax.random.PRNGKey(10 * i + len(name)), bias[...].shape)
    states, logits = teacher_forced(model, tokens, "soft")
    fuse_from = jnp.asarray(LENGTHS)
    assert compare(model, states, logits, sequential_feedback(model, tokens, fuse_from)) <= 1e-4
    states, logits = teacher_forced(model, tokens, "standard")
    assert compare(model, states, logits, kpass_forward(model, tokens, jnp.ones(3, jnp.int32), 1)[0]) <= 1e-4
