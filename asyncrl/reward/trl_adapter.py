"""TRL `GRPOTrainer` reward functions, unchanged, as an asyncrl reward.

TRL calls each reward function once per batch as
`f(prompts=..., completions=..., completion_ids=..., **columns)` -> list[float | None], where
`columns` are the dataset's other fields as lists, one entry per completion, plus `trainer_state`
(trl/trainer/grpo_trainer.py `_calculate_rewards`). In the conversational format a prompt is a
list of messages and a completion is `[{"role": "assistant", "content": text}]`; otherwise both
are strings. Here:
- conversational when the row has `messages` (asyncrl's chat rows; they are the prompt), else
  the row's `prompt` string and plain-string completions;
- columns: every row field but `prompt`, `messages`, `completion`, `completion_ids`;
  `trainer_state` is None (asyncrl has no HF TrainerState); completion_ids are the sampled
  token ids when the workflow has them (rlvr does), else None;
- one call per group of samples of a prompt (`score_batch`), a batch of one elsewhere;
- sync functions run on a thread pool, async ones are awaited on the loop;
- several functions: a weighted sum, where a None is skipped (TRL's nansum); a completion that
  every function scores None, or a wrong-length list, raises RewardError naming the function.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
import numbers
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from asyncrl.reward.call import RewardError, reward_name

NOT_COLUMNS = ("prompt", "messages", "completion", "completion_ids")


def trl_batch(completions: Sequence[str], rows: Sequence[dict[str, Any]],
              completion_ids: Sequence[Sequence[int]] | None) -> dict[str, Any]:
    """The keyword arguments TRL would pass for these completions of these rows."""
    conversational = all("messages" in row for row in rows)
    if conversational:
        prompts: list[Any] = [list(row["messages"]) for row in rows]
        outs: list[Any] = [[{"role": "assistant", "content": c}] for c in completions]
    else:
        prompts = [str(row.get("prompt", "")) for row in rows]
        outs = list(completions)
    keys = [k for k in rows[0] if k not in NOT_COLUMNS] if rows else []
    columns = {k: [row.get(k) for row in rows] for k in keys}
    ids = [list(x) for x in completion_ids] if completion_ids is not None else None
    return {"prompts": prompts, "completions": outs, "completion_ids": ids, **columns,
            "trainer_state": None}


def weighted_sum(per_function: list[list[float | None]], weights: Sequence[float],
                 names: Sequence[str], rows: Sequence[dict[str, Any]]) -> list[float]:
    """Per completion: sum of weight * score over the functions that gave one (TRL's nansum)."""
    out = []
    for i, scores in enumerate(zip(*per_function)):
        given = [(w, s) for w, s in zip(weights, scores) if s is not None]
        if not given:
            raise RewardError(f"TRL reward(s) {', '.join(names)} returned None for completion {i}"
                              f" of row id={rows[i].get('id')!r}: no function scored it")
        out.append(sum(w * float(s) for w, s in given))
    return out


class TRLReward:
    """Batched adapter over TRL-style reward functions (see the module docstring)."""

    def __init__(self, functions: Sequence[Callable[..., Any]],
                 weights: Sequence[float] | None = None, max_workers: int = 4) -> None:
        self.functions = list(functions)
        self.weights = list(weights) if weights is not None else [1.0] * len(self.functions)
        self.names = [reward_name(f) for f in self.functions]
        self.__qualname__ = f"trl({', '.join(self.names)})"
        self._executor = ThreadPoolExecutor(max_workers, thread_name_prefix="asyncrl-trl-reward")

    async def __call__(self, completion: str, row: dict[str, Any]) -> float:
        return (await self.score_batch([completion], [row]))[0]

    async def score_batch(self, completions: Sequence[str], rows: Sequence[dict[str, Any]],
                          completion_ids: Sequence[Sequence[int]] | None = None) -> list[float]:
        kwargs = trl_batch(completions, rows, completion_ids)
        results = await asyncio.gather(*(self._call(f, name, kwargs, rows) for f, name in
                                         zip(self.functions, self.names)))
        return weighted_sum(list(results), self.weights, self.names, rows)

    async def _call(self, fn: Callable[..., Any], name: str, kwargs: dict[str, Any],
                    rows: Sequence[dict[str, Any]]) -> list[float | None]:
        ids = [row.get("id") for row in rows]
        try:
            if inspect.iscoroutinefunction(fn):
                out = await fn(**kwargs)
            else:
                loop = asyncio.get_running_loop()
                out = await loop.run_in_executor(self._executor, functools.partial(fn, **kwargs))
        except Exception as err:
            raise RewardError(f"TRL reward {name} raised {err!r} on rows id={ids}") from err
        out = list(out) if isinstance(out, (list, tuple)) else out
        if not isinstance(out, list) or len(out) != len(rows):
            raise RewardError(f"TRL reward {name} returned {out!r} for {len(rows)} completions "
                              f"(rows id={ids}); expected a list of {len(rows)} floats or None")
        for value in out:
            if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)
                                      or not math.isfinite(value)):
                raise RewardError(f"TRL reward {name} returned {value!r} among {out!r} (rows "
                                  f"id={ids}); expected finite floats or None")
        return out

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
