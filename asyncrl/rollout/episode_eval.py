"""The evaluation every workflow gets: run it once per held-out row and average the rewards.

Used for a workflow (or `eval_workflow`) that does not bring its own `aevaluate`. The score of a
row is the mean reward of the samples its episode returned; a rejected or failed episode scores 0
and is counted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from asyncrl.api import EvalReport, InferenceEngine, RolloutWorkflow, Trajectory

log = logging.getLogger(__name__)


class EpisodeEvaluator:
    def __init__(self, workflow: RolloutWorkflow, concurrency: int = 256) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency={concurrency} is out of range; allowed [1, inf)")
        self.workflow, self.concurrency = workflow, concurrency

    async def aevaluate(self, engine: InferenceEngine, rows: list[dict[str, Any]]) -> EvalReport:
        t0 = time.perf_counter()
        gate = asyncio.Semaphore(self.concurrency)

        async def one(row: dict[str, Any]) -> Trajectory | None:
            async with gate:
                try:
                    return await self.workflow.arun_episode(engine, row)
                except Exception:  # boundary: a failed eval episode scores 0 and is counted
                    log.exception("eval episode failed on data id=%s", row.get("id"))
                    return None

        trajs = await asyncio.gather(*(one(r) for r in rows))
        scores = [sum(t.rewards) / len(t.rewards) if t is not None else 0.0 for t in trajs]
        n = max(len(rows), 1)
        rejected = sum(t is None for t in trajs)
        metrics = {"eval/reward": sum(scores) / n, "eval/rejected_frac": rejected / n,
                   "eval/num_problems": float(len(rows)),
                   "eval/seconds": time.perf_counter() - t0}
        return EvalReport(metrics["eval/reward"], "mean reward", metrics,
                          f", rejected {rejected / n:.0%}")
