"""Which server gets the next request: round robin or least loaded, sticky by request id, and
around servers marked unhealthy until a health probe brings them back.

No I/O here, only state behind a lock: the remote client may be driven from several event loops on
several threads at once (the rollout executor runs its own loop), and they all share one pool.
Stickiness keeps a continued request (same rid: the next turn of a conversation, or the
continuation after a weight-update interruption) on the server that already holds its prefix in
its KV / prefix cache.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum


class Routing(str, Enum):
    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"  # fewest requests in flight from this client


class ServerHealth(str, Enum):
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"  # skipped by routing until a health probe succeeds


@dataclass(eq=False)  # identity semantics: states are mutable and used as dict keys
class ServerState:
    index: int
    address: str
    health: ServerHealth = ServerHealth.HEALTHY
    in_flight: int = 0
    version: int = 0  # weight version this client last saw the server take (or report)
    last_error: str = ""
    next_probe_at: float = 0.0
    requests: int = 0  # generation calls routed here
    failures: int = 0  # calls that failed with a connection error, timeout or 5xx
    tokens: int = 0  # generated tokens received from it (streamed ones as they arrive)


class ServerPool:
    def __init__(
        self,
        addresses: list[str],
        routing: Routing = Routing.ROUND_ROBIN,
        probe_interval_s: float = 5.0,
        sticky_capacity: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not addresses:
            raise ValueError("addresses=[] is empty; allowed: at least one server base URL")
        self.servers = [ServerState(i, a.rstrip("/")) for i, a in enumerate(addresses)]
        self.routing = Routing(routing)
        self.probe_interval_s = probe_interval_s
        self.sticky_capacity = sticky_capacity
        self.required_version = 0  # servers reporting an older version stay out of rotation
        self._clock = clock
        self._lock = threading.Lock()
        self._cursor = 0
        self._sticky: OrderedDict[str, int] = OrderedDict()  # rid -> server index, LRU

    # ---- routing ----------------------------------------------------------------------------

    def acquire(self, rid: str) -> ServerState | None:
        """The server for `rid`, with one more request in flight; None if none is healthy."""
        with self._lock:
            healthy = [s for s in self.servers if s.health is ServerHealth.HEALTHY]
            if not healthy:
                return None
            index = self._sticky.get(rid)
            if index is not None and self.servers[index].health is ServerHealth.HEALTHY:
                self._sticky.move_to_end(rid)
                chosen = self.servers[index]
            else:
                chosen = self._choose(healthy)
                self._remember(rid, chosen.index)
            chosen.in_flight += 1
            chosen.requests += 1
            return chosen

    def release(self, server: ServerState) -> None:
        with self._lock:
            server.in_flight -= 1

    def _choose(self, healthy: list[ServerState]) -> ServerState:
        n = len(self.servers)
        # Distance from the cursor breaks ties, so equal loads still rotate over the servers.
        def rank(s: ServerState) -> tuple[int, int]:
            distance = (s.index - self._cursor) % n
            return (s.in_flight, distance) if self.routing is Routing.LEAST_LOADED else (0, distance)

        chosen = min(healthy, key=rank)
        self._cursor = (chosen.index + 1) % n
        return chosen

    def _remember(self, rid: str, index: int) -> None:
        self._sticky[rid] = index
        self._sticky.move_to_end(rid)
        while len(self._sticky) > self.sticky_capacity:
            self._sticky.popitem(last=False)

    # ---- health -----------------------------------------------------------------------------

    def mark_failed(self, server: ServerState, error: str) -> None:
        with self._lock:
            server.health = ServerHealth.UNHEALTHY
            server.last_error = error
            server.failures += 1
            server.next_probe_at = self._clock() + self.probe_interval_s

    def claim_probes(self, force: bool = False) -> list[ServerState]:
        """Unhealthy servers whose probe is due (all of them with `force`); each is claimed so
        concurrent callers do not probe the same server twice in one interval."""
        now = self._clock()
        with self._lock:
            due = [s for s in self.servers if s.health is ServerHealth.UNHEALTHY
                   and (force or s.next_probe_at <= now)]
            for s in due:
                s.next_probe_at = now + self.probe_interval_s
            return due

    def probe_result(self, server: ServerState, ok: bool, version: int | None, error: str = "") -> None:
        with self._lock:
            if not ok:
                server.last_error = error
                return
            if version is not None and version < self.required_version:
                # It answers but missed a weight update (e.g. restarted from an old checkpoint).
                server.last_error = (f"reports weight version {version}, the client is at "
                                     f"{self.required_version}")
                return
            server.health = ServerHealth.HEALTHY
            if version is not None:
                server.version = version

    def replace(self, index: int, address: str) -> ServerState:
        """Server `index` now lives at `address` (restarted elsewhere): out of rotation until a
        weight update brings it to the current version (the update's own version check
        re-admits it) or a probe finds it there."""
        with self._lock:
            s = self.servers[index]
            s.address = address.rstrip("/")
            s.health = ServerHealth.UNHEALTHY
            s.version = 0
            s.last_error = "restarted: waits for the current weights"
            s.next_probe_at = self._clock()
            return s

    def add_tokens(self, server: ServerState, n: int) -> None:
        with self._lock:
            server.tokens += n

    def set_version(self, server: ServerState, version: int) -> None:
        with self._lock:
            server.version = version

    def describe(self) -> str:
        """One line per server for error messages: address, health, last error."""
        with self._lock:
            return "; ".join(
                f"{s.address} ({s.health.value}{': ' + s.last_error if s.last_error else ''})"
                for s in self.servers
            )

    def snapshot(self) -> list[dict]:
        with self._lock:
            return [
                {"address": s.address, "health": s.health.value, "in_flight": s.in_flight,
                 "version": s.version, "requests": s.requests, "failures": s.failures,
                 "tokens": s.tokens, "last_error": s.last_error}
                for s in self.servers
            ]
