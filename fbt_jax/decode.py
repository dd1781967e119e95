"""Decoding with a KV cache in the three modes of docs/method.md §8, on the same weights.

- `standard`: ordinary decoding; each new position's input is its token embedding.
- `soft`: plain prefill of the prompt, then each new position's input is fuse(e_t, h_{t-1}),
  the previous position's top state fed back (latent feedback).
- `fused`: the prompt is prefilled with n passes (pass k fuses pass k−1's states, fully fused from
  position 1; the cache comes from the last pass), then soft decoding.

The cache layout is the ordinary one; the only extra state carried between steps is one D-vector
per sequence (`h_last`). Prompts of different lengths share a batch: they are right-padded and
each row continues from its own length.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct

from fbt_jax.errors import ConfigError
from fbt_jax.feedback import last_pass_inputs
from fbt_jax.layers import KVCache, default_positions

MODES = ("standard", "soft", "fused")


@struct.dataclass
class DecodeState:
    cache_L: KVCache  # (k_LBSGH, v_LBSGH): keys and values, layers stacked
    lengths_B: jax.Array  # tokens in the cache per row = position of the next token
    h_last_BD: jax.Array  # top state of each row's last position (fed back in soft/fused modes)
    logits_BV: jax.Array  # logits at each row's last position (predicting its next token)


def check_request(model: Any, prompts_BP: Any, lengths_B: Any, cache_len: int, mode: str) -> None:
    """One-line errors for bad requests, before anything is compiled."""
    import numpy as np

    if mode not in MODES:
        raise ConfigError(f"decoding mode {mode!r} is unknown; use one of {MODES}")
    prompts, lengths = np.asarray(prompts_BP), np.asarray(lengths_B)
    if prompts.ndim != 2 or lengths.shape != (prompts.shape[0],):
        raise ConfigError("prompts must be (batch, length) token ids with one length per row")
    if lengths.min() < 1:
        raise ConfigError("every prompt needs at least one token")
    if lengths.max() > cache_len or prompts.shape[1] > cache_len:
        raise ConfigError(
            f"a prompt of {int(max(lengths.max(), prompts.shape[1]))} tokens does not fit the cache of {cache_len}; "
            "raise the cache length or shorten the prompt"
        )
    valid = np.arange(prompts.shape[1])[None, :] < lengths[:, None]
    vocab = model.cfg.vocab_size
    bad = prompts[valid][(prompts[valid] < 0) | (prompts[valid] >= vocab)]
    if bad.size:
        raise ConfigError(f"token id {int(bad[0])} is outside the vocabulary [0, {vocab})")


def prefill(
    model: Any, prompts_BP: jax.Array, lengths_B: jax.Array, cache_len: int, mode: str, prefill_passes: int = 2
) -> DecodeState:
    """Run the (right-padded) prompts and fill a cache of `cache_len` positions."""
    cfg = model.cfg
    B, P = prompts_BP.shape
    shape = (cfg.num_layers, B, cache_len, cfg.num_kv_heads, cfg.head_size)
    cache_L = (jnp.zeros(shape, model.compute_dtype), jnp.zeros(shape, model.compute_dtype))
    # Fused mode: the prompt's inputs come from prefill_passes − 1 feedback passes, fully fused
    # from position 1; the last pass runs through the cache.
    num_passes = prefill_passes if mode == "fused" else 1
    fully_fused_B = jnp.ones((B,), jnp.int32)
    _, u_BPD = last_pass_inputs(model, model.embed(prompts_BP), fully_fused_B, num_passes, default_positions((B, P)))
    h_BPD, cache_L = model.stack_prefill(u_BPD, cache_L)
    h_last_BD = jnp.take_along_axis(h_BPD, (lengths_B - 1)[:, None, None], axis=1)[:, 0]
    return DecodeState(cache_L, lengths_B.astype(jnp.int32), h_last_BD, model.logits(h_last_BD[:, None])[:, 0])


def step(model: Any, state: DecodeState, tokens_B: jax.Array, mode: str) -> DecodeState:
    """Append one token per row and run it through the model (one new position per row)."""
    e_B1D = model.embed(tokens_B[:, None])
    u_B1D = e_B1D if mode == "standard" else model.fusion(e_B1D, state.h_last_BD[:, None])
    h_B1D, cache_L = model.stack_cached(u_B1D, state.cache_L, state.lengths_B)
    return DecodeState(cache_L, state.lengths_B + 1, h_B1D[:, 0], model.logits(h_B1D)[:, 0])


def sample(
    logits_BV: jax.Array, rng: jax.Array, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0
) -> jax.Array:
    """Greedy when temperature is 0; else temperature sampling restricted to top-k / nucleus top-p."""
    if temperature == 0.0:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    logits_BV = logits_BV.astype(jnp.float32) / temperature
    if top_k > 0:
        kth_B1 = jax.lax.top_k(logits_BV, top_k)[0][:, -1:]
        logits_BV = jnp.where(logits_BV < kth_B1, -jnp.inf, logits_BV)
    if top_p < 1.0:
        sorted_BV = jnp.sort(logits_BV, axis=-1)[:, ::-1]
        cumulative_BV = jnp.cumsum(jax.nn.softmax(sorted_BV, axis=-1), axis=-1)
        # Keep the smallest prefix whose probability reaches top_p (always at least one token).
        cutoff_index_B = jnp.sum(cumulative_BV < top_p, axis=-1)
        cutoff_B1 = jnp.take_along_axis(sorted_BV, cutoff_index_B[:, None], axis=-1)
        logits_BV = jnp.where(logits_BV < cutoff_B1, -jnp.inf, logits_BV)
    return jax.random.categorical(rng, logits_BV, axis=-1).astype(jnp.int32)


def generate(
    model: Any,
    prompts_BP: jax.Array,
    lengths_B: jax.Array,
    max_new_tokens: int,
    mode: str = "soft",
    *,
    cache_len: int | None = None,
    prefill_passes: int = 2,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    stop_tokens: tuple[int, ...] = (),
    seed: int = 0,
) -> tuple[jax.Array, jax.Array]:
    """Generate up to `max_new_tokens` per row. Returns (tokens (B, max_new_tokens), count per row);
    a row stops after emitting a stop token (which is included), the rest of it is zeros."""
    cache_len = cache_len or prompts_BP.shape[1] + max_new_tokens
    check_request(model, prompts_BP, lengths_B, cache_len - max_new_tokens, mode)  # room left for the prompt
    graphdef, params = nnx.split(model)
    settings = (max_new_tokens, mode, cache_len, prefill_passes, temperature, top_k, top_p, tuple(stop_tokens))
    return _generate(graphdef, settings, params, jnp.asarray(prompts_BP), jnp.asarray(lengths_B), jnp.int32(seed))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _generate(
    graphdef: Any, settings: tuple, params: Any, prompts_BP: jax.Array, lengths_B: jax.Array, seed: jax.Array
):
    """Prefill and the whole sampling loop as one compiled program (one per settings)."""
    max_new_tokens, mode, cache_len, prefill_passes, temperature, top_k, top_p, stop_tokens = settings
    model = nnx.merge(graphdef, params)
    state = prefill(model, prompts_BP, lengths_B, cache_len, mode, prefill_passes)
    stops = jnp.asarray(stop_tokens or (-1,), jnp.int32)
    B = prompts_BP.shape[0]

    def body(carry: tuple, i: jax.Array) -> tuple:
        state, done_B, count_B = carry
        token_B = sample(state.logits_BV, jax.random.fold_in(jax.random.PRNGKey(seed), i), temperature, top_k, top_p)
        token_B = jnp.where(done_B, 0, token_B)
        count_B = count_B + (~done_B).astype(jnp.int32)
        done_B = done_B | jnp.isin(token_B, stops)
        return (step(model, state, token_B, mode), done_B, count_B), token_B

    init = (state, jnp.zeros((B,), bool), jnp.zeros((B,), jnp.int32))
    (_, _, count_B), tokens_NB = jax.lax.scan(body, init, jnp.arange(max_new_tokens))
    return tokens_NB.T, count_B
