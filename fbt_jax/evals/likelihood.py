"""Scoring tokens in each decoding mode: the log-probability a model gives each token of a
continuation after its context (the harness's loglikelihood requests, `harness.py`), in the terms of
docs/method.md §8:

- `standard`: one plain pass over context + continuation, teacher-forced (training's K=1 forward).
- `soft`: the context read plain, then each continuation token fed with the previous position's top
  state: teacher-forced latent feedback, the recurrence soft decoding runs (`decode.step`).
- `fused`: the context prefilled with the fused passes (`decode.prefill`), then as soft.

Soft and fused are sequential over the continuation (position t's input needs h_{t-1}), one cached
step per token; standard is one parallel pass. Requests are sorted by length and batched, rows split
over the devices (`generation.Compiled`), lengths padded to buckets so that a few programs serve a
task; a request's numbers do not depend on its batch.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fbt_jax import decode
from fbt_jax.evals.generation import Compiled
from fbt_jax.feedback import kpass_forward

CONTEXT_BUCKET = 32  # context (standard: context + continuation) lengths are padded to a multiple of this
CONTINUATION_BUCKET = 8  # soft and fused: continuation lengths, a multiple of this


@dataclasses.dataclass(frozen=True)
class Scored:
    logprobs: np.ndarray  # (continuation tokens,) float32: log p(token | everything before it)
    greedy: np.ndarray  # (continuation tokens,) bool: the token is the argmax of its distribution

    @property
    def total(self) -> float:
        return float(np.sum(self.logprobs, dtype=np.float64))

    @property
    def is_greedy(self) -> bool:
        return bool(np.all(self.greedy))


def _token_scores(logits_BTV: jax.Array, targets_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each target's log-probability under its logits, and whether it is their argmax."""
    logp_BTV = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
    logp_BT = jnp.take_along_axis(logp_BTV, targets_BT[..., None], axis=-1)[..., 0]
    return logp_BT, jnp.argmax(logits_BTV, axis=-1) == targets_BT


@functools.partial(jax.jit, static_argnums=(0, 1))
def _plain(static: tuple, graphdef: Any, params: Any, inputs_BT: jax.Array, starts_B: jax.Array, targets_BC):
    """Standard mode: one plain pass; the continuation's targets (from each row's `starts` on) scored,
    the readout computed at those positions only."""
    model = nnx.merge(graphdef, params)
    fuse_from_B = jnp.ones((inputs_BT.shape[0],), jnp.int32)  # unused by one pass
    (h_BTD,) = kpass_forward(model, inputs_BT, fuse_from_B, 1)
    at_BC = jnp.minimum(starts_B[:, None] + jnp.arange(targets_BC.shape[1]), inputs_BT.shape[1] - 1)
    h_BCD = jnp.take_along_axis(h_BTD, at_BC[..., None], axis=1)
    return _token_scores(model.logits(h_BCD), targets_BC)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _recurrent(static: tuple, graphdef: Any, params: Any, context_BP: jax.Array, lengths_B: jax.Array, continuation_BC):
    """Soft and fused modes: the context prefilled in the mode, then the continuation fed one token
    at a time (teacher-forced), each scored before it is fed."""
    mode, prefill_passes, cache_len = static
    model = nnx.merge(graphdef, params)
    state = decode.prefill(model, context_BP, lengths_B, cache_len, mode, prefill_passes)

    def feed(state: decode.DecodeState, token_B: jax.Array) -> tuple:
        logp_B1, greedy_B1 = _token_scores(state.logits_BV[:, None], token_B[:, None])
        return decode.step(model, state, token_B, mode), (logp_B1[:, 0], greedy_B1[:, 0])

    _, (logp_CB, greedy_CB) = jax.lax.scan(feed, state, continuation_BC.T)
    return logp_CB.T, greedy_CB.T


def _ceil(n: int, multiple: int) -> int:
    return math.ceil(n / multiple) * multiple


class Scorer:
    """Loglikelihoods of (context, continuation) token requests in one mode, batched by length."""

    def __init__(self, compiled: Compiled, batch_size: int = 32, prefill_passes: int = 2):
        self.compiled, self.batch_size, self.prefill_passes = compiled, batch_size, prefill_passes

    def score(
        self,
        requests: Sequence[tuple[Sequence[int], Sequence[int]]],
        mode: str,
        done: Callable[[list[int], list[Scored]], None] = lambda indices, scored: None,
    ) -> list[Scored]:
        """Each request's continuation scored after its context (at least one token each); `done`
        is given each batch as it finishes (the requests' indices and their scores)."""
        if mode not in decode.MODES:
            raise ValueError(f"mode {mode!r}: use one of {decode.MODES}")
        # Longest first: a batch's padding stays small, and a batch too large fails at once.
        order = sorted(range(len(requests)), key=lambda i: -(len(requests[i][0]) + len(requests[i][1])))
        devices = self.compiled.num_devices
        rows = _ceil(min(self.batch_size, max(len(requests), 1)), devices)
        out: list[Scored | None] = [None] * len(requests)
        for start in range(0, len(order), rows):
            batch = [requests[i] for i in order[start : start + rows]]
            run = self._plain if mode == "standard" else functools.partial(self._recurrent, mode=mode)
            scored = run(batch, rows)
            for i, one in zip(order[start : start + rows], scored):
                out[i] = one
            done(order[start : start + rows], scored)
        return out

    def _plain(self, batch: list[tuple[Sequence[int], Sequence[int]]], rows: int) -> list[Scored]:
        length = _ceil(max(len(c) + len(x) - 1 for c, x in batch), CONTEXT_BUCKET)
        continuation_len = _ceil(max(len(x) for _, x in batch), CONTINUATION_BUCKET)
        inputs, starts = np.zeros((rows, length), np.int32), np.zeros((rows,), np.int32)
        targets = np.zeros((rows, continuation_len), np.int32)
        for r, (context, continuation) in enumerate(batch):
            whole = [*context, *continuation]
            inputs[r, : len(whole) - 1], starts[r] = whole[:-1], len(context) - 1  # predicts continuation[0]
            targets[r, : len(continuation)] = continuation
        put = self.compiled.put_rows
        logp, greedy = self.compiled.run(_plain, (), put(inputs), put(starts), put(targets))
        logp, greedy = np.asarray(logp), np.asarray(greedy)
        self.compiled.timing.tokens += sum(len(x) for _, x in batch)
        return [Scored(logp[r, : len(x)], greedy[r, : len(x)]) for r, (_, x) in enumerate(batch)]

    def _recurrent(self, batch: list[tuple[Sequence[int], Sequence[int]]], rows: int, mode: str) -> list[Scored]:
        context_len = _ceil(max(len(c) for c, _ in batch), CONTEXT_BUCKET)
        continuation_len = _ceil(max(len(x) for _, x in batch), CONTINUATION_BUCKET)
        contexts, lengths = np.zeros((rows, context_len), np.int32), np.ones((rows,), np.int32)
        continuations = np.zeros((rows, continuation_len), np.int32)
        for r, (context, continuation) in enumerate(batch):
            contexts[r, : len(context)], lengths[r] = context, len(context)
            continuations[r, : len(continuation)] = continuation
        put = self.compiled.put_rows
        static = (mode, self.prefill_passes, context_len + continuation_len)
        logp, greedy = self.compiled.run(_recurrent, static, put(contexts), put(lengths), put(continuations))
        logp, greedy = np.asarray(logp), np.asarray(greedy)
        self.compiled.timing.tokens += sum(len(x) for _, x in batch)
        return [Scored(logp[r, : len(x)], greedy[r, : len(x)]) for r, (_, x) in enumerate(batch)]
