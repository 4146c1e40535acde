"""Agent workflows inside `asyncrl train`: the proxy in front of the rollout engines, the agent
run `gconfig.n_samples` times per prompt, and evaluation by running the agent on held-out rows.

Evaluation reports the agent's own reward (`eval/agent_reward`: its float result, or the sum of a
dict), the fraction of episodes with at least one well-formed tool call, and the rejected fraction;
a rejected episode scores 0. The agent samples with whatever parameters it asks for.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from asyncrl.api import InferenceEngine, Trajectory
from asyncrl.errors import UserError
from asyncrl.proxy.config import AgentConfig
from asyncrl.proxy.server import ProxyServer
from asyncrl.proxy.workflow import AgentWorkflow


def build_agent_workflow(cfg: AgentConfig, agent: Any, engine: InferenceEngine, tokenizer: Any,
                         context_length: int | None) -> AgentWorkflow:
    spec = agent if agent is not None else cfg.path
    if spec is None:
        raise UserError("workflow.kind=agent needs workflow.path (package.module:AgentClass) or "
                        "an agent object passed to run_train_job(agent=...)")
    try:
        proxy = ProxyServer(engine, tokenizer, cfg.proxy, context_length=context_length)
        return AgentWorkflow(spec, proxy, cfg)
    except ValueError as err:
        raise UserError(f"workflow.path: {err}") from err


def episode_reward(traj: Trajectory | None) -> float:
    if traj is None:
        return 0.0
    result = traj.metadata.get("agent_result", 0.0)
    return float(sum(result.values())) if isinstance(result, dict) else float(result)


def used_tools(traj: Trajectory | None) -> bool:
    return traj is not None and any(s.metadata.get("tool_calls", 0) for s in traj.samples)


async def evaluate_agent(workflow: AgentWorkflow, engine: InferenceEngine,
                         rows: list[dict[str, Any]], concurrency: int) -> dict[str, float]:
    t0 = time.perf_counter()
    gate = asyncio.Semaphore(concurrency)

    async def one(row: dict[str, Any]) -> Trajectory | None:
        async with gate:
            return await workflow.arun_episode(engine, row)

    trajs = await asyncio.gather(*(one(r) for r in rows))
    n = max(len(trajs), 1)
    return {"eval/agent_reward": sum(map(episode_reward, trajs)) / n,
            "eval/tool_call_frac": sum(map(used_tools, trajs)) / n,
            "eval/rejected_frac": sum(t is None for t in trajs) / n,
            "eval/num_problems": float(len(trajs)),
            "eval/seconds": time.perf_counter() - t0}
