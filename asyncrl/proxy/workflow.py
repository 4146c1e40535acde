"""`AgentWorkflow`: one agent run = one proxy session = one trajectory (a RolloutWorkflow).

Per episode: start a session, run the agent against the proxy with the session's key, give its
result to the session as reward, export the recorded completions as samples. An agent that
raises, returns the wrong type, names unknown completions, makes no completion or runs past its
timeout is a rejected rollout (`EpisodeRejected` with the reason: the executor logs it
rate-limited, the watchdog shows it; counted by kind in `metrics`); training goes on.
The proxy is started lazily on the rollout event loop, so the engine it forwards to is driven from
the loop that owns its clients; the `engine` argument of `arun_episode` is that same engine.

It brings its own evaluation (`aevaluate`: the agent's mean reward on held-out rows, the share of
episodes with a well-formed tool call, the rejected share) and metrics (`metrics`: rejections by
kind and the proxy's counters), which the trainer logs like any workflow's.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Any

from asyncrl.api import EpisodeRejected, EvalReport, InferenceEngine, Trajectory
from asyncrl.proxy.agent_runner import AgentRunner, load_agent
from asyncrl.proxy.command_agent import CommandAgentError
from asyncrl.proxy.records import Session
from asyncrl.reward.call import RewardFn, call_reward
from asyncrl.proxy.config import AgentConfig
from asyncrl.proxy.errors import NotFoundError
from asyncrl.proxy.server import ProxyServer

log = logging.getLogger(__name__)


class AgentWorkflow:
    """Trains an agent program (`workflow: agent`): one agent run is one proxy session, and the
    completions the agent asked the proxy for become the episode's samples.

    Args:
        agent: the agent: an object with `async def run(data, **extra_kwargs)`, its class
            (instantiated with `cfg.init_kwargs`) or a dotted path to either.
        proxy: the OpenAI-compatible proxy server the agent talks to; started on first use.
        cfg: how the agent runs (inline or in a process pool, timeout, export style).
        eval_concurrency: the most agent runs `aevaluate` keeps in flight.
        reward_fn: scores the session's last reply when the agent returns None.

    Raises:
        ValueError: `agent` has no `async def run`.
    """

    def __init__(self, agent: Any, proxy: ProxyServer, cfg: AgentConfig | None = None,
                 eval_concurrency: int = 256, reward_fn: RewardFn | None = None) -> None:
        """`reward_fn`: scores the session's last reply against the row when the agent returns
        None (a command agent with `reward: reward_fn`)."""
        self.cfg = cfg or AgentConfig()
        self.reward_fn = reward_fn
        self.eval_concurrency = eval_concurrency
        self.agent = load_agent(agent, self.cfg.init_kwargs)
        self.proxy = proxy
        self.runner = AgentRunner(self.agent, self.cfg)
        self.rejections: collections.Counter[str] = collections.Counter()
        self._starting: asyncio.Lock | None = None

    async def ensure_started(self) -> str:
        """Starts the proxy server unless it is running; concurrent callers start it once.

        Returns:
            The proxy's OpenAI base URL, `http://host:port/v1`.

        Raises:
            RuntimeError: the proxy server exited before it started; an error the server
                raises while starting propagates as it is.
        """
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if not self.proxy.base_url:
                await self.proxy.start()
                log.info("agent proxy listening on %s", self.proxy.base_url)
        return self.proxy.base_url

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> Trajectory:
        """Runs the agent once on `data` in a new proxy session and exports what it generated.

        The agent's result is the session's reward (a float for the last completion, a dict by
        completion id); the session's completions become samples as `cfg.export_style` says.

        Args:
            engine: the engine the proxy forwards to (the proxy holds its own reference; this
                argument is not used).
            data: the data row handed to the agent's `run`.

        Returns:
            One trajectory with the session's samples; `group_id` is the row's `id`.

        Raises:
            EpisodeRejected: the agent raised, ran past `cfg.timeout_s`, returned a result of
                the wrong type or naming unknown completions, or made no completion; or it
                returned None and there is no `reward_fn`. Each is counted by kind in
                `metrics`.
            CapacityError: the proxy has no room for another session now.
            RewardError: `reward_fn` raised or returned a value that is not a finite float.
        """
        return (await self._episode(data))[0]

    async def _episode(self, data: dict[str, Any]) -> tuple[Trajectory, float]:
        """The trajectory and the agent's reward (a dict's sum); EpisodeRejected if rejected."""
        base_url = await self.ensure_started()
        store = self.proxy.store
        session = store.start()
        name = type(self.agent).__name__
        try:
            try:
                result = await self.runner.run(data, base_url, session.api_key)
            except (TimeoutError, asyncio.TimeoutError):
                self.reject("timeout", f"agent {name} ran past timeout_s={self.cfg.timeout_s}",
                            data)
            except CommandAgentError as err:
                self.reject(f"command_{err.kind}", f"agent {name}: {err}", data)
            except Exception as err:  # boundary: the user's agent failed, the run goes on
                self.reject("error", f"agent {name} raised {err!r}", data)
            if result is None:
                result = await self.score_last_reply(session, data)
            try:
                store.end(session.id)
                session.set_reward(result)
                if not session.completions:
                    self.reject("no_completions", f"agent {name} made no completion", data)
                samples = store.export(session.id, self.cfg.export_style, self.cfg.turn_discount)
            except NotFoundError as err:  # an unknown completion id, or the session expired
                self.reject("bad_reward", f"agent {name}'s reward: {err.args[0]}", data)
        finally:
            store.drop(session.id)
        reward = float(sum(result.values())) if isinstance(result, dict) else float(result)
        return Trajectory(samples, group_id=str(data.get("id", ""))), reward

    async def score_last_reply(self, session: Session, data: dict[str, Any]) -> float:
        """The reward function on the session's last reply (its first choice) and the row."""
        if self.reward_fn is None:
            self.reject("error", "the agent returned no reward and the workflow has no reward "
                                 "function to score its last reply", data)
        if not session.turns:
            self.reject("no_completions", "the agent made no completion", data)
        message = session.completions[session.turns[-1][0]].message
        return await call_reward(self.reward_fn, message.get("content") or
                                 message.get("text") or "", data)

    def reject(self, kind: str, reason: str, data: dict[str, Any]) -> None:
        """Count the rejection and raise it (the executor logs it, rate-limited)."""
        self.rejections[kind] += 1
        raise EpisodeRejected(f"{reason} on data id={data.get('id')}")

    def metrics(self) -> dict[str, float]:
        """Rejections by kind, and the proxy's cumulative counters: completions, prompts that
        reused sampled ids, and the token positions where naive re-rendering would have differed
        from them (the drift avoided)."""
        out = {f"agent/rejected_{kind}": float(n) for kind, n in self.rejections.items()}
        out.update({f"proxy/{k}": float(v) for k, v in self.proxy.routes.stats.items()})
        return out

    async def aevaluate(self, engine: InferenceEngine, rows: list[dict[str, Any]]) -> EvalReport:
        """One agent run per row, sampling as the agent asks; a rejected run scores 0."""
        t0 = time.perf_counter()
        gate = asyncio.Semaphore(self.eval_concurrency)

        async def one(row: dict[str, Any]) -> tuple[Trajectory | None, float]:
            async with gate:
                try:
                    return await self._episode(row)
                except EpisodeRejected:
                    return None, 0.0

        runs = await asyncio.gather(*(one(r) for r in rows))
        n = max(len(runs), 1)
        used_tools = sum(t is not None and any(s.metadata.get("tool_calls", 0) for s in t.samples)
                         for t, _ in runs)
        rejected = sum(t is None for t, _ in runs)
        metrics = {"eval/agent_reward": sum(r for _, r in runs) / n,
                   "eval/tool_call_frac": used_tools / n, "eval/rejected_frac": rejected / n,
                   "eval/num_problems": float(len(runs)),
                   "eval/seconds": time.perf_counter() - t0}
        return EvalReport(metrics["eval/agent_reward"], "agent reward", metrics,
                          f", tool calls in {used_tools / n:.0%}, rejected {rejected / n:.0%}")

    async def aclose(self) -> None:
        """Closes the agent runner (its HTTP client, its process pool, and an inline agent's
        own `aclose`), then stops the proxy server."""
        await self.runner.aclose()
        await self.proxy.stop()
