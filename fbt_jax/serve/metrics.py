"""The server's Prometheus metrics (`GET /metrics`, the text exposition format): requests running
and waiting, slots in use, tokens generated, requests finished and time to first token. One
registry per server, so that servers in one process (the tests) do not share counts."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# Time to first token: from a few milliseconds (a warm short prompt) to a minute (a long queue).
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


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
        self.ttft = Histogram(
            "fbt_time_to_first_token_seconds",
            "From a request's arrival to its first token",
            buckets=TTFT_BUCKETS,
            registry=r,
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

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
