"""Calling a user's reward function from a workflow or an eval, sync or async alike.

`RewardFn(completion_text, data) -> float` may be a plain function (cheap checks such as the exact
answer) or a coroutine function (e.g. a closure over `RewardPool.score` for sandboxed or
math-verify rewards that must not block the event loop or hang the run).
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any

RewardFn = Callable[[str, dict[str, Any]], float | Awaitable[float]]


async def call_reward(fn: RewardFn, completion: str, data: dict[str, Any]) -> float:
    out = fn(completion, data)
    if inspect.isawaitable(out):
        out = await out
    return float(out)


def answer_reward(check: Callable[[str, str], float]) -> RewardFn:
    """Adapt `check(response, reference_answer)` (e.g. exact_answer_reward) to a RewardFn."""

    def reward(completion: str, data: dict[str, Any]) -> float:
        return check(completion, str(data["answer"]))

    return reward
