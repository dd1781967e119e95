"""The decode pool: requests wait in a queue, enter a free slot between decode steps (`engine.insert`)
and leave it when they end; one thread runs every device program (`Pool.run`), the HTTP side only
submits requests and reads their events.

A request ends at one of its stop tokens or stop strings ("stop"), at `max_tokens` or the end of
the context ("length"), or when its client goes away (cancelled: nothing more is sent). A request
whose own work fails (its prompt's prefill, its stop check) fails alone; a failed decode step fails
the requests it held and the pool starts again from empty slots.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fbt_jax.serve import engine
from fbt_jax.serve.metrics import Metrics


class QueueFull(Exception):
    """The request would fit the pool, but not now (the slots are busy, the queue full): retry later."""


class TooLarge(Exception):
    """The request has more choices than the pool holds at once (every slot and the whole queue): it
    can never enter, however long the client waits."""


class Draining(Exception):
    """The server is shutting down and takes no new requests."""


@dataclasses.dataclass(frozen=True)
class Scores:
    """Log-probabilities of tokens, with each position's most likely alternatives."""

    logprobs: np.ndarray  # (N,) float32
    top_ids: np.ndarray  # (N, engine.TOP_LOGPROBS) int32
    top_logprobs: np.ndarray  # (N, engine.TOP_LOGPROBS) float32


@dataclasses.dataclass
class Event:
    kind: str  # "prompt" (its scores), "token" (id and scores), "done" (finish reason), "failed" (message)
    token: int = -1
    scores: Scores | None = None
    reason: str = ""


@dataclasses.dataclass
class Request:
    prompt: Sequence[int]
    mode: str  # standard | soft | fused
    max_tokens: int  # 0: only the prompt's scores (echo)
    emit: Callable[[Event], None]  # called from the device thread
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    choice: int = 0  # which of the request's n choices: its samples' key differs per choice
    stop_ids: tuple[int, ...] = ()
    stop_check: Callable[[list[int]], bool] | None = None  # the tokens so far end at a stop string
    score_prompt: bool = False
    tokens: list[int] = dataclasses.field(default_factory=list)
    cancelled: bool = False  # set by the HTTP side when the client goes away
    submitted: float = dataclasses.field(default_factory=time.perf_counter)


def buckets_for(context_len: int, smallest: int = 32) -> tuple[int, ...]:
    """Prefill lengths compiled: doubling from `smallest`, the context length last."""
    out, length = [], smallest
    while length < context_len:
        out.append(length)
        length *= 2
    return (*out, context_len)


class Pool:
    def __init__(
        self,
        model: Any,
        num_slots: int,
        context_len: int,
        *,
        buckets: Sequence[int] | None = None,
        prefill_passes: int = 2,
        max_waiting: int = 256,
        decode_steps: int = 8,
        metrics: Metrics | None = None,
    ):
        self.graphdef, self.params = nnx.split(model)
        self.model, self.num_slots, self.context_len = model, num_slots, context_len
        self.buckets = tuple(sorted(buckets or buckets_for(context_len)))
        if self.buckets[-1] < context_len:
            self.buckets = (*self.buckets, context_len)
        self.prefill_passes, self.max_waiting = prefill_passes, max_waiting
        # Steps per trip from the host while nobody waits for a slot (a waiting request could take
        # a slot freed by any step: then one step per trip).
        self.decode_steps = decode_steps
        self.metrics = metrics or Metrics()
        self.slots = engine.empty_slots(model, num_slots, context_len)
        self.active: list[Request | None] = [None] * num_slots
        self.waiting: collections.deque[Request] = collections.deque()
        self.changed = threading.Condition()
        self.stopping = self.draining = False
        self.compiled_programs = 0

    # --- the HTTP side ------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """The most choices the pool holds at once: one in each slot, `max_waiting` queued."""
        return self.num_slots + self.max_waiting

    def submit(self, requests: Sequence[Request]) -> None:
        """Queue a request's choices together (all or none): those that find a free slot enter it, the
        rest wait, up to `max_waiting`."""
        with self.changed:
            if self.draining:
                raise Draining("the server is shutting down")
            if len(requests) > self.capacity:
                raise TooLarge(f"{len(requests)} choices; the most this server holds at once is {self.capacity}")
            held = self.running() + len(self.waiting)  # a slot being filled counts as running (`run`)
            if held + len(requests) > self.capacity:
                raise QueueFull(
                    f"{self.running()} of {self.num_slots} slots are busy and {len(self.waiting)} requests wait, "
                    f"the most this server queues is {self.max_waiting}"
                )
            now = time.perf_counter()
            for request in requests:
                request.submitted = now
                self.waiting.append(request)
            self.changed.notify()
        self.metrics.queue(len(self.waiting), self.running())

    def running(self) -> int:
        return sum(r is not None for r in self.active)

    def drain(self) -> None:
        with self.changed:
            self.draining = True

    def stop(self) -> None:
        with self.changed:
            self.stopping = True
            self.changed.notify()

    # --- the device thread --------------------------------------------------------------------------
    def compile(self) -> tuple[int, float]:
        """Compile (and run once) every program the pool uses: each prefill bucket in plain and fused
        form, with and without prompt scores, and the decode steps (one, and `decode_steps` in one
        program). Returns (programs, seconds)."""
        start, count = time.perf_counter(), 0
        for bucket in self.buckets:
            for fused in (False, True):
                for score in (False, True):
                    self._insert(np.zeros((bucket,), np.int32), bucket, 0, fused, False, score)
                    count += 1
        for num_steps in sorted({1, self.decode_steps}):
            self._step(self._sampling(), num_steps)
            count += 1
        self.slots = engine.empty_slots(self.model, self.num_slots, self.context_len)
        self.compiled_programs = count
        return self.compiled_programs, time.perf_counter() - start

    def run(self) -> None:
        """Serve until `stop`: admit waiting requests into free slots, then step the busy ones."""
        while True:
            with self.changed:
                while not self.stopping and not self.waiting and not self.running():
                    self.changed.wait()
                if self.stopping:
                    break
                admitted = []
                for slot in range(self.num_slots):
                    if self.active[slot] is None and self.waiting:
                        # The slot is the request's from here (before its prefill), so that `submit`
                        # never counts a request leaving the queue as neither waiting nor running.
                        self.active[slot] = self.waiting.popleft()
                        admitted.append(slot)
            for slot in admitted:
                self._admit(slot)
            self.metrics.queue(len(self.waiting), self.running())
            if self.running():
                self._decode()
                self.metrics.queue(len(self.waiting), self.running())
        for slot, request in enumerate(self.active):  # stopped with requests running: they end now
            if request is not None:
                request.emit(Event("failed", reason="the server stopped before this request finished"))
                self.active[slot] = None

    def _bucket(self, length: int) -> int:
        return next(b for b in self.buckets if b >= length)

    def _insert(self, prompt: np.ndarray, length: int, slot: int, fused: bool, feedback: bool, score: bool):
        padded = np.zeros((1, self._bucket(length)), np.int32)
        padded[0, :length] = prompt[:length]
        static = (fused, self.prefill_passes, score)
        self.slots, scores = engine.insert(
            self.graphdef,
            static,
            self.params,
            self.slots,
            padded,
            jnp.int32(length),
            jnp.int32(slot),
            jnp.bool_(feedback),
        )
        return scores

    def _admit(self, slot: int) -> None:
        """Prefill the request reserved for `slot`; it keeps the slot unless it ends here (cancelled,
        failed, or only scoring its prompt). The slot is freed before its client hears of the end."""
        request = self.active[slot]
        if request.cancelled:
            self.active[slot] = None
            return
        self.metrics.entered_slot(time.perf_counter() - request.submitted)
        try:
            prompt = np.asarray(request.prompt, np.int32)
            scores = self._insert(
                prompt, len(prompt), slot, request.mode == "fused", request.mode != "standard", request.score_prompt
            )
            if request.score_prompt:
                logp, ids, top = (np.asarray(x)[: len(prompt)] for x in scores)
                request.emit(Event("prompt", scores=Scores(logp, ids, top)))
        except Exception as err:  # this request's prefill failed: it fails alone
            self.active[slot] = None
            request.emit(Event("failed", reason=f"prefill failed: {err}"))
            return
        if request.max_tokens == 0:
            self.active[slot] = None
            self._finish(request, "length")

    def _sampling(self) -> engine.Sampling:
        def column(get: Callable[[Request], Any], dtype: Any, free: Any = 0) -> np.ndarray:
            return np.array([get(r) if r is not None else free for r in self.active], dtype)

        return engine.Sampling(
            column(lambda r: r.temperature, np.float32),
            column(lambda r: r.top_p, np.float32, free=1.0),
            column(lambda r: r.seed, np.int32),
            column(lambda r: r.choice, np.int32),
            column(lambda r: len(r.tokens), np.int32),
        )

    def _step(self, sampling: engine.Sampling, num_steps: int) -> engine.Chosen:
        self.slots, chosen = engine.steps(self.graphdef, num_steps, self.params, self.slots, sampling)
        return jax.device_get(chosen)

    def _decode(self) -> None:
        num_steps = self.decode_steps if self.decode_steps > 1 and not self._first_or_freeing() else 1
        try:
            chosen = self._step(self._sampling(), num_steps)
        except Exception as err:  # the step itself failed: its requests fail, the pool starts afresh
            for slot, request in enumerate(self.active):
                if request is not None:
                    self.active[slot] = None
                    request.emit(Event("failed", reason=f"decoding failed: {err}"))
            self.slots = engine.empty_slots(self.model, self.num_slots, self.context_len)
            return
        for k in range(num_steps):
            self._take(engine.Chosen(*(x[k] for x in (chosen.token_S, chosen.logprob_S, chosen.top_ids_SK,
                                                      chosen.top_logprobs_SK))))  # fmt: skip

    def _first_or_freeing(self) -> bool:
        """One step this trip: a request has no token yet (its first goes out at once), or a request
        waits and a slot may free up within the trip (a request reaches max_tokens or the context's
        end), so that it enters at once."""
        busy = [r for r in self.active if r is not None]
        if any(not r.tokens for r in busy):
            return True
        if not self.waiting:
            return False
        room = min(min(r.max_tokens - len(r.tokens), self.context_len - len(r.prompt) - len(r.tokens)) for r in busy)
        return room < self.decode_steps

    def _take(self, chosen: engine.Chosen) -> None:
        """One step's tokens to their requests; a request that ends leaves its slot (the slot's later
        steps in the same trip are never read)."""
        self.metrics.step(sum(len(r.prompt) + len(r.tokens) for r in self.active if r is not None))
        generated = 0
        for slot, request in enumerate(self.active):
            if request is None:
                continue
            if request.cancelled:  # the client went away: the slot is free for the next request
                self.active[slot] = None
                self.metrics.finished(request.mode, "cancelled")
                continue
            token = int(chosen.token_S[slot])
            if not request.tokens:
                self.metrics.first_token(time.perf_counter() - request.submitted)
            request.tokens.append(token)
            generated += 1
            scores = Scores(chosen.logprob_S[slot : slot + 1], chosen.top_ids_SK[slot : slot + 1],
                            chosen.top_logprobs_SK[slot : slot + 1])  # fmt: skip
            request.emit(Event("token", token=token, scores=scores))
            try:
                stopped = token in request.stop_ids or bool(request.stop_check and request.stop_check(request.tokens))
            except Exception as err:
                self.active[slot] = None
                request.emit(Event("failed", reason=f"stop check failed: {err}"))
                continue
            full = len(request.prompt) + len(request.tokens) >= self.context_len
            if stopped or full or len(request.tokens) >= request.max_tokens:
                self.active[slot] = None
                self._finish(request, "stop" if stopped else "length")
        self.metrics.generated(generated)

    def _finish(self, request: Request, reason: str) -> None:
        request.emit(Event("done", reason=reason))
        self.metrics.finished(request.mode, reason)
