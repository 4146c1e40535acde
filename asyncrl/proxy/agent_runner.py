"""Running a user's agent program: load it, call `run` inline or in a subprocess, bound its time.

An agent is any object with `async def run(self, data, **extra_kwargs) -> float | dict[str, float]`,
given as the object, its class (instantiated with `init_kwargs`) or a dotted path to either.
- inline: `run` is awaited on the rollout event loop with `base_url`, `api_key` and the shared
  `http_client` injected (an `openai.DefaultAsyncHttpxClient` when the SDK is installed).
- subproc: the agent and the data are pickled to a pebble process pool (spawned workers), where
  `run` executes under `asyncio.run` with OPENAI_BASE_URL / OPENAI_API_KEY set, so synchronous
  clients and libraries that own the event loop work. A call past `timeout_s` kills its worker.
"""

from __future__ import annotations

import asyncio
import inspect
import multiprocessing
import os
from typing import Any

from asyncrl.api import Closable
from asyncrl.imports import import_object
from asyncrl.proxy.config import AgentConfig

AgentResult = float | dict[str, float] | None  # None: the workflow's reward_fn scores it


def load_agent(spec: Any, init_kwargs: dict[str, Any] | None = None) -> Any:
    """The agent object a spec names; raises ValueError when it has no `async def run`."""
    obj = import_object(spec, "agent") if isinstance(spec, str) else spec
    if inspect.isclass(obj):
        obj = obj(**(init_kwargs or {}))
    run = getattr(obj, "run", None)
    if run is None or not inspect.iscoroutinefunction(run):
        raise ValueError(f"agent {spec!r} must define `async def run(self, data, **extra_kwargs)` "
                         "returning float | dict[str, float]")
    return obj


def check_result(result: Any) -> AgentResult:
    if result is None:
        return None
    if isinstance(result, bool) or not isinstance(result, (int, float, dict)):
        raise TypeError(f"agent returned {type(result).__name__}; allowed: float or "
                        "dict[str, float] (completion id -> reward)")
    if isinstance(result, dict):
        bad = [k for k, v in result.items()
               if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float))]
        if bad:
            raise TypeError(f"agent reward dict has bad entries for keys {bad[:3]}; allowed: "
                            "str completion id -> float")
        return {k: float(v) for k, v in result.items()}
    return float(result)


def _run_in_worker(agent: Any, data: dict[str, Any], base_url: str, api_key: str) -> Any:
    os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"] = base_url, api_key
    return asyncio.run(agent.run(data, base_url=base_url, api_key=api_key))


def default_http_client() -> Any:
    try:
        from openai import DefaultAsyncHttpxClient
    except ImportError:
        import httpx

        return httpx.AsyncClient(timeout=None)
    return DefaultAsyncHttpxClient(timeout=None)


class AgentRunner:
    def __init__(self, agent: Any, cfg: AgentConfig) -> None:
        self.agent, self.cfg = agent, cfg
        self._pool: Any = None
        self._client: Any = None

    async def run(self, data: dict[str, Any], base_url: str, api_key: str) -> AgentResult:
        """The agent's result; TimeoutError past `timeout_s`, the agent's own exception if it
        raised, TypeError for a result of the wrong type."""
        if self.cfg.mode == "inline":
            if self._client is None:
                self._client = default_http_client()
            coro = self.agent.run(data, base_url=base_url, api_key=api_key,
                                  http_client=self._client)
            return check_result(await asyncio.wait_for(coro, self.cfg.timeout_s))
        future = self.pool().schedule(_run_in_worker, args=(self.agent, data, base_url, api_key),
                                      timeout=self.cfg.timeout_s)
        try:
            return check_result(await asyncio.wrap_future(future))
        except asyncio.CancelledError:
            future.cancel()  # pebble stops the worker running it
            raise

    def pool(self) -> Any:
        if self._pool is None:
            import pebble

            self._pool = pebble.ProcessPool(max_workers=self.cfg.subproc_max_workers,
                                            context=multiprocessing.get_context("spawn"))
        return self._pool

    async def aclose(self) -> None:
        """Closes the shared HTTP client, the process pool and, inline, the agent itself when
        it has `async def aclose()` (its own clients, e.g. to a tool service)."""
        if self._client is not None:
            await self._client.aclose()
            self._client = None
        self.close_pool()
        if self.cfg.mode == "inline" and isinstance(self.agent, Closable):
            await self.agent.aclose()

    def close_pool(self) -> None:
        if self._pool is not None:
            self._pool.stop()
            self._pool.join(timeout=10)
            self._pool = None
