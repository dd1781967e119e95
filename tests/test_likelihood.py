"""Scoring continuations in each decoding mode (`evals/likelihood.py`) against independent
references, in fp32: standard against the plain forward, soft against the latent-feedback
recurrence run without a cache (`feedback.sequential_feedback`), fused against the fused passes
over the context followed by that recurrence, and every mode against the decoding path
(`decode.prefill` / `decode.step`) fed the same tokens one request at a time. A batch gives what
its requests give alone, on one device or eight (to fp32 rounding: bitwise equality would need
every device to multiply the same shapes)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import small_model_config
from flax import nnx

from fbt_jax import decode
from fbt_jax.evals.generation import Compiled
from fbt_jax.evals.likelihood import Scorer
from fbt_jax.feedback import kpass_forward, last_pass_inputs, sequential_feedback
from fbt_jax.layers import default_positions
from fbt_jax.model import build_model

PASSES = 3  # of the fused prefill: two feedback passes over the context


@pytest.fixture(scope="module")
def model():
    return build_model(small_model_config(vocab_size=40), seed=3)


LENGTHS = [(3, 2), (35, 9), (1, 9), (35, 1), (20, 5)]  # (context, continuation): two buckets of each


def requests(seed: int = 0, count: int = 5) -> list[tuple[list[int], list[int]]]:
    """Contexts of 1–35 tokens and continuations of 1–9, random tokens: two length buckets of each in
    one call (few distinct lengths: each is compiled once by the references below)."""
    rng = np.random.default_rng(seed)
    lengths = [LENGTHS[i % len(LENGTHS)] for i in range(count)]
    return [(rng.integers(0, 40, c).tolist(), rng.integers(0, 40, x).tolist()) for c, x in lengths]


def scores_of(model, h_1TD, whole: list[int], context_len: int) -> np.ndarray:
    """Per-token log-probabilities of the continuation from top states over whole[:-1]."""
    logp = jax.nn.log_softmax(model.logits(h_1TD).astype(jnp.float32), axis=-1)[0]
    targets = np.array(whole[1:])
    return np.asarray(logp[np.arange(len(targets)), targets])[context_len - 1 :]


def reference(model, context: list[int], continuation: list[int], mode: str) -> np.ndarray:
    """The mode's definition, computed without the cache or the batch."""
    whole = [*context, *continuation]
    h = _reference_states(model, jnp.array([whole[:-1]]), len(context), mode)
    return scores_of(model, h, whole, len(context))


@functools.partial(nnx.jit, static_argnums=(2, 3))
def _reference_states(model, tokens, context_len: int, mode: str):
    """Top states over the request (whole[:-1]) by the mode's definition (one program per length:
    op-by-op, each new length would compile every op anew)."""
    context = tokens[:, :context_len]
    if mode == "standard":
        (h,) = kpass_forward(model, tokens, jnp.ones((1,), jnp.int32), 1)
    elif mode == "soft":  # plain up to the context's end, fused from the first continuation token on
        h = sequential_feedback(model, tokens, jnp.array([context_len]))
    else:  # the context's inputs from the fused passes, then the recurrence one position at a time
        e = model.embed(tokens)
        _, u_ctx = last_pass_inputs(model, model.embed(context), jnp.ones((1,), jnp.int32), PASSES,
                                    default_positions(context.shape))  # fmt: skip
        u = jnp.concatenate([u_ctx, e[:, context_len:].astype(u_ctx.dtype)], axis=1)
        positions = default_positions(tokens.shape)
        for t in range(context_len, tokens.shape[1]):
            h = model.stack(u, positions)
            u = u.at[:, t].set(model.fusion(e[:, t : t + 1], h[:, t - 1 : t])[:, 0])
        h = model.stack(u, positions)
    return h


def decoded(model, context: list[int], continuation: list[int], mode: str) -> np.ndarray:
    """The decoding path, teacher-forced: prefill the context, then step each continuation token
    (each call its own compiled program: op by op, every new length would compile every op)."""
    state = _prefill(model, jnp.array([context]), jnp.array([len(context)]), len(context) + len(continuation), mode)
    out = []
    for token in continuation:
        out.append(float(jax.nn.log_softmax(state.logits_BV[0].astype(jnp.float32))[token]))
        state = _step(model, state, jnp.array([token]), mode)
    return np.array(out)


_prefill = nnx.jit(lambda model, prompts, lengths, cache_len, mode: decode.prefill(
    model, prompts, lengths, cache_len, mode, PASSES), static_argnums=(3, 4))  # fmt: skip
_step = nnx.jit(decode.step, static_argnums=(3,))


@pytest.mark.slow
@pytest.mark.parametrize("mode", decode.MODES)
def test_each_mode_scores_what_its_definition_and_the_decoding_path_give(model, mode):
    asked = requests()
    scored = Scorer(Compiled(model), batch_size=4, prefill_passes=PASSES).score(asked, mode)
    for (context, continuation), got in zip(asked, scored):
        assert got.logprobs.shape == (len(continuation),)
        # The decoding path runs the same cached arithmetic on unpadded shapes: equal to 1e-5 nats per
        # token, and the sum to 1e-5 of its size (fp32 reductions over other lengths round differently).
        along_decoding = decoded(model, context, continuation, mode)
        np.testing.assert_allclose(got.logprobs, along_decoding, atol=1e-5)
        assert got.total == pytest.approx(along_decoding.sum(dtype=np.float64), rel=1e-5, abs=1e-5)
        # The cache-free definition sums in another order, and the recurrence carries each rounding
        # forward: equal to a few parts in a million.
        np.testing.assert_allclose(got.logprobs, reference(model, context, continuation, mode), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["standard", "soft"])
def test_a_batch_gives_what_its_requests_give_alone_and_eight_devices_what_one_gives(model, mode):
    asked = requests(seed=1, count=9)
    together = Scorer(Compiled(model), batch_size=8, prefill_passes=PASSES).score(asked, mode)
    on_one = Scorer(Compiled(model, jax.devices()[:1]), batch_size=8, prefill_passes=PASSES).score(asked, mode)
    alone = Scorer(Compiled(model, jax.devices()[:1]), batch_size=1, prefill_passes=PASSES)
    for request, got, same_batch in zip(asked, together, on_one):
        # Re-sharded: the same numbers but for fp32 rounding (each device multiplies another number of
        # rows), which the recurrence of soft mode carries forward: to 1e-5.
        np.testing.assert_allclose(got.logprobs, same_batch.logprobs, rtol=1e-5, atol=1e-5)
        (one,) = alone.score([request], mode)
        np.testing.assert_allclose(got.logprobs, one.logprobs, rtol=1e-5, atol=1e-5)  # padded otherwise
        assert np.array_equal(got.greedy, one.greedy)


def test_greedy_flags_say_whether_each_token_is_the_argmax(model):
    context = [3, 1, 4]
    state = decode.prefill(model, jnp.array([context]), jnp.array([3]), 8, "soft")
    best = int(jnp.argmax(state.logits_BV[0]))
    scorer = Scorer(Compiled(model, jax.devices()[:1]), batch_size=2)
    chosen, other = scorer.score([(context, [best]), (context, [(best + 1) % 40])], "soft")
    assert chosen.is_greedy and not other.is_greedy
