"""A sync check run in a RewardPool's worker processes, as an async RewardFn.

For rewards that need a process's main thread, may hang, or run untrusted code: the user's
`executor: process` functions and the `code` reward. The check and its arguments must pickle.
A call that raises or crashes its worker raises `RewardError` with the worker's traceback (a bug
or a bad row is not a wrong answer); one over the pool's timeout scores 0.0, and the pool logs
and counts it. `outcomes` counts how calls ended: the pool's status, or the check's own note
("timeout", "wrong output", ...) when it returns (score, note) as the code reward does; with
the pool's worker restarts and mean latency they are its `metrics()`, which a training run logs
after every step (`reward/<name>/<outcome>`).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from typing import Any

from asyncrl.reward.call import RewardError
from asyncrl.reward.pool import RewardPool, RewardStatus

logger = logging.getLogger(__name__)

ArgsOf = Callable[[str, dict[str, Any]], tuple]


class PooledReward:
    def __init__(self, pool: RewardPool, check: Callable[..., Any], args_of: ArgsOf,
                 name: str) -> None:
        """`name`: the reward's (code, math, a function's path), in messages and metrics."""
        self.pool, self.check, self.args_of = pool, check, args_of
        self.__qualname__ = name
        self.outcomes: collections.Counter[str] = collections.Counter()

    def metrics(self) -> dict[str, float]:
        stats = self.pool.stats()
        out = {f"reward/{self.__qualname__}/{k}": float(v) for k, v in self.outcomes.items()}
        out[f"reward/{self.__qualname__}/worker_restarts"] = float(stats.worker_restarts)
        out[f"reward/{self.__qualname__}/latency_s"] = stats.mean_latency_seconds
        return out

    async def __call__(self, completion: str, row: dict[str, Any]) -> float:
        args = self.args_of(completion, row)
        outcome = await self.pool.score(self.check, *args)
        if outcome.status in (RewardStatus.ERROR, RewardStatus.CRASHED):
            self.outcomes[outcome.status.value] += 1
            raise RewardError(f"reward {self.__qualname__} {outcome.status.value} on row "
                              f"id={row.get('id')!r}:\n{outcome.error}")
        kind = outcome.status.value
        if outcome.note is not None:
            kind = outcome.note.partition(" (")[0]
            logger.debug("reward %s on row id=%r: %s", self.__qualname__, row.get("id"),
                         outcome.note)
        self.outcomes[kind] += 1
        return outcome.score
