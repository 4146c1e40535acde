"""`AgentWorkflow`: one agent run = one proxy session = one trajectory (a RolloutWorkflow).

Per episode: start a session, run the agent against the proxy with the session's key, give its
result to the session as reward, export the recorded completions as samples. An agent that
raises, returns the wrong type, names unknown completions, makes no completion or runs past its
timeout is a rejected rollout with the reason logged (and counted in `stats`); training goes on.
The proxy is started lazily on the rollout event loop, so the engine it forwards to is driven from
the loop that owns its clients; the `engine` argument of `arun_episode` is that same engine.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Any

from asyncrl.api import InferenceEngine, Trajectory
from asyncrl.proxy.agent_runner import AgentRunner, load_agent
from asyncrl.proxy.config import AgentConfig
from asyncrl.proxy.server import ProxyServer

log = logging.getLogger(__name__)


class AgentWorkflow:
    def __init__(self, agent: Any, proxy: ProxyServer, cfg: AgentConfig | None = None) -> None:
        self.cfg = cfg or AgentConfig()
        self.agent = load_agent(agent, self.cfg.init_kwargs)
        self.proxy = proxy
        self.runner = AgentRunner(self.agent, self.cfg)
        self.rejections: collections.Counter[str] = collections.Counter()
        self._starting: asyncio.Lock | None = None
        self.closing = False

    async def ensure_started(self) -> str:
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if not self.proxy.base_url:
                await self.proxy.start()
                log.info("agent proxy listening on %s", self.proxy.base_url)
        return self.proxy.base_url

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> Trajectory | None:
        base_url = await self.ensure_started()
        store = self.proxy.store
        session = store.start()
        name = type(self.agent).__name__
        try:
            try:
                result = await self.runner.run(data, base_url, session.api_key)
            except (TimeoutError, asyncio.TimeoutError):
                return self.reject("timeout", f"agent {name} ran past timeout_s="
                                   f"{self.cfg.timeout_s}", data)
            except Exception as err:  # boundary: the user's agent failed, the run goes on
                return self.reject("error", f"agent {name} raised {err!r}", data)
            try:
                store.end(session.id)
                session.set_reward(result)
                if not session.completions:
                    return self.reject("no_completions", f"agent {name} made no completion", data)
                samples = store.export(session.id, self.cfg.export_style, self.cfg.turn_discount)
            except KeyError as err:  # an unknown completion id, or the session expired
                return self.reject("bad_reward", f"agent {name}'s reward: {err.args[0]}", data)
        finally:
            store.drop(session.id)
        return Trajectory(samples, group_id=str(data.get("id", "")),
                          metadata={"agent_result": result, "completions": len(samples)})

    def reject(self, kind: str, reason: str, data: dict[str, Any]) -> None:
        self.rejections[kind] += 1
        # At shutdown the episodes still in flight lose their client: expected, not a warning.
        log.log(logging.DEBUG if self.closing else logging.WARNING,
                "%s on data id=%s; rollout rejected", reason, data.get("id"))
        return None

    async def aclose(self) -> None:
        self.closing = True
        await self.runner.aclose()
        await self.proxy.stop()
