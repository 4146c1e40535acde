"""Control calls (pause, resume) sent to every server of a pool at once, from any thread.

They are synchronous (the trainer's thread pauses the servers around a weight update) and bounded
by `control_timeout_s` (connect: `connect_timeout_s`). A server that cannot be reached is marked
unhealthy and skipped; error replies (a wrong api_key, a server bug) raise one error naming every
server that answered with one, after all have been tried.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable

import httpx

from asyncrl.inference.backend_protocol import HttpCall
from asyncrl.inference.config import RemoteEngineConfig
from asyncrl.inference.routing import ServerPool, ServerState

log = logging.getLogger(__name__)


class ControlFanout:
    def __init__(self, cfg: RemoteEngineConfig, pool: ServerPool,
                 headers: Callable[[], dict[str, str]]) -> None:
        self.cfg, self.pool, self.headers = cfg, pool, headers
        self._lock = threading.Lock()
        self._client: httpx.Client | None = None

    def send(self, call: HttpCall, what: str) -> None:
        client = self._sync()

        def one(server: ServerState) -> str | None:
            try:
                resp = client.request(call.method, server.address + call.path, json=call.json,
                                      params=call.params, headers=self.headers())
            except httpx.TransportError as err:
                self.pool.mark_failed(server, f"{what}: {type(err).__name__}: {err}")
                log.warning("%s: server %s unreachable: %s", what, server.address, err)
                return None
            if resp.status_code >= 400:
                return (f"{server.address} answered {what} with HTTP {resp.status_code}: "
                        f"{resp.text[:300]}")
            return None

        servers = self.pool.servers
        with concurrent.futures.ThreadPoolExecutor(len(servers)) as threads:
            errors = [e for e in threads.map(one, servers) if e]
        if errors:
            raise RuntimeError("; ".join(errors))

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    def _sync(self) -> httpx.Client:
        with self._lock:
            if self._client is None:
                timeout = httpx.Timeout(self.cfg.control_timeout_s,
                                        connect=self.cfg.connect_timeout_s)
                self._client = httpx.Client(timeout=timeout)
            return self._client
