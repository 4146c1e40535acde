"""A model-judged reward: ask a judge model about each completion, read a score from its reply.

`reward: {kind: judge, ...}` is `JudgeRewardConfig`: which model judges, what it is asked, how
its reply becomes a score; validated when the run config loads (the template's placeholders, the
regex, the judge's address), so a typo fails before any model is loaded.

`JudgeReward(cfg, client)` is an async RewardFn: it fills the template from the row and the
completion, sends it through a `JudgeClient` with at most `cfg.max_concurrency` calls in flight,
and parses the reply (`parse_score`). Two clients: `OpenAIJudgeClient` (any OpenAI-compatible
server, the `openai` library's AsyncOpenAI) here, and the built-in engine in process, which the
launch layer builds (`asyncrl.launch.judge_engine`: this package sits below the inference one).

An unparseable reply is never a silent 0: it raises `JudgeReplyError` with the reply, which
rejects that rollout in the executor's log, or, with `on_unparseable: zero`, scores 0.0 with a
warning carrying the reply and is counted in `stats()`. `metrics()` (api.ReportsMetrics) puts
the counts and the latency into the run's metrics.jsonl after every training step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import string
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import pydantic

from asyncrl.config import Config
from asyncrl.errors import UserError

logger = logging.getLogger(__name__)

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


class JudgeReplyError(RuntimeError):
    """The judge's reply held no score that `score_regex` / `labels` could read."""


class JudgeClient(Protocol):
    async def complete(self, messages: list[dict[str, str]], cfg: JudgeRewardConfig) -> str:
        """The judge model's reply text to a chat."""
        ...


@dataclass(frozen=True)
class JudgeStats:
    calls: int
    unparseable: int
    mean_latency_seconds: float


def question_of(row: dict[str, Any]) -> str:
    """The row's question: its last user message, else its `question` or `prompt` field."""
    for message in reversed(row.get("messages") or []):
        if message.get("role") == "user":
            return str(message.get("content", ""))
    for key in ("question", "prompt"):
        if key in row:
            return str(row[key])
    return ""


def judge_messages(cfg: JudgeRewardConfig, completion: str,
                   row: dict[str, Any]) -> list[dict[str, str]]:
    values = {"question": question_of(row), "answer": str(row.get("answer", "")),
              "completion": completion}
    messages = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
    return [*messages, {"role": "user", "content": cfg.template.format(**values)}]


def parse_score(reply: str, cfg: JudgeRewardConfig) -> float | None:
    """The score in [0, 1] that `reply` gives, or None when it gives none."""
    match = re.search(cfg.score_regex, reply)
    if match is None or match.group(1) is None:
        return None
    text = match.group(1).strip()
    labels = {k.lower(): v for k, v in cfg.labels.items()}
    if text.lower() in labels:
        return min(max(labels[text.lower()], 0.0), 1.0)
    try:
        value = float(text)
    except ValueError:
        return None
    if value != value:  # NaN parses from "nan"; it is no score
        return None
    scaled = (value - cfg.score_min) / (cfg.score_max - cfg.score_min)
    return min(max(scaled, 0.0), 1.0)


class JudgeReward:
    """reward(completion, row) -> score in [0, 1] from the judge's reply."""

    def __init__(self, cfg: JudgeRewardConfig, client: JudgeClient) -> None:
        self.cfg, self.client = cfg, client
        self.__qualname__ = f"judge({cfg.model or cfg.model_path})"
        # One semaphore per event loop: an eval and a training run may each drive this reward
        # from their own loop, and an asyncio primitive belongs to one loop.
        self._limits: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._calls = self._unparseable = 0
        self._latency = 0.0
        self._reported = (0, 0.0)  # (calls, latency) at the previous metrics()

    async def __call__(self, completion: str, row: dict[str, Any]) -> float:
        messages = judge_messages(self.cfg, completion, row)
        start = time.monotonic()
        loop = asyncio.get_running_loop()
        limit = self._limits.setdefault(loop, asyncio.Semaphore(self.cfg.max_concurrency))
        async with limit:
            reply = await self.client.complete(messages, self.cfg)
        self._calls += 1
        self._latency += time.monotonic() - start
        score = parse_score(reply, self.cfg)
        if score is not None:
            return score
        self._unparseable += 1
        where = f"row id={row.get('id')!r}: judge reply {reply[:500]!r} has no score for " \
                f"score_regex={self.cfg.score_regex!r}"
        if self.cfg.on_unparseable == "error":
            raise JudgeReplyError(where)
        logger.warning("%s; scored 0.0 (on_unparseable: zero)", where)
        return 0.0

    def stats(self) -> JudgeStats:
        mean = self._latency / self._calls if self._calls else 0.0
        return JudgeStats(self._calls, self._unparseable, mean)

    def metrics(self) -> dict[str, float]:
        """Calls and unparseable replies so far; the mean latency of the calls since the
        previous `metrics()` (one training step's, in `asyncrl train`)."""
        calls, latency = self._calls - self._reported[0], self._latency - self._reported[1]
        self._reported = (self._calls, self._latency)
        return {"reward/judge_calls": float(self._calls),
                "reward/judge_unparseable": float(self._unparseable),
                "reward/judge_latency_s": latency / calls if calls else 0.0}


class OpenAIJudgeClient:
    """The judge behind any OpenAI-compatible `/v1/chat/completions` (vLLM, SGLang, asyncrl
    serve, a hosted API), through the `openai` library's AsyncOpenAI (retries, timeouts)."""

    def __init__(self, cfg: JudgeRewardConfig) -> None:
        self._key = "EMPTY"  # local servers without a key still need a non-empty one
        if cfg.api_key_env:
            self._key = os.environ.get(cfg.api_key_env, "")
            if not self._key:
                raise UserError(f"judge api_key_env={cfg.api_key_env!r}: that environment "
                                "variable is unset or empty")
        # A client per event loop: its connection pool belongs to the loop that opened it.
        self._clients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def _client(self, cfg: JudgeRewardConfig) -> Any:
        from openai import AsyncOpenAI

        loop = asyncio.get_running_loop()
        if loop not in self._clients:
            self._clients[loop] = AsyncOpenAI(base_url=cfg.base_url, api_key=self._key,
                                              timeout=cfg.timeout_seconds,
                                              max_retries=cfg.max_retries)
        return self._clients[loop]

    async def complete(self, messages: list[dict[str, str]], cfg: JudgeRewardConfig) -> str:
        resp = await self._client(cfg).chat.completions.create(
            model=cfg.model, messages=messages, max_tokens=cfg.max_tokens,
            temperature=cfg.temperature)
        return resp.choices[0].message.content or ""
