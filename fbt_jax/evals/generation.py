"""Batched generation for evaluations: the KV-cache decoding of `decode.py`, sharded over devices.

Rows are independent of their batch: each row samples with its own key (from its task, problem,
and sample number, the same in every mode), so a generation does not depend on which batch,
device count or attempt produced it; an evaluation killed and started again, or run on 8 devices
instead of 1, writes the same generations. Prompts are right-padded to a multiple of
`PROMPT_BUCKET` tokens so that a handful of programs serve a whole task. Generation runs in
chunks of up to `CHUNK` tokens; after each chunk the host checks the stop sequences (text) and
ends the batch once every row has stopped.

A row may also carry `forced` tokens, fed in the mode after the prompt before anything is sampled:
the built-in tasks' input streams (the model labels each input; its answer is its prediction at
the last one).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from fbt_jax import decode

PROMPT_BUCKET = 32
CHUNK = 32


@dataclasses.dataclass(frozen=True)
class Request:
    prompt: Sequence[int]
    seed: int  # this row's sampling seed (uint32)
    forced: Sequence[int] = ()


@dataclasses.dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0
    prefill_passes: int = 2  # of the fused prefill


@dataclasses.dataclass
class Timing:
    compile_s: float = 0.0
    decode_s: float = 0.0  # prefill and generation: the compiled programs' run time
    tokens: int = 0


@functools.partial(jax.jit, static_argnums=(0, 1))
def _prefill(static: tuple, graphdef: Any, params: Any, prompts_BP: jax.Array, lengths_B: jax.Array, forced_BF):
    mode, passes, cache_len = static
    model = nnx.merge(graphdef, params)
    state = decode.prefill(model, prompts_BP, lengths_B, cache_len, mode, passes)

    def feed(state: decode.DecodeState, token_B: jax.Array) -> tuple:
        return decode.step(model, state, token_B, mode), None

    return jax.lax.scan(feed, state, forced_BF.T)[0]


@functools.partial(jax.jit, static_argnums=(0, 1))
def _chunk(static: tuple, graphdef: Any, params: Any, state, seeds_B: jax.Array, done_B: jax.Array, start):
    """`chunk` sampled tokens per row; a row that emitted a stop token emits zeros after it."""
    mode, chunk, temperature, top_k, top_p, stop_ids = static
    model = nnx.merge(graphdef, params)
    keys_B = jax.vmap(jax.random.PRNGKey)(seeds_B)
    stops = jnp.asarray(stop_ids or (-1,), jnp.int32)

    def draw(logits_V: jax.Array, key: jax.Array) -> jax.Array:
        return decode.sample(logits_V[None], key, temperature, top_k, top_p)[0]

    def body(carry: tuple, i: jax.Array) -> tuple:
        state, done_B = carry
        step_keys = jax.vmap(jax.random.fold_in, (0, None))(keys_B, start + i)
        token_B = jnp.where(done_B, 0, jax.vmap(draw)(state.logits_BV, step_keys))
        live_B = ~done_B
        done_B = done_B | jnp.isin(token_B, stops)
        return (decode.step(model, state, token_B, mode), done_B), (token_B, live_B)

    (state, done_B), (tokens_CB, live_CB) = jax.lax.scan(body, (state, done_B), jnp.arange(chunk))
    return state, done_B, tokens_CB.T, live_CB.T


class Compiled:
    """A model's parameters replicated over `devices` (default: this host's), each batch's rows split
    over them; every program compiled once per (static settings, shapes), its compile time kept
    apart from its run time. Generation and scoring (`likelihood.py`) run their programs here."""

    def __init__(self, model: Any, devices: Sequence[Any] | None = None):
        devices = list(devices or jax.local_devices())
        self.mesh = Mesh(np.array(devices), ("data",))
        self.rows = NamedSharding(self.mesh, P("data"))
        self.compiled: dict[tuple, Any] = {}
        self.timing = Timing()
        self.load(model)

    def load(self, model: Any) -> None:
        """Take `model`'s parameters (the same structure: the compiled programs serve them too)."""
        self.graphdef, params = nnx.split(model)
        self.params = jax.device_put(params, NamedSharding(self.mesh, P()))

    @property
    def num_devices(self) -> int:
        return self.mesh.devices.size

    def put_rows(self, array: np.ndarray) -> jax.Array:
        """A host batch, its rows (a multiple of the device count) split over the devices."""
        return jax.device_put(array, self.rows)

    def run(self, fn: Any, static: tuple, *args: Any) -> Any:
        """`fn(static, graphdef, params, *args)`, compiled once per (static settings, shapes)."""
        key = (fn.__name__, static, *(getattr(a, "shape", None) for a in jax.tree.leaves(args)))
        if key not in self.compiled:
            start = time.perf_counter()
            self.compiled[key] = fn.lower(static, self.graphdef, self.params, *args).compile()
            self.timing.compile_s += time.perf_counter() - start
        start = time.perf_counter()
        result = jax.block_until_ready(self.compiled[key](self.params, *args))
        self.timing.decode_s += time.perf_counter() - start
        return result


class Generator(Compiled):
    """One model's generations, its batches split over `devices` (default: this host's)."""

    def generate(
        self,
        requests: Sequence[Request],
        mode: str,
        max_new_tokens: int,
        sampling: Sampling = Sampling(),
        stop_ids: tuple[int, ...] = (),
        stop_texts: tuple[str, ...] = (),
        detokenize: Callable[[Sequence[int]], str] | None = None,
    ) -> list[list[int]]:
        """The generated ids of each request (up to `max_new_tokens`, ending with a stop token or
        the tokens that completed a stop sequence). All requests form one batch (padded to a
        multiple of the device count)."""
        devices = self.num_devices
        rows = math.ceil(len(requests) / devices) * devices
        prompt_len = max(len(r.prompt) for r in requests)
        prompt_len = math.ceil(prompt_len / PROMPT_BUCKET) * PROMPT_BUCKET
        forced_len = len(requests[0].forced)
        chunk = min(CHUNK, max_new_tokens)
        chunks = math.ceil(max_new_tokens / chunk)
        prompts = np.zeros((rows, prompt_len), np.int32)
        lengths = np.ones((rows,), np.int32)
        forced = np.zeros((rows, forced_len), np.int32)
        seeds = np.zeros((rows,), np.uint32)
        for i, r in enumerate(requests):
            prompts[i, : len(r.prompt)], lengths[i], seeds[i] = r.prompt, len(r.prompt), r.seed
            forced[i] = r.forced
        put = self.put_rows
        cache_len = prompt_len + forced_len + chunks * chunk
        state = self.run(_prefill, (mode, sampling.prefill_passes, cache_len), put(prompts), put(lengths), put(forced))
        done = put(np.zeros((rows,), bool))
        static = (mode, chunk, sampling.temperature, sampling.top_k, sampling.top_p, tuple(stop_ids))
        out: list[list[int]] = [[] for _ in requests]
        stopped = np.zeros((rows,), bool)
        stopped[len(requests) :] = True  # padding rows
        for c in range(chunks):
            state, done, tokens, live = self.run(_chunk, static, state, put(seeds), done, jnp.int32(c * chunk))
            tokens, live = np.asarray(tokens), np.asarray(live)
            for i in range(len(requests)):
                if not stopped[i]:
                    out[i] += tokens[i][live[i]].tolist()[: max_new_tokens - len(out[i])]
                    stopped[i] = not live[i][-1] or bool(np.isin(out[i][-1:], stop_ids).any())
                    if not stopped[i] and stop_texts and detokenize is not None:
                        n = _stop_text_end(out[i], stop_texts, detokenize)
                        if n:
                            out[i], stopped[i] = out[i][:n], True
            if stopped.all():
                break
            if stop_texts:  # rows the host stopped emit nothing more
                done = put(np.asarray(done) | stopped)
        self.timing.tokens += sum(len(o) for o in out)
        return out


def _stop_text_end(ids: list[int], stop_texts: tuple[str, ...], detokenize: Callable) -> int:
    """The fewest leading tokens whose text contains a stop sequence (0 if none does)."""
    if not any(s in detokenize(ids) for s in stop_texts):
        return 0
    low, high = 1, len(ids)
    while low < high:
        middle = (low + high) // 2
        if any(s in detokenize(ids[:middle]) for s in stop_texts):
            high = middle
        else:
            low = middle + 1
    return low


def cut_at_stop(text: str, stop_texts: Sequence[str]) -> str:
    """The text before the first stop sequence (the stop sequence is not part of the answer)."""
    cut = min((text.index(s) for s in stop_texts if s in text), default=len(text))
    return text[:cut]
