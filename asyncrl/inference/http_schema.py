"""Request bodies of the inference server: token-level `/generate` and the OpenAI-compatible API.

Unknown fields are rejected (400 naming the field) rather than silently ignored, and OpenAI fields
this engine does not implement are accepted only at their neutral value, so a client never gets
output that quietly ignored what it asked for.
"""

from __future__ import annotations

from typing import Any, Literal

import pydantic

from asyncrl.api import GenerationConfig


class StrictBody(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")


class GenerateBody(StrictBody):
    """Token in, token out: exactly what RL rollouts need (ids, logprobs, versions)."""

    input_ids: list[int]
    rid: str | None = None
    max_new_tokens: int = pydantic.Field(256, ge=1)
    min_new_tokens: int = pydantic.Field(0, ge=0)
    temperature: float = pydantic.Field(1.0, ge=0.0)
    top_p: float = pydantic.Field(1.0, gt=0.0, le=1.0)
    top_k: int = pydantic.Field(0, ge=0)
    greedy: bool = False
    stop_token_ids: list[int] = []
    stop: list[str] = []
    seed: int | None = None

    def gconfig(self) -> GenerationConfig:
        fields = self.model_dump(exclude={"input_ids", "rid"})
        return GenerationConfig(**fields)


def _neutral(name: str, value: Any, neutral: Any) -> None:
    if value not in (None, neutral):
        raise ValueError(f"{name}={value!r} is not supported by this server; allowed: {neutral!r}")


class OpenAISampling(StrictBody):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    temperature: float | None = pydantic.Field(None, ge=0.0, le=2.0)
    top_p: float | None = pydantic.Field(None, gt=0.0, le=1.0)
    top_k: int | None = pydantic.Field(None, ge=-1)  # vLLM extension; -1/0 disable
    min_tokens: int = pydantic.Field(0, ge=0)  # vLLM extension
    n: int = pydantic.Field(1, ge=1, le=64)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM extension
    seed: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @pydantic.model_validator(mode="after")
    def _unsupported_at_neutral(self) -> OpenAISampling:
        _neutral("presence_penalty", self.presence_penalty, 0.0)
        _neutral("frequency_penalty", self.frequency_penalty, 0.0)
        if self.logit_bias:
            raise ValueError("logit_bias is not supported by this server; allowed: {} or null")
        return self

    def gconfig(self, max_new_tokens: int) -> GenerationConfig:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        temperature = 1.0 if self.temperature is None else self.temperature
        return GenerationConfig(
            max_new_tokens=max_new_tokens,
            min_new_tokens=min(self.min_tokens, max_new_tokens),
            temperature=temperature,
            greedy=temperature == 0.0,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(0, self.top_k or 0),
            stop=stops,
            stop_token_ids=list(self.stop_token_ids or []),
            seed=self.seed,
        )


class CompletionBody(OpenAISampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = pydantic.Field(16, ge=1)
    logprobs: int | None = pydantic.Field(None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @pydantic.model_validator(mode="after")
    def _plain_completion_only(self) -> CompletionBody:
        _neutral("echo", self.echo, False)
        _neutral("suffix", self.suffix, None)
        _neutral("best_of", self.best_of, self.n)
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (OpenAI accepts one or a batch)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [p]
        return list(p)


class ChatMessage(pydantic.BaseModel):
    # Messages pass through to the chat template; tool calls and names are kept as given.
    model_config = pydantic.ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionBody(OpenAISampling):
    messages: list[ChatMessage] = pydantic.Field(min_length=1)
    max_tokens: int | None = pydantic.Field(None, ge=1)
    max_completion_tokens: int | None = pydantic.Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = pydantic.Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None

    @pydantic.model_validator(mode="after")
    def _supported(self) -> ChatCompletionBody:
        _neutral("top_logprobs", self.top_logprobs, 0)
        if self.response_format and self.response_format.get("type") != "text":
            raise ValueError("response_format other than {'type': 'text'} is not supported")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class AbortBody(StrictBody):
    rid: str | None = None  # None aborts every in-flight request


class DiskWeightsBody(StrictBody):
    path: str
    version: int = pydantic.Field(ge=0)
