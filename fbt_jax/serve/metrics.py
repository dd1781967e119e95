"""The server's Prometheus metrics (`GET /metrics`, the text exposition format): requests running
and waiting, slots in use, tokens generated, requests finished, refused and failed, time to first
token, time in the queue and each request's latency. One registry per server, so that servers in one
process (the tests) do not share counts."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# Time to first token: from a few milliseconds (a warm short prompt) to a minute (a long queue).
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# A request's whole answer: a few tokens of a small model to thousands of a large one behind a queue.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
# Waiting for a slot: nothing on an idle server, up to minutes with a long queue.
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, num_slots: int = 0):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests_running = Gauge("fbt_requests_running", "Requests decoding in a slot", registry=r)
        self.requests_waiting = Gauge("fbt_requests_waiting", "Requests queued for a free slot", registry=r)
        self.slots = Gauge("fbt_slots", "Decode slots on the device", registry=r)
        self.slots.set(num_slots)
        self.tokens = Counter("fbt_generated_tokens", "Tokens generated", registry=r)
        self.requests = Counter(
            "fbt_requests_finished", "Requests (choices) finished, by mode and reason", ["mode", "reason"], registry=r
        )
        # Summed over decode steps: their ratio (× slots × context) is the KV cache's mean occupancy.
        self.steps = Counter("fbt_decode_steps", "Decode steps run", registry=r)
        self.kv_held = Counter(
            "fbt_kv_positions_held", "Cache positions holding a token, summed over steps", registry=r
        )

        def histogram(name: str, documentation: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, documentation, buckets=buckets, registry=r)

        self.ttft = histogram(
            "fbt_time_to_first_token_seconds", "From a request's arrival to its first token", TTFT_BUCKETS
        )
        # vLLM's e2e_request_latency_seconds and request_queue_time_seconds, under this server's prefix.
        self.latency = histogram(
            "fbt_e2e_request_latency_seconds",
            "From a request's arrival to its last choice's end (answered requests)",
            LATENCY_BUCKETS,
        )
        self.queue_time = histogram(
            "fbt_request_queue_time_seconds", "From a choice's arrival to its entering a decode slot", QUEUE_BUCKETS
        )
        self.refusals = Counter(
            "fbt_requests_refused",
            "Requests refused before any work ran, by HTTP status (4xx; 429: the queue was full; 503: draining)",
            ["status"],
            registry=r,
        )
        self.failures = Counter(
            "fbt_requests_failed", "Requests that failed on the server, by HTTP status (5xx)", ["status"], registry=r
        )

    def queue(self, waiting: int, running: int) -> None:
        self.requests_waiting.set(waiting)
        self.requests_running.set(running)

    def generated(self, tokens: int) -> None:
        self.tokens.inc(tokens)

    def step(self, positions_held: int) -> None:
        self.steps.inc()
        self.kv_held.inc(positions_held)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def finished(self, mode: str, reason: str) -> None:
        self.requests.labels(mode=mode, reason=reason).inc()

    def answered(self, seconds: float) -> None:
        self.latency.observe(seconds)

    def entered_slot(self, seconds_waited: float) -> None:
        self.queue_time.observe(seconds_waited)

    def error(self, status: int) -> None:
        """An error answer: a refusal (the client's request, or the server draining: nothing ran) or a
        failure (the server's own, 5xx)."""
        if status < 500 or status == 503:
            self.refusals.labels(status=str(status)).inc()
        else:
            self.failures.labels(status=str(status)).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
