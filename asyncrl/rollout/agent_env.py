"""Agent + Gym-like Environment episodes: the agent acts through the engine, the env rewards.

Each agent step that generated tokens becomes one training sample (exported individually) whose
reward is the discounted return from that step, G_t = r_t + discount * G_(t+1), so earlier actions
are credited for where they led. Environments and agents are built per episode by factories, so
thousands of episodes can run concurrently on one event loop without sharing state.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pydantic

from asyncrl.api import Agent, Environment, InferenceEngine, Sample, Trajectory
from asyncrl.config import Config
from asyncrl.reward.returns import discounted_returns


def per_episode(cls: Callable[..., Any], kwargs: dict[str, Any], injectable: dict[str, Any],
                what: str) -> Callable[[dict[str, Any]], Any]:
    """A factory `data -> object`: `cls(**kwargs, **what its signature asks of injectable,
    data=row if it takes data)`; a gymnasium Env with sync reset/step is wrapped (SyncEnv)."""
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        params = {}
    extra = {k: v for k, v in injectable.items() if k in params and k not in kwargs}

    def make(data: dict[str, Any]) -> Any:
        try:
            obj = cls(**kwargs, **extra, **({"data": data} if "data" in params else {}))
        except TypeError as err:
            raise TypeError(f"{what}: calling {cls!r} with {sorted(kwargs)} failed: {err}") \
                from err
        reset = getattr(obj, "reset", None)
        if callable(getattr(obj, "step", None)) and not inspect.iscoroutinefunction(reset):
            return SyncEnv(obj)
        return obj

    return make


class SyncEnv:
    """gymnasium's sync `reset`/`step` as the async ones Environment declares (called on the
    loop: a slow env should define async methods itself)."""

    def __init__(self, env: Any) -> None:
        self.env = env
        self.observation_space = getattr(env, "observation_space", None)
        self.action_space = getattr(env, "action_space", None)

    async def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None
                    ) -> tuple[Any, dict[str, Any]]:
        return self.env.reset(seed=seed, options=options)

    async def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        return self.env.step(action)


class AgentEnvConfig(Config):
    max_steps: int = pydantic.Field(4, ge=1)  # agent steps per episode, at most
    # each step's sample is rewarded with r_t + discount * G_(t+1)
    discount: float = pydantic.Field(1.0, ge=0.0, le=1.0)


class AgentEnvWorkflow:
    def __init__(self, agent_factory: Callable[[dict[str, Any]], Agent],
                 env_factory: Callable[[dict[str, Any]], Environment],
                 cfg: AgentEnvConfig | None = None) -> None:
        self.agent_factory, self.env_factory = agent_factory, env_factory
        self.cfg = cfg or AgentEnvConfig()

    async def arun_episode(self, engine: InferenceEngine,
                           data: dict[str, Any]) -> Trajectory | None:
        env, agent = self.env_factory(data), self.agent_factory(data)
        obs, _ = await env.reset(seed=data.get("seed"), options=data)
        await agent.reset()
        responses, rewards, infos = [], [], []
        for _ in range(self.cfg.max_steps):
            act = await agent.act(engine, obs)
            obs, reward, terminated, truncated, info = await env.step(act.action)
            responses.append(act.response)
            rewards.append(float(reward))
            infos.append(info)
            if terminated or truncated:
                break
        returns = discounted_returns(rewards, self.cfg.discount)
        samples = [
            Sample.from_prompt_and_completion(
                r.input_tokens, r.output_tokens, r.output_logprobs, r.output_versions,
                reward=g, stop_reason=r.stop_reason, metadata={"step": t, "step_reward": rw},
                routes=r.routes)
            for t, (r, g, rw) in enumerate(zip(responses, returns, rewards)) if r is not None
        ]
        if not samples:
            return None  # the agent never used the model: nothing to train on
        return Trajectory(samples, group_id=str(data.get("id", "")),
                          metadata={"episode_return": returns[0], "steps": len(rewards)})
