"""The reward kinds a config names, each a config whose `build(ctx)` opens the reward: the `REWARDS`
registry (asyncrl/plugins.py).

```yaml
reward: exact                       # built-ins: exact, digits, clevr_count_70k, math, code
reward: my_pkg.rewards:score        # your reward(completion, row) -> float, sync or async
reward: trl:my_pkg.rewards:fmt      # a TRL GRPOTrainer reward function, unchanged
reward: {kind: judge, base_url: http://..., model: judge-model}   # see reward/judge.py
reward: {kind: function, path: my_pkg.rewards:score, executor: process, max_workers: 4}
reward: {kind: code, tests_field: tests, limits: {wall_seconds: 5}}
```

`exact` (the final number must equal the answer), `digits` (exact, or partial credit for
matching digit places) and `clevr_count_70k` (the count in square brackets, else the final number:
reward/exact.py) are cheap pure checks marked inline: they run on the event loop. `math`
(math-verify) and `code` (the row's tests in the sandbox) run in a RewardPool of worker
processes. A user's function runs on a thread pool or (`executor: process`) a process pool;
`trl:` adapts a TRL GRPOTrainer reward function; `judge` asks a model.

`build(ctx)` returns a context manager that yields the `RewardFn` and, on exit, shuts down what it
started (pools, a judge's engine). A judge on the built-in engine (`model_path`) needs
`ctx.judge_engine`, the factory the launch layer passes (asyncrl/launch/judge_engine.py), since
the inference package sits above this one. A kind of your own: a config class with `kind` and
`build`, then `REWARDS.register(YourConfig)`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pydantic
import yaml

from asyncrl.config import Config, ConfigError, load_yaml
from asyncrl.errors import UserError
from asyncrl.imports import import_object
from asyncrl.plugins import Registry
from asyncrl.reward.call import RewardFn
from asyncrl.reward.judge import JudgeRewardConfig
from asyncrl.reward.sandbox import SandboxLimits

TRL_PREFIX = "trl:"
JudgeEngineFactory = Callable[[JudgeRewardConfig], contextlib.AbstractContextManager[Any]]


@dataclass(frozen=True)
class RewardContext:
    """What the caller has that a reward may need to open."""

    judge_engine: JudgeEngineFactory | None = None  # a judge's built-in engine (`model_path`)


class BuiltinRewardConfig(Config):
    """exact / digits / clevr_count_70k: cheap checks on the event loop; math: math-verify in a
    process pool."""

    # the reward (REWARDS: exact | digits | clevr_count_70k | math | function | trl | code | judge)
    kind: Literal["exact", "digits", "clevr_count_70k", "math"] = "exact"

    @contextlib.contextmanager
    def build(self, ctx: RewardContext) -> Iterator[RewardFn]:
        from asyncrl.reward.call import answer_reward

        if self.kind == "math":  # it needs a main thread (SIGALRM) and may hang on odd input
            from asyncrl.reward.math_verify import math_answer_reward

            yield from _pooled(math_answer_reward, lambda text, row: (text, str(row["answer"])),
                               "math", preload=["asyncrl.reward.math_verify"])
            return
        from asyncrl.reward.exact import CHEAP_CHECKS

        # inline: microseconds of regex work; off-loop calls would cost more than they save
        yield answer_reward(CHEAP_CHECKS[self.kind], cheap=True)


class FunctionRewardConfig(Config):
    """Your `reward(completion, row) -> float`. A sync one runs off the event loop: on a pool of
    `max_workers` threads, or (executor: process) in a RewardPool of that many worker processes
    (for functions that need a main thread or may hang; they must pickle, and a call over
    `timeout_seconds` scores 0.0 and is counted). Async functions are awaited on the loop."""

    # the reward (REWARDS: exact | digits | clevr_count_70k | math | function | trl | code | judge)
    kind: Literal["function"] = "function"
    path: str = pydantic.Field(description="package.module:function")
    executor: Literal["thread", "process"] = "thread"
    max_workers: int = pydantic.Field(8, ge=1, le=1024)
    timeout_seconds: float = pydantic.Field(60.0, gt=0)  # executor: process

    @contextlib.contextmanager
    def build(self, ctx: RewardContext) -> Iterator[RewardFn]:
        from asyncrl.reward.call import ThreadedReward, check_reward_call, is_async

        fn = import_object(self.path, "reward")
        if not callable(fn):
            raise UserError(f"reward {self.path!r} is not callable; expected "
                            "reward(completion, row)")
        check_reward_call(fn, f"reward={self.path}")
        if is_async(fn):
            yield fn  # awaited on the loop; its own awaits are what keep the loop free
        elif self.executor == "thread":
            with contextlib.closing(ThreadedReward(fn, self.max_workers)) as threaded:
                yield threaded
        else:
            module = self.path.partition(":")[0] if ":" in self.path \
                else self.path.rpartition(".")[0]
            yield from _pooled(fn, lambda text, row: (text, row), self.path, preload=[module],
                               num_workers=self.max_workers, timeout_seconds=self.timeout_seconds)


class TRLRewardConfig(Config):
    """TRL GRPOTrainer reward functions `f(prompts, completions, completion_ids, **columns)`,
    called once per group; several are summed with `weights` (None entries skipped, as TRL)."""

    # the reward (REWARDS: exact | digits | clevr_count_70k | math | function | trl | code | judge)
    kind: Literal["trl"] = "trl"
    functions: list[str] = pydantic.Field(min_length=1, description="package.module:function")
    weights: list[float] | None = None
    max_workers: int = pydantic.Field(4, ge=1, le=1024)  # threads for sync functions

    @pydantic.model_validator(mode="after")
    def _weights_match(self) -> TRLRewardConfig:
        if self.weights is not None and len(self.weights) != len(self.functions):
            raise ValueError(f"weights={self.weights} has {len(self.weights)} entries; allowed: "
                             f"one per function ({len(self.functions)})")
        return self

    @contextlib.contextmanager
    def build(self, ctx: RewardContext) -> Iterator[RewardFn]:
        from asyncrl.reward.trl_adapter import TRLReward

        functions = [import_object(path, "TRL reward") for path in self.functions]
        with contextlib.closing(TRLReward(functions, self.weights, self.max_workers)) as reward:
            yield reward


class CodeRewardConfig(Config):
    """Run the completion's program on the row's tests in the sandbox: 1.0 when all pass.

    The row's `tests_field` holds a list of {"input": stdin, "output": expected stdout}, or that
    list as a JSON string, or the APPS / TACO `{"inputs": [...], "outputs": [...]}` form (as a
    dict or JSON string). Each test runs under `limits`; the RewardPool's `timeout_seconds` is
    the outer bound of one whole completion."""

    # the reward (REWARDS: exact | digits | clevr_count_70k | math | function | trl | code | judge)
    kind: Literal["code"] = "code"
    tests_field: str = "tests"
    limits: SandboxLimits = SandboxLimits()
    num_workers: int = pydantic.Field(2, ge=1, le=1024)
    timeout_seconds: float = pydantic.Field(120.0, gt=0)

    @contextlib.contextmanager
    def build(self, ctx: RewardContext) -> Iterator[RewardFn]:
        """The completion's program against the row's tests, in sandboxes in worker processes
        (each blocks for up to limits.wall_seconds per test)."""
        from asyncrl.reward.code import code_reward_with_note, row_tests

        yield from _pooled(code_reward_with_note, lambda text, row: (
            text, row_tests(row, self.tests_field), self.limits), "code",
            preload=["asyncrl.reward.code"], num_workers=self.num_workers,
            timeout_seconds=self.timeout_seconds)


def _pooled(fn: Callable[..., Any], args: Callable[[str, Any], tuple], name: str,
            **pool: Any) -> Iterator[RewardFn]:
    """`fn(*args(text, row))` in the worker processes of a RewardPool(RewardPoolConfig(**pool))."""
    from asyncrl.reward.pool import RewardPool, RewardPoolConfig
    from asyncrl.reward.pooled import PooledReward

    with RewardPool(RewardPoolConfig(**pool)) as rewards:
        yield PooledReward(rewards, fn, args, name)


def _shorthand(spec: str) -> dict[str, Any]:
    """A string that is not a kind's name: 'trl:<path>' or a dotted path to a function."""
    if spec.startswith(TRL_PREFIX):
        return {"kind": "trl", "functions": [spec[len(TRL_PREFIX):]]}
    if ":" in spec or "." in spec:
        return {"kind": "function", "path": spec}
    raise ConfigError(f"reward {spec!r}: unknown; allowed: {', '.join(REWARDS.kinds())}, "
                      "'package.module:function' or 'trl:package.module:function'")


REWARDS: Registry = Registry("reward", shorthand=_shorthand)
for _cls in (BuiltinRewardConfig, FunctionRewardConfig, TRLRewardConfig, CodeRewardConfig,
             JudgeRewardConfig):
    REWARDS.register(_cls)

RewardConfig = REWARDS.field()


def open_reward(spec: Any, *, judge_engine: JudgeEngineFactory | None = None
                ) -> contextlib.AbstractContextManager[RewardFn]:
    """The reward `spec` names (a name, a dotted path, 'trl:<path>', a mapping with a `kind`, or
    a typed config), opened; unknown names raise a one-line ConfigError naming the allowed ones."""
    return REWARDS.parse(spec).build(RewardContext(judge_engine))


def reward_spec_from_cli(text: str) -> str | dict[str, Any]:
    """`asyncrl eval --reward`: a name or path as is, a YAML/JSON file, or an inline mapping
    ('{kind: judge, base_url: ...}')."""
    stripped = text.strip()
    if stripped.startswith("{"):
        try:
            data = yaml.safe_load(stripped)
        except yaml.YAMLError as err:
            raise ConfigError(f"--reward {text!r}: malformed YAML mapping: {err}") from None
        REWARDS.parse(data)
        return data
    if stripped.endswith((".yaml", ".yml", ".json")) and Path(stripped).is_file():
        data = load_yaml(stripped)
        data = data.get("reward", data) if isinstance(data.get("reward"), dict) else data
        REWARDS.parse(data)
        return data
    REWARDS.parse(stripped)
    return stripped
