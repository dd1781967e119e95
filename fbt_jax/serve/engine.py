"""The serving engine's device programs: a fixed set of decode slots sharing one KV cache, filled
one request at a time between decode steps (continuous batching), in the three modes of
docs/method.md §8.

- `insert`: prefill one prompt (plain, or the fused passes) into a fresh cache row and write it
  into a slot; optionally score the prompt's tokens (the `echo` + `logprobs` of the API).
- `step`: every slot samples its next token from its own logits (its own temperature, top-p and
  seed), then the tokens run through the model as one batch: a slot in soft or fused mode feeds
  its previous top state back (`fusion(e_t, h_{t-1})`), a standard slot its embedding alone.

A slot's mode and sampling settings are data, not program structure: one step program serves
every mix of requests, and a request's tokens do not depend on the other slots. The cache is per
slot and contiguous (docs/serving.md says why, with the measurement).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct

from fbt_jax.feedback import last_pass_inputs
from fbt_jax.layers import KVCache, default_positions

TOP_LOGPROBS = 5  # the most alternatives a request may ask for (OpenAI's completions allow 5)


@struct.dataclass
class Slots:
    cache_L: KVCache  # (k_LSCGH, v_LSCGH): the slots' keys and values, layers stacked
    lengths_S: jax.Array  # tokens in each slot's cache = position of its next token
    h_last_SD: jax.Array  # top state of each slot's last position (fed back in soft and fused modes)
    logits_SV: jax.Array  # logits at each slot's last position (predicting its next token)
    feedback_S: jax.Array  # bool: the slot decodes with latent feedback (soft, fused)


@struct.dataclass
class Sampling:
    """Per-slot sampling settings, as arrays: one compiled step serves any mix of them."""

    temperature_S: jax.Array  # float32; 0 = greedy
    top_p_S: jax.Array  # float32 in (0, 1]
    seed_S: jax.Array  # int32: the request's seed
    choice_S: jax.Array  # int32: which of the request's n choices the slot decodes
    index_S: jax.Array  # int32: how many tokens the slot's request has generated


@struct.dataclass
class Chosen:
    """What a step sampled, per slot: the token, its log-probability and the most likely tokens."""

    token_S: jax.Array
    logprob_S: jax.Array
    top_ids_SK: jax.Array
    top_logprobs_SK: jax.Array


def empty_slots(model: Any, num_slots: int, context_len: int) -> Slots:
    cfg = model.cfg
    shape = (cfg.num_layers, num_slots, context_len, cfg.num_kv_heads, cfg.head_size)
    cache_L = (jnp.zeros(shape, model.compute_dtype), jnp.zeros(shape, model.compute_dtype))
    return Slots(
        cache_L,
        jnp.zeros((num_slots,), jnp.int32),
        jnp.zeros((num_slots, cfg.embed_dim), model.compute_dtype),
        jnp.zeros((num_slots, cfg.vocab_size), jnp.float32),
        jnp.zeros((num_slots,), bool),
    )


def prompt_states(model: Any, prompt_1P: jax.Array, fused: bool, prefill_passes: int, context_len: int):
    """(top states (1, P, D), a (1, context_len) cache holding the prompt): the plain prefill, or
    the fused one (prefill_passes passes, fully fused from position 1), as `decode.prefill` runs it."""
    cfg = model.cfg
    shape = (cfg.num_layers, 1, context_len, cfg.num_kv_heads, cfg.head_size)
    cache_L = (jnp.zeros(shape, model.compute_dtype), jnp.zeros(shape, model.compute_dtype))
    num_passes = prefill_passes if fused else 1
    positions_1P = default_positions(prompt_1P.shape)
    _, u_1PD = last_pass_inputs(model, model.embed(prompt_1P), jnp.ones((1,), jnp.int32), num_passes, positions_1P)
    return model.stack_prefill(u_1PD, cache_L)


def _log_softmax(logits: jax.Array) -> jax.Array:
    return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(3,))
def insert(graphdef: Any, static: tuple, params: Any, slots: Slots, prompt_1P, length, slot, feedback):
    """Prefill one right-padded prompt (its first `length` tokens) into slot `slot`. Static:
    (fused, prefill_passes, score_prompt). Returns the slots and, with score_prompt, each prompt
    token's log-probability after the tokens before it ((P,), the first one 0) and its top
    alternatives; else zeros."""
    fused, prefill_passes, score_prompt = static
    model = nnx.merge(graphdef, params)
    P, context_len = prompt_1P.shape[1], slots.cache_L[0].shape[2]
    h_1PD, cache_1 = prompt_states(model, prompt_1P, fused, prefill_passes, context_len)
    h_last_1D = jax.lax.dynamic_slice_in_dim(h_1PD[0], length - 1, 1)
    logits_1V = model.logits(h_last_1D[None])[0]

    def put(into: jax.Array, row: jax.Array) -> jax.Array:
        return jax.lax.dynamic_update_slice_in_dim(into, row.astype(into.dtype), slot, axis=0)

    cache_L = tuple(jax.lax.dynamic_update_slice_in_dim(c, r, slot, axis=1) for c, r in zip(slots.cache_L, cache_1))
    slots = Slots(
        cache_L,
        put(slots.lengths_S, length[None]),
        put(slots.h_last_SD, h_last_1D),
        put(slots.logits_SV, logits_1V),
        put(slots.feedback_S, feedback[None]),
    )
    if not score_prompt:
        zeros = jnp.zeros((P,), jnp.float32)
        return slots, (zeros, jnp.zeros((P, TOP_LOGPROBS), jnp.int32), jnp.zeros((P, TOP_LOGPROBS), jnp.float32))
    logp_PV = _log_softmax(model.logits(h_1PD)[0])  # position t predicts token t + 1
    next_P = jnp.concatenate([prompt_1P[0, 1:], jnp.zeros((1,), prompt_1P.dtype)])
    logp_P = jnp.take_along_axis(logp_PV, next_P[:, None], axis=-1)[:, 0]
    top_logp_PK, top_ids_PK = jax.lax.top_k(logp_PV, TOP_LOGPROBS)
    shift = lambda x: jnp.concatenate([jnp.zeros_like(x[:1]), x[:-1]])  # token t's score is position t − 1's
    return slots, (shift(logp_P), shift(top_ids_PK), shift(top_logp_PK))


def choose(logits_SV: jax.Array, sampling: Sampling) -> Chosen:
    """Each slot's next token: the argmax at temperature 0, else a sample at its temperature from its
    nucleus (top-p), with a key of its own (seed, choice, index): what it draws does not depend on
    which slot it is in or what the other slots hold."""
    logp_SV = _log_softmax(logits_SV)
    greedy_S = jnp.argmax(logits_SV, axis=-1).astype(jnp.int32)
    temperature_S1 = jnp.maximum(sampling.temperature_S, 1e-6)[:, None]
    scaled_SV = logits_SV.astype(jnp.float32) / temperature_S1
    sorted_SV = jnp.sort(scaled_SV, axis=-1)[:, ::-1]
    cumulative_SV = jnp.cumsum(jax.nn.softmax(sorted_SV, axis=-1), axis=-1)
    # Keep the smallest prefix whose probability reaches top_p (always at least one token).
    cutoff_index_S = jnp.minimum(jnp.sum(cumulative_SV < sampling.top_p_S[:, None], axis=-1), logits_SV.shape[1] - 1)
    cutoff_S1 = jnp.take_along_axis(sorted_SV, cutoff_index_S[:, None], axis=-1)
    scaled_SV = jnp.where(scaled_SV < cutoff_S1, -jnp.inf, scaled_SV)
    key = lambda seed, choice, index: jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(seed), choice), index)
    keys_S = jax.vmap(key)(sampling.seed_S, sampling.choice_S, sampling.index_S)
    sampled_S = jax.vmap(lambda k, row: jax.random.categorical(k, row))(keys_S, scaled_SV).astype(jnp.int32)
    token_S = jnp.where(sampling.temperature_S > 0, sampled_S, greedy_S)
    top_logp_SK, top_ids_SK = jax.lax.top_k(logp_SV, TOP_LOGPROBS)
    logprob_S = jnp.take_along_axis(logp_SV, token_S[:, None], axis=-1)[:, 0]
    return Chosen(token_S, logprob_S, top_ids_SK.astype(jnp.int32), top_logp_SK)


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(3,))
def steps(graphdef: Any, num_steps: int, params: Any, slots: Slots, sampling: Sampling) -> tuple[Slots, Chosen]:
    """`num_steps` decode steps in one program (its Chosen arrays gain a leading steps axis): one trip
    from the host per `num_steps` tokens. Each step's draws are keyed by the slot's token index, so
    the tokens are those of as many single steps."""
    model = nnx.merge(graphdef, params)

    def one(slots: Slots, i: jax.Array) -> tuple[Slots, Chosen]:
        return advance(model, slots, sampling.replace(index_S=sampling.index_S + i))

    return jax.lax.scan(one, slots, jnp.arange(num_steps))


def advance(model: Any, slots: Slots, sampling: Sampling) -> tuple[Slots, Chosen]:
    """One decode step over every slot: choose each slot's token, then run the tokens (one new
    position per slot). A free slot computes too (its result is never read)."""
    chosen = choose(slots.logits_SV, sampling)
    e_S1D = model.embed(chosen.token_S[:, None])
    fused_S1D = model.fusion(e_S1D, slots.h_last_SD[:, None])
    u_S1D = jnp.where(slots.feedback_S[:, None, None], fused_S1D, e_S1D)
    # A slot at the end of the context writes nowhere new: its request ends with this token.
    write_S = jnp.minimum(slots.lengths_S, slots.cache_L[0].shape[2] - 1)
    h_S1D, cache_L = model.stack_cached(u_S1D, slots.cache_L, write_S)
    logits_SV = model.logits(h_S1D)[:, 0]
    return Slots(cache_L, slots.lengths_S + 1, h_S1D[:, 0], logits_SV, slots.feedback_S), chosen
