"""The settings of `reward: {kind: judge, ...}`: which model judges, what it is asked, how its
reply becomes a score. Validated when the run config loads (the template's placeholders, the
regex, the judge's address), so a typo fails before any model is loaded.
"""

from __future__ import annotations

import contextlib
import re
import string
from collections.abc import Iterator
from typing import Any, Literal

import pydantic

from asyncrl.config import Config
from asyncrl.errors import UserError

PLACEHOLDERS = ("question", "answer", "completion")

DEFAULT_TEMPLATE = (
    "You grade answers to questions.\n"
    "Question: {question}\n"
    "Reference answer: {answer}\n"
    "Student answer: {completion}\n"
    "Is the student answer correct? Reply with 'Score: N' where N is 0 (wrong) to 10 (correct)."
)
DEFAULT_SCORE_REGEX = r"(?i)score\s*[:=]?\s*(-?\d+(?:\.\d+)?)"


def template_fields(template: str) -> list[str]:
    """The `{name}` placeholders of a str.format template (ValueError on malformed braces)."""
    return [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]


class JudgeRewardConfig(Config):
    """A model grades each completion; its reply is parsed into a score in [0, 1].

    The judge is an OpenAI-compatible server (`base_url` + `model`, the key read from the
    environment variable `api_key_env`) or the built-in engine on a local HF model directory
    (`model_path`, run in this process). `template` is the user message, with `{question}` (the
    row's last user message, or its `question` / `prompt` field), `{answer}` (the row's reference
    `answer`) and `{completion}`; write a literal brace as `{{`. The score is the first group of
    the first match of `score_regex` in the reply: a word found in `labels` (case-insensitive,
    e.g. {yes: 1, no: 0}) or a number, mapped from [score_min, score_max] to [0, 1] and clamped.
    A reply with no match is a failure: `on_unparseable: error` raises (the rollout is rejected
    and logged with the reply), `zero` scores 0.0, logs the reply and counts it.
    """

    # the reward (REWARDS: exact | digits | clevr_count_70k | math | function | trl | code | judge)
    kind: Literal["judge"] = "judge"
    base_url: str | None = None  # e.g. http://10.0.0.7:8000/v1
    model: str | None = None  # the served model's name (base_url)
    api_key_env: str | None = None  # name of the env var holding the key; None: no key
    model_path: str | None = None  # built-in engine in process on this HF model directory
    system_prompt: str | None = None
    template: str = DEFAULT_TEMPLATE
    score_regex: str = DEFAULT_SCORE_REGEX
    labels: dict[str, float] = {}
    score_min: float = 0.0
    score_max: float = 10.0
    on_unparseable: Literal["error", "zero"] = "error"
    max_tokens: int = pydantic.Field(64, ge=1)
    temperature: float = pydantic.Field(0.0, ge=0.0, le=2.0)  # 0: greedy, a repeatable grade
    max_concurrency: int = pydantic.Field(16, ge=1, le=4096)  # judge calls in flight at once
    timeout_seconds: float = pydantic.Field(120.0, gt=0)  # base_url: per request
    max_retries: int = pydantic.Field(2, ge=0, le=20)  # base_url: connection errors, 5xx, 429

    @pydantic.field_validator("template")
    @classmethod
    def _known_placeholders(cls, template: str) -> str:
        try:
            fields = template_fields(template)
        except ValueError as err:
            raise ValueError(f"template: malformed braces ({err}); write a literal brace as "
                             "'{{' or '}}'") from None
        unknown = sorted({f for f in fields if f not in PLACEHOLDERS})
        if unknown:
            raise ValueError(f"template placeholders {unknown} are unknown; allowed: "
                             + ", ".join("{" + p + "}" for p in PLACEHOLDERS))
        if "completion" not in fields:
            raise ValueError("template has no {completion}: the judge would not see what it "
                             "grades; allowed placeholders: {question}, {answer}, {completion}")
        return template

    @pydantic.field_validator("score_regex")
    @classmethod
    def _one_group(cls, pattern: str) -> str:
        try:
            compiled = re.compile(pattern)
        except re.error as err:
            raise ValueError(f"score_regex={pattern!r} does not compile: {err}") from None
        if compiled.groups < 1:
            raise ValueError(f"score_regex={pattern!r} has no group; allowed: a regex whose "
                             "first (...) group captures the score")
        return pattern

    @pydantic.model_validator(mode="after")
    def _one_judge(self) -> JudgeRewardConfig:
        if (self.base_url is None) == (self.model_path is None):
            raise ValueError("judge needs exactly one of base_url (an OpenAI-compatible server) "
                             f"or model_path (the built-in engine); got base_url={self.base_url!r}"
                             f", model_path={self.model_path!r}")
        if self.base_url is not None and not self.model:
            raise ValueError(f"judge base_url={self.base_url!r} needs model (the served model's "
                             "name)")
        if not self.score_min < self.score_max:
            raise ValueError(f"score_min={self.score_min} must be below score_max="
                             f"{self.score_max}")
        return self

    @contextlib.contextmanager
    def build(self, ctx: Any) -> Iterator[Any]:
        """The judge as a RewardFn: an OpenAI-compatible server's client, or the built-in
        engine the caller's `ctx.judge_engine` starts on `model_path`."""
        from asyncrl.reward.judge import JudgeReward, OpenAIJudgeClient

        if self.base_url is not None:
            yield JudgeReward(self, OpenAIJudgeClient(self))
            return
        if ctx.judge_engine is None:
            raise UserError(f"reward judge model_path={self.model_path!r} runs the built-in "
                            "engine, which this caller did not provide: open it with "
                            "asyncrl.launch.judge_engine.open_run_reward (asyncrl train / eval "
                            "do)")
        with ctx.judge_engine(self) as client:
            yield JudgeReward(self, client)
