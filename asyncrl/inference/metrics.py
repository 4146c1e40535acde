"""Prometheus metrics of one inference server: load, throughput, KV use, weight version.

Gauges are read from the engine at scrape time (no background thread); throughput is a sliding
window over recently finished requests, so a scrape shows the current rate, not a lifetime mean.
"""

from __future__ import annotations

import collections
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

WINDOW_S = 10.0


class EngineMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.registry = CollectorRegistry()
        r = self.registry
        self.queue = Gauge("asyncrl_queue_length", "requests waiting for a slot", registry=r)
        self.running = Gauge("asyncrl_running_requests", "requests holding a KV slot", registry=r)
        self.kv = Gauge("asyncrl_kv_cache_usage", "fraction of KV cache slots in use", registry=r)
        self.version = Gauge("asyncrl_weight_version", "policy version of the weights", registry=r)
        self.tps = Gauge("asyncrl_generation_tokens_per_second",
                         f"generated tokens/s over the last {WINDOW_S:.0f}s", registry=r)
        self.requests = Counter("asyncrl_requests", "finished requests", ["stop_reason"],
                                registry=r)
        self.tokens = Counter("asyncrl_generated_tokens", "generated tokens", registry=r)
        self.latency = Histogram("asyncrl_request_latency_seconds", "request latency",
                                 registry=r)
        self._recent: collections.deque[tuple[float, int]] = collections.deque()

    def observe(self, resp: Any, latency: float) -> None:
        self.requests.labels(resp.stop_reason.value).inc()
        self.tokens.inc(resp.output_len)
        self.latency.observe(latency)
        self._recent.append((time.monotonic(), resp.output_len))

    def _tokens_per_second(self) -> float:
        now = time.monotonic()
        while self._recent and now - self._recent[0][0] > WINDOW_S:
            self._recent.popleft()
        return sum(n for _, n in self._recent) / WINDOW_S

    def render(self) -> bytes:
        stats = self.engine.stats()
        self.queue.set(stats["waiting"])
        self.running.set(stats["running"])
        self.kv.set(stats["kv_cache_usage"])
        self.version.set(stats["version"])
        self.tps.set(self._tokens_per_second())
        return generate_latest(self.registry)
