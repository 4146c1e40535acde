"""The typed forms of a run's `reward`, and the string shorthands that name them.

```yaml
reward: exact                       # built-ins: exact, digits, math, code
reward: my_pkg.rewards:score        # your reward(completion, row) -> float, sync or async
reward: trl:my_pkg.rewards:fmt      # a TRL GRPOTrainer reward function, unchanged
reward: {kind: judge, base_url: http://..., model: judge-model}   # see reward/judge.py
reward: {kind: function, path: my_pkg.rewards:score, executor: process, max_workers: 4}
reward: {kind: code, tests_field: tests, limits: {wall_seconds: 5}}
```

A string is kept as written in the run config (so saved configs stay short); `reward_config`
turns it into the typed form, and the run config validates it that way at load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import pydantic
import yaml

from asyncrl.config import Config, ConfigError, load_yaml
from asyncrl.reward.judge_config import JudgeRewardConfig
from asyncrl.reward.sandbox import SandboxLimits

BUILTIN_NAMES = ("exact", "digits", "math", "code")
TRL_PREFIX = "trl:"


class BuiltinRewardConfig(Config):
    """exact / digits: cheap checks on the event loop; math: math-verify in a process pool."""

    kind: Literal["exact", "digits", "math"] = "exact"


class FunctionRewardConfig(Config):
    """Your `reward(completion, row) -> float`. A sync one runs off the event loop: on a pool of
    `max_workers` threads, or (executor: process) in a RewardPool of that many worker processes
    (for functions that need a main thread or may hang; they must pickle, and a call over
    `timeout_seconds` scores 0.0 and is counted). Async functions are awaited on the loop."""

    kind: Literal["function"] = "function"
    path: str = pydantic.Field(description="package.module:function")
    executor: Literal["thread", "process"] = "thread"
    max_workers: int = pydantic.Field(8, ge=1, le=1024)
    timeout_seconds: float = pydantic.Field(60.0, gt=0)  # executor: process


class TRLRewardConfig(Config):
    """TRL GRPOTrainer reward functions `f(prompts, completions, completion_ids, **columns)`,
    called once per group; several are summed with `weights` (None entries skipped, as TRL)."""

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


class CodeRewardConfig(Config):
    """Run the completion's program on the row's tests in the sandbox: 1.0 when all pass.

    The row's `tests_field` holds a list of {"input": stdin, "output": expected stdout}, or that
    list as a JSON string, or the APPS / TACO `{"inputs": [...], "outputs": [...]}` form (as a
    dict or JSON string). Each test runs under `limits`; the RewardPool's `timeout_seconds` is
    the outer bound of one whole completion."""

    kind: Literal["code"] = "code"
    tests_field: str = "tests"
    limits: SandboxLimits = SandboxLimits()
    num_workers: int = pydantic.Field(2, ge=1, le=1024)
    timeout_seconds: float = pydantic.Field(120.0, gt=0)


RewardConfig = Annotated[BuiltinRewardConfig | FunctionRewardConfig | TRLRewardConfig
                         | CodeRewardConfig | JudgeRewardConfig,
                         pydantic.Field(discriminator="kind")]

_ADAPTER: pydantic.TypeAdapter = pydantic.TypeAdapter(RewardConfig)
ALLOWED = ("exact, digits, math, code, judge (a mapping: {kind: judge, ...}), "
           "'package.module:function' or 'trl:package.module:function'")


def reward_config(spec: str | Any) -> Any:
    """The typed reward config for `spec`: a name, a dotted path, 'trl:<path>', a mapping with a
    `kind`, or an already typed config. Raises ConfigError (one line) on anything else."""
    if isinstance(spec, Config):
        return spec
    if isinstance(spec, dict):
        return _validate(spec)
    if not isinstance(spec, str):
        raise ConfigError(f"reward={spec!r}: expected a name or a mapping; allowed: {ALLOWED}")
    if spec in BUILTIN_NAMES:
        return _validate({"kind": spec})
    if spec == "judge":
        raise ConfigError("reward='judge' needs its settings: reward: {kind: judge, base_url: ..."
                          ", model: ...} or {kind: judge, model_path: ...} (see reward/judge.py)")
    if spec.startswith(TRL_PREFIX):
        return _validate({"kind": "trl", "functions": [spec[len(TRL_PREFIX):]]})
    if ":" in spec or "." in spec:
        return _validate({"kind": "function", "path": spec})
    raise ConfigError(f"reward {spec!r}: unknown; allowed: {ALLOWED}")


def _validate(data: dict[str, Any]) -> Any:
    kind = data.get("kind")
    if kind is None:
        raise ConfigError(f"reward={data!r}: a mapping needs a 'kind'; allowed: exact, digits, "
                          "math, code, function, trl, judge")
    try:
        return _ADAPTER.validate_python(data)
    except pydantic.ValidationError as err:
        # loc[0] is the union's tag (the kind), already named in the message
        problems = "; ".join(_where(e) + e["msg"].removeprefix("Value error, ")
                             for e in err.errors())
        raise ConfigError(f"reward kind={kind!r}: {problems}") from None


def _where(error: Any) -> str:
    loc = ".".join(str(p) for p in error["loc"][1:])
    if not loc:
        return ""
    # our own validators name the value already; pydantic's messages do not
    value = "" if error["type"] == "value_error" else f"={error.get('input')!r}"
    return f"{loc}{value}: "


def reward_spec_from_cli(text: str) -> str | dict[str, Any]:
    """`asyncrl eval --reward`: a name or path as is, a YAML/JSON file, or an inline mapping
    ('{kind: judge, base_url: ...}')."""
    stripped = text.strip()
    if stripped.startswith("{"):
        try:
            data = yaml.safe_load(stripped)
        except yaml.YAMLError as err:
            raise ConfigError(f"--reward {text!r}: malformed YAML mapping: {err}") from None
        reward_config(data)
        return data
    if stripped.endswith((".yaml", ".yml", ".json")) and Path(stripped).is_file():
        data = load_yaml(stripped)
        data = data.get("reward", data) if isinstance(data.get("reward"), dict) else data
        reward_config(data)
        return data
    reward_config(stripped)
    return stripped
