"""Agent + Gym-like Environment episodes: the agent acts through the engine, the env rewards.

Each agent step that generated tokens becomes one training sample (exported individually) whose
reward is the discounted return from that step, G_t = r_t + discount * G_(t+1), so earlier actions
are credited for where they led. Environments and agents are built per episode by factories, so
thousands of episodes can run concurrently on one event loop without sharing state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pydantic

from asyncrl.api import Agent, Environment, InferenceEngine, Sample, Trajectory
from asyncrl.config import Config
from asyncrl.reward.returns import discounted_returns


class AgentEnvConfig(Config):
    max_steps: int = pydantic.Field(4, ge=1)
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
                reward=g, stop_reason=r.stop_reason, metadata={"step": t, "step_reward": rw})
            for t, (r, g, rw) in enumerate(zip(responses, returns, rewards)) if r is not None
        ]
        if not samples:
            return None  # the agent never used the model: nothing to train on
        return Trajectory(samples, group_id=str(data.get("id", "")),
                          metadata={"episode_return": returns[0], "steps": len(rewards)})
