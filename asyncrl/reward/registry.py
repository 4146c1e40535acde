"""Reward functions by name, for configs and the command line.

`reward: exact` (the final number must equal the answer), `reward: digits` (exact, or
partial credit for matching digit places), `reward: math` (math-verify, run in a
reward process pool because it needs a main thread and may hang on odd input), or a dotted path
`package.module:function` to the user's own `reward(completion_text, row) -> float` (sync or async).
Each name opens a context manager, so rewards that own processes shut them down with the run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from asyncrl.errors import UserError
from asyncrl.imports import import_object
from asyncrl.reward.call import RewardFn, answer_reward


@contextlib.contextmanager
def exact_reward() -> Iterator[RewardFn]:
    from asyncrl.reward.exact import exact_answer_reward

    yield answer_reward(exact_answer_reward)


@contextlib.contextmanager
def digits_reward() -> Iterator[RewardFn]:
    from asyncrl.reward.exact import digit_match_reward

    yield answer_reward(digit_match_reward)


@contextlib.contextmanager
def math_reward() -> Iterator[RewardFn]:
    """math-verify in a RewardPool: it needs a main thread (SIGALRM) and may hang on odd input."""
    from asyncrl.reward.math_verify import math_answer_reward
    from asyncrl.reward.pool import RewardPool, RewardPoolConfig

    with RewardPool(RewardPoolConfig(preload=["asyncrl.reward.math_verify"])) as pool:
        async def reward(completion: str, row: dict[str, Any]) -> float:
            return (await pool.score(math_answer_reward, completion, str(row["answer"]))).score

        yield reward


REWARDS: dict[str, Callable[[], contextlib.AbstractContextManager[RewardFn]]] = {
    "exact": exact_reward,
    "digits": digits_reward,
    "math": math_reward,
}


@contextlib.contextmanager
def _user_reward(path: str) -> Iterator[RewardFn]:
    fn = import_object(path, "reward")
    if not callable(fn):
        raise UserError(f"reward {path!r} is not callable; expected reward(completion, row)")
    yield fn


def open_reward(spec: str) -> contextlib.AbstractContextManager[RewardFn]:
    """The reward named by `spec`: a key of REWARDS or a dotted path."""
    if spec in REWARDS:
        return REWARDS[spec]()
    if ":" in spec or "." in spec:
        return _user_reward(spec)
    raise UserError(f"reward {spec!r}: unknown; allowed: {', '.join(REWARDS)} or "
                    "'package.module:function'")
