"""A model-judged reward: ask a judge model about each completion, read a score from its reply.

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
import logging
import os
import re
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from asyncrl.errors import UserError

if TYPE_CHECKING:
    from asyncrl.reward.judge_config import JudgeRewardConfig

logger = logging.getLogger(__name__)


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
