"""What the proxy keeps per completion and per session: the exact training data, nothing derived."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from asyncrl.api import Sample, StopReason
from asyncrl.api.images import ImageInputs
from asyncrl.inference.responses_api import ResponseMemory
from asyncrl.proxy.errors import NotFoundError


@dataclass
class Completion:
    """One sampled choice: the token ids the engine saw and produced, with logprobs and versions."""

    id: str
    turn: int  # index of the request within its session (choices of one request share it)
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    stop_reason: StopReason
    messages: list[dict[str, Any]] | None  # chat input, normalised (None for /v1/completions)
    tools: list[dict[str, Any]] | None
    message: dict[str, Any]  # what the client got back: the assistant message or {"text": ...}
    parent: str | None = None  # the completion whose prompt + output this prompt starts with
    retokenize_drift: int = 0  # prompt positions where re-rendering the chat would differ
    # the chat template variables the prompt was rendered with (a later turn reuses this
    # prompt only when rendered with the same ones)
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    images: ImageInputs | None = None  # the prompt's images (every one of the conversation)
    routes: Any = None  # the engine's routes of prompt + output (ModelResponse.routes)

    def sample(self, reward: float) -> Sample:
        sample = Sample.from_prompt_and_completion(
            self.prompt_ids, self.output_ids, self.logprobs, self.versions, reward=reward,
            stop_reason=self.stop_reason,
            metadata={"completion_id": self.id, "turn": self.turn, "tool_calls": self.tool_calls},
            routes=self.routes)
        sample.images = self.images
        return sample

    @property
    def tool_calls(self) -> int:
        """Well-formed tool calls in the reply (the proxy parsed them into `tool_calls`)."""
        return len(self.message.get("tool_calls") or [])

    def public(self) -> dict[str, Any]:
        """The stored completion as its own session may read it back."""
        return {"id": self.id, "turn": self.turn, "parent": self.parent,
                "prompt_ids": self.prompt_ids, "output_ids": self.output_ids,
                "logprobs": self.logprobs, "versions": self.versions,
                "stop_reason": self.stop_reason.value, "message": self.message}


class SessionStatus(str, Enum):
    ACTIVE = "active"
    ENDED = "ended"  # the agent finished: no more completions, rewards may still be set


@dataclass
class Session:
    id: str
    secret: str
    created: float = field(default_factory=time.monotonic)
    last_used: float = field(default_factory=time.monotonic)
    status: SessionStatus = SessionStatus.ACTIVE
    completions: dict[str, Completion] = field(default_factory=dict)
    turns: list[list[str]] = field(default_factory=list)  # completion ids per request, in order
    rewards: dict[str, float] = field(default_factory=dict)  # raw rewards given so far
    last_reward: float | None = None  # a float reward: for the last completion at export time
    # /v1/responses conversations, for previous_response_id within the session
    responses: ResponseMemory = field(default_factory=ResponseMemory)

    @property
    def api_key(self) -> str:
        return f"sk-asyncrl-{self.id}-{self.secret}"

    def add_turn(self, completions: list[Completion]) -> None:
        self.turns.append([c.id for c in completions])
        for c in completions:
            self.completions[c.id] = c

    def resolve(self, completion_id: str) -> list[str]:
        """Completion ids a reward key names: one choice, or every choice of one response."""
        if completion_id in self.completions:
            return [completion_id]
        choices = [c for c in self.completions if c.startswith(completion_id + ":")]
        if not choices:
            raise NotFoundError(f"completion {completion_id!r} is not in this session")
        return choices

    def completion(self, completion_id: str) -> Completion:
        """A stored completion by its id (one choice's id, as the client got it)."""
        if completion_id not in self.completions:
            raise NotFoundError(f"completion {completion_id!r} is not in this session")
        return self.completions[completion_id]

    def set_reward(self, reward: float | dict[str, float]) -> None:
        """A float rewards the last completion; a dict maps completion (or response) ids."""
        if isinstance(reward, dict):
            for key, value in reward.items():
                for cid in self.resolve(key):
                    self.rewards[cid] = float(value)
        else:
            self.last_reward = float(reward)
