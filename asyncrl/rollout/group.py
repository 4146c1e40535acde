"""Groups for GRPO-style baselines out of workflows that produce one episode at a time.

`GroupedWorkflow(inner, n)` runs `inner.arun_episode` n times concurrently on the same data and
returns one trajectory holding all their samples, so the advantage estimator sees the group.
An episode that fails or is rejected leaves the group smaller; fewer than `min_size` survivors
rejects the whole group (a group of one has no baseline) with the first failure as the reason
(`EpisodeRejected`: the executor counts and logs it, rate-limited). A suspension for a checkpoint
suspends the whole group.

Evaluation, metrics and closing are the inner workflow's: evaluating runs it once per row.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from asyncrl.api import (Closable, EpisodeRejected, EpisodeSuspended, EvalReport, Evaluator,
                         InferenceEngine, ReportsMetrics, RolloutWorkflow, Trajectory)
from asyncrl.rollout.episode_eval import EpisodeEvaluator
from asyncrl.rollout.rejections import RejectionLog

log = logging.getLogger(__name__)


class GroupedWorkflow:
    """Makes a group for GRPO-style baselines out of a workflow that returns one episode at a
    time: each episode runs the inner workflow `n` times on the same row.

    Args:
        inner: the workflow to repeat.
        n: episodes per group (>= 1).
        min_size: the fewest surviving episodes that still form a group (1 <= min_size <= n).

    Raises:
        ValueError: `n` or `min_size` is out of range.
    """

    def __init__(self, inner: RolloutWorkflow, n: int, min_size: int = 2) -> None:
        if n < 1:
            raise ValueError(f"n={n} is out of range; allowed [1, inf)")
        if not 1 <= min_size <= n:
            raise ValueError(f"min_size={min_size} is out of range; allowed [1, n={n}]")
        self.inner, self.n, self.min_size = inner, n, min_size
        self.failures = RejectionLog(log)  # episodes lost from groups that still trained

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> Trajectory | None:
        """Runs the inner workflow `n` times concurrently on `data` and joins the results.

        An episode that raises or returns None leaves the group smaller; losses in a group that
        still trains are logged, rate-limited.

        Args:
            engine: the engine the inner episodes generate with.
            data: the data row, passed to every inner episode.

        Returns:
            One trajectory holding the samples of every surviving episode (`group_id`: the
            row's `id`, `metadata["episodes"]`: how many survived), or None when fewer than
            `min_size` survived and none failed (they were all rejected by returning None).

        Raises:
            EpisodeRejected: fewer than `min_size` episodes survived and at least one raised;
                the message gives the first failure, which is also the cause.
            EpisodeSuspended: an inner episode was suspended for a checkpoint (the whole group
                is); cancellation propagates the same way.
        """
        results = await asyncio.gather(
            *(self.inner.arun_episode(engine, data) for _ in range(self.n)), return_exceptions=True)
        trajs, failures = [], []
        for r in results:
            if isinstance(r, (asyncio.CancelledError, EpisodeSuspended)):
                raise r
            if isinstance(r, BaseException):
                failures.append(r)
            elif r is not None:
                trajs.append(r)
        first = _describe(failures[0]) if failures else ""
        if failures and len(trajs) >= self.min_size:
            self.failures.rejected(type(failures[0]).__name__, f"{len(failures)} of {self.n} "
                                   f"episodes of group {data.get('id')!r} were rejected or "
                                   f"failed: {first}", failures[0])
        if len(trajs) < self.min_size:
            if not failures:
                return None
            raise EpisodeRejected(
                f"{len(trajs)} of {self.n} episodes of group {data.get('id')!r} survived "
                f"(min_size {self.min_size}); first failure: {first}") from failures[0]
        samples = [s for t in trajs for s in t.samples]
        return Trajectory(samples, group_id=str(data.get("id", "")),
                          metadata={"episodes": len(trajs)})

    async def aevaluate(self, engine: InferenceEngine, rows: list[dict[str, Any]]) -> EvalReport:
        """Evaluates the inner workflow: its own `aevaluate` when it has one, else one inner
        episode per row, scored by mean reward (a failed or rejected episode scores 0).

        Args:
            engine: the engine serving the policy to evaluate.
            rows: the held-out data rows.

        Returns:
            The inner workflow's evaluation report.
        """
        inner = self.inner if isinstance(self.inner, Evaluator) else EpisodeEvaluator(self.inner)
        return await inner.aevaluate(engine, rows)

    def metrics(self) -> dict[str, float]:
        """Returns the inner workflow's metrics, or {} when it reports none."""
        return self.inner.metrics() if isinstance(self.inner, ReportsMetrics) else {}

    async def aclose(self) -> None:
        """Closes the inner workflow when it is `Closable`; otherwise does nothing."""
        if isinstance(self.inner, Closable):
            await self.inner.aclose()


def _describe(err: BaseException) -> str:
    return str(err) if isinstance(err, EpisodeRejected) else repr(err)
