"""Rewards by name or typed config, for configs and the command line (`open_reward`).

`exact` (the final number must equal the answer) and `digits` (exact, or partial credit for
matching digit places) are cheap pure checks marked `inline`: they run on the event loop.
`math` (math-verify) and `code` (the row's tests in the sandbox) run in a RewardPool of worker
processes. A user's function (`package.module:function`) runs on a thread pool, or a process pool
(`executor: process`); `trl:package.module:function` adapts a TRL GRPOTrainer reward function;
`{kind: judge, ...}` asks a judge model. The forms are in `asyncrl.reward.config`.

Each reward opens as a context manager, so rewards that own threads, processes or an engine shut
them down with the run. A judge on the built-in engine (`model_path`) needs `judge_engine`, the
factory the launch layer passes (`asyncrl.launch.judge_engine`), since the inference package sits
above this one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from asyncrl.errors import UserError
from asyncrl.imports import import_object
from asyncrl.reward.call import RewardFn, ThreadedReward, answer_reward, is_async
from asyncrl.reward.config import (BuiltinRewardConfig, CodeRewardConfig, FunctionRewardConfig,
                                   TRLRewardConfig, reward_config)
from asyncrl.reward.judge_config import JudgeRewardConfig

JudgeEngineFactory = Callable[[JudgeRewardConfig], contextlib.AbstractContextManager[Any]]


@contextlib.contextmanager
def exact_reward() -> Iterator[RewardFn]:
    from asyncrl.reward.exact import exact_answer_reward

    # inline: microseconds of regex work; off-loop calls would cost more than they save and
    # would reorder nothing, so the default job's curve stays as it was
    yield answer_reward(exact_answer_reward, cheap=True)


@contextlib.contextmanager
def digits_reward() -> Iterator[RewardFn]:
    from asyncrl.reward.exact import digit_match_reward

    yield answer_reward(digit_match_reward, cheap=True)


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
def code_reward(cfg: CodeRewardConfig | None = None) -> Iterator[RewardFn]:
    """The completion's program against the row's `tests_field`, in sandboxes in worker
    processes (each blocks for up to limits.wall_seconds per test)."""
    from asyncrl.reward.code import code_reward_with_note, row_tests
    from asyncrl.reward.pool import RewardPool, RewardPoolConfig
    from asyncrl.reward.pooled import PooledReward

    cfg = cfg or CodeRewardConfig()
    pool_cfg = RewardPoolConfig(num_workers=cfg.num_workers, timeout_seconds=cfg.timeout_seconds,
                                preload=["asyncrl.reward.code"])
    with RewardPool(pool_cfg) as pool:
        yield PooledReward(pool, code_reward_with_note,
                           lambda text, row: (text, row_tests(row, cfg.tests_field), cfg.limits),
                           "code")


@contextlib.contextmanager
def _function_reward(cfg: FunctionRewardConfig) -> Iterator[RewardFn]:
    fn = import_object(cfg.path, "reward")
    if not callable(fn):
        raise UserError(f"reward {cfg.path!r} is not callable; expected reward(completion, row)")
    if is_async(fn):
        yield fn  # async: awaited on the loop; its own awaits are what keep the loop free
    elif cfg.executor == "thread":
        threaded = ThreadedReward(fn, cfg.max_workers)
        try:
            yield threaded
        finally:
            threaded.close()
    else:
        from asyncrl.reward.pool import RewardPool, RewardPoolConfig
        from asyncrl.reward.pooled import PooledReward

        module = cfg.path.partition(":")[0] if ":" in cfg.path else cfg.path.rpartition(".")[0]
        pool_cfg = RewardPoolConfig(num_workers=cfg.max_workers, preload=[module],
                                    timeout_seconds=cfg.timeout_seconds)
        with RewardPool(pool_cfg) as pool:
            yield PooledReward(pool, fn, lambda text, row: (text, row), cfg.path)


@contextlib.contextmanager
def _trl_reward(cfg: TRLRewardConfig) -> Iterator[RewardFn]:
    from asyncrl.reward.trl_adapter import TRLReward

    functions = [import_object(path, "TRL reward") for path in cfg.functions]
    reward = TRLReward(functions, cfg.weights, cfg.max_workers)
    try:
        yield reward
    finally:
        reward.close()


@contextlib.contextmanager
def _judge_reward(cfg: JudgeRewardConfig,
                  judge_engine: JudgeEngineFactory | None) -> Iterator[RewardFn]:
    from asyncrl.reward.judge import JudgeReward, OpenAIJudgeClient

    if cfg.base_url is not None:
        yield JudgeReward(cfg, OpenAIJudgeClient(cfg))
        return
    if judge_engine is None:
        raise UserError(f"reward judge model_path={cfg.model_path!r} runs the built-in engine, "
                        "which this caller did not provide: open it with "
                        "asyncrl.launch.judge_engine.open_run_reward (asyncrl train / eval do)")
    with judge_engine(cfg) as client:
        yield JudgeReward(cfg, client)


def open_reward(spec: Any, *, judge_engine: JudgeEngineFactory | None = None
                ) -> contextlib.AbstractContextManager[RewardFn]:
    """The reward `spec` names: a built-in name, 'package.module:function',
    'trl:package.module:function', a mapping with a `kind`, or a typed config. Unknown names
    raise a one-line UserError listing the allowed ones."""
    cfg = reward_config(spec)
    openers: dict[type, Callable[[Any], contextlib.AbstractContextManager[RewardFn]]] = {
        BuiltinRewardConfig: lambda c: REWARDS[c.kind](),
        CodeRewardConfig: code_reward,
        FunctionRewardConfig: _function_reward,
        TRLRewardConfig: _trl_reward,
        JudgeRewardConfig: lambda c: _judge_reward(c, judge_engine),
    }
    return openers[type(cfg)](cfg)
