"""Calling a reward function from a workflow or an eval, sync or async alike, off the event loop.

`RewardFn(completion_text, data) -> float` may be a coroutine function (a judge, a closure over
`RewardPool.score`) or a plain function. A plain function runs in a worker thread, because a slow
one (an HTTP verifier, a model call) would otherwise stall every rollout sharing the event loop;
only functions marked `@inline` (cheap pure checks such as `exact` and `digits`, microseconds
each) are called on the loop. `open_reward` hands out rewards already wrapped for a pool sized by
its config (`ThreadedReward`); `call_reward`'s own thread hop covers functions passed in as objects.

A reward may also score a whole group at once (`BatchRewardFn.score_batch`, e.g. the TRL adapter);
`call_rewards` uses that for the samples of one prompt and falls back to one call per sample.

A reward that raises is a bug or a bad row, never a silent 0: the error propagates as a
`RewardError` naming the reward and the row, with the original exception as its cause.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
import numbers
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, runtime_checkable

from asyncrl.errors import UserError

RewardFn = Callable[[str, dict[str, Any]], float | Awaitable[float]]

INLINE_ATTR = "__asyncrl_inline_reward__"


class RewardError(RuntimeError):
    """A reward function raised or returned something that is not a finite score."""


@runtime_checkable
class BatchRewardFn(Protocol):
    """A reward that scores the completions of one group in one call (same order as given)."""

    async def score_batch(self, completions: Sequence[str], rows: Sequence[dict[str, Any]],
                          completion_ids: Sequence[Sequence[int]] | None = None) -> list[float]:
        ...


def inline(fn: Callable[..., float]) -> Callable[..., float]:
    """Mark a cheap, pure, non-blocking sync reward to be called on the event loop directly."""
    setattr(fn, INLINE_ATTR, True)
    return fn


def is_inline(fn: Any) -> bool:
    return bool(getattr(fn, INLINE_ATTR, False))


def is_async(fn: Any) -> bool:
    """A coroutine function, or an object whose __call__ is one (JudgeReward, ThreadedReward)."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None))


def reward_name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def check_reward_call(fn: Any, setting: str) -> None:
    """UserError, before anything trains, when `fn` cannot be called as reward(completion, row)
    (a batched reward's `score_batch` is called otherwise); `setting` is where it was given."""
    if isinstance(fn, BatchRewardFn):
        return
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without one: the first call will tell
        return
    try:
        signature.bind("completion text", {"answer": "42"})
    except TypeError as err:
        raise UserError(
            f"{setting}: {reward_name(fn)}{signature} cannot be called as "
            f"reward(completion, row) ({err}); asyncrl passes the completion's text and the data "
            f"row (a dict: row['answer'] is its answer), e.g. "
            f"def {getattr(fn, '__name__', 'reward')}(completion, row) -> float") from None


def as_score(value: Any, fn: Any, data: dict[str, Any]) -> float:
    """`value` as a finite float, or a RewardError naming the reward and the row."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise RewardError(f"reward {reward_name(fn)} returned {value!r} on row "
                          f"id={data.get('id')!r}; expected a finite float")
    return float(value)


async def call_reward(fn: RewardFn, completion: str, data: dict[str, Any]) -> float:
    """Score one completion: awaited if async, inline if marked, else in a worker thread."""
    try:
        if is_inline(fn) or is_async(fn):
            out = fn(completion, data)
        else:
            out = await asyncio.to_thread(fn, completion, data)
        if inspect.isawaitable(out):
            out = await out
    except RewardError:
        raise
    except Exception as err:
        raise RewardError(f"reward {reward_name(fn)} raised {err!r} on row "
                          f"id={data.get('id')!r}") from err
    return as_score(out, fn, data)


async def call_rewards(fn: RewardFn, completions: Sequence[str], data: dict[str, Any],
                       completion_ids: Sequence[Sequence[int]] | None = None) -> list[float]:
    """Score the completions of one group for the same row, in order: one `score_batch` call
    when the reward batches, else concurrent `call_reward`s."""
    if isinstance(fn, BatchRewardFn):
        return await fn.score_batch(list(completions), [data] * len(completions), completion_ids)
    if is_inline(fn):  # no awaits in between: the loop sees exactly what one call did
        return [await call_reward(fn, c, data) for c in completions]
    return list(await asyncio.gather(*(call_reward(fn, c, data) for c in completions)))


class ThreadedReward:
    """A sync reward run on its own pool of `max_workers` threads, so many slow calls overlap
    without taking the threads asyncio lends to everything else (`asyncio.to_thread`)."""

    def __init__(self, fn: Callable[[str, dict[str, Any]], float], max_workers: int) -> None:
        self.fn = fn
        self.__qualname__ = reward_name(fn)
        self._executor = ThreadPoolExecutor(max_workers, thread_name_prefix="asyncrl-reward")

    async def __call__(self, completion: str, data: dict[str, Any]) -> float:
        loop = asyncio.get_running_loop()
        try:
            out = await loop.run_in_executor(self._executor,
                                             functools.partial(self.fn, completion, data))
        except Exception as err:
            raise RewardError(f"reward {self.__qualname__} raised {err!r} on row "
                              f"id={data.get('id')!r}") from err
        return as_score(out, self.fn, data)

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)


def answer_reward(check: Callable[[str, str], float], cheap: bool = False) -> RewardFn:
    """Adapt `check(response, reference_answer)` (e.g. exact_answer_reward) to a RewardFn;
    `cheap=True` marks it `inline` (called on the event loop)."""

    def reward(completion: str, data: dict[str, Any]) -> float:
        return check(completion, str(data["answer"]))

    reward.__qualname__ = reward_name(check)
    return inline(reward) if cheap else reward
