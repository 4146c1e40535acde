"""Request bodies of the inference server: token-level `/generate` and the OpenAI-compatible API.

Unknown fields are rejected (400 naming the field) rather than silently ignored, and OpenAI fields
this engine does not implement are accepted only at their neutral value, so a client never gets
output that quietly ignored what it asked for. Tools, tool calls and content parts are typed, so a
malformed one is a 400 naming it (`tools[0].function.name`) before any chat template sees it; a
string that is not valid Unicode (a lone surrogate such as the JSON escape `\\ud800`) and nesting
deeper than `MAX_JSON_DEPTH` are refused in every body, naming the field.
"""

from __future__ import annotations

from typing import Any, Literal

import pydantic

from asyncrl.api import GenerationConfig
from asyncrl.api.generation import SEED_MAX, SEED_MIN


MAX_JSON_DEPTH = 64  # arrays/objects inside one another; OpenAI bodies need a handful


class BadField(ValueError):
    """Input that fails a check of the whole body; `param` is the field path a client sees."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}" if param else message)
        self.param = param


def check_json_text(body: Any) -> None:
    """BadField for the first string (or object key) holding a lone surrogate, or for nesting
    deeper than MAX_JSON_DEPTH. Iterative: the input may be as deep as the JSON parser allowed."""
    stack: list[tuple[Any, str, int]] = [(body, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            if not _is_unicode(value):
                raise BadField(path, "a lone UTF-16 surrogate (such as \\ud800) is not valid "
                                     "Unicode text; send the character's full surrogate pair")
        elif isinstance(value, (dict, list)):
            if depth >= MAX_JSON_DEPTH:
                raise BadField(path, f"nested more than {MAX_JSON_DEPTH} levels deep")
            if isinstance(value, dict):
                for key in value:
                    if isinstance(key, str) and not _is_unicode(key):
                        raise BadField(path, "an object key holds a lone UTF-16 surrogate, "
                                             "which is not valid Unicode text")
                # reversed: the first offending field in document order is reported
                stack.extend((item, f"{path}.{key}" if path else str(key), depth + 1)
                             for key, item in reversed(value.items()))
            else:
                stack.extend((item, f"{path}[{i}]", depth + 1)
                             for i, item in reversed(list(enumerate(value)))
                             if isinstance(item, (str, dict, list)))


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class ClosedModel(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")


class StrictBody(ClosedModel):
    """A request body: unknown fields, invalid text and runaway nesting are refused."""

    @pydantic.model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data: Any) -> Any:
        check_json_text(data)
        return data


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
    seed: int | None = pydantic.Field(None, ge=SEED_MIN, le=SEED_MAX)
    # server-sent events: {"output_tokens", "output_logprobs", "output_versions"} deltas as they
    # are sampled, the last with "stop_reason"; a client whose server dies keeps what it got
    stream: bool = False
    # with stream: an event once this many new tokens are sampled (the last event: the rest)
    stream_interval: int = pydantic.Field(1, ge=1)

    def gconfig(self) -> GenerationConfig:
        fields = self.model_dump(exclude={"input_ids", "rid", "stream", "stream_interval"})
        return GenerationConfig(**fields)


def _neutral(name: str, value: Any, neutral: Any) -> None:
    if value not in (None, neutral):
        allowed = "null (omit the field)" if neutral is None else repr(neutral)
        raise ValueError(f"{name}={value!r} is not supported by this server; allowed: {allowed}")


# stream_options keys, each with the type it must have. include_usage is honoured (a last chunk
# with the usage and no choices); include_obfuscation only pads chunks with a random field against
# length side channels, which changes no content, so it is accepted and ignored.
STREAM_OPTIONS = {"include_usage": bool, "include_obfuscation": bool}


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
    seed: int | None = pydantic.Field(None, ge=SEED_MIN, le=SEED_MAX - 64)  # + i for choice i
    stream: bool = False
    # A plain dict (callers read it with .get), checked against STREAM_OPTIONS below.
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
        for key, value in (self.stream_options or {}).items():
            kind = STREAM_OPTIONS.get(key)
            if kind is None:
                raise ValueError(f"stream_options.{key} is not supported by this server; "
                                 f"allowed keys: {sorted(STREAM_OPTIONS)}")
            if value is not None and not isinstance(value, kind):
                raise ValueError(f"stream_options.{key}={value!r} must be a {kind.__name__}")
        return self

    def stream_usage(self) -> bool:
        """Whether a streamed reply ends with a usage chunk (stream_options.include_usage)."""
        return self.stream and bool((self.stream_options or {}).get("include_usage"))

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
        if isinstance(self.prompt, list) and not self.prompt:
            raise BadField("prompt", "an empty list; allowed: a string, a list of token ids, or "
                                     "a non-empty list of strings or of token-id lists")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (OpenAI accepts one or a batch)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [p]
        return list(p)


class TextPart(pydantic.BaseModel):
    """A content part; text is the only kind a text model reads (others would be dropped)."""

    model_config = pydantic.ConfigDict(extra="allow")  # SDK hints such as cache breakpoints
    type: Literal["text"]
    text: str


class ImageURL(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="allow")
    url: str  # a data:image/...;base64 URL, or file:// where the server allows a directory
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the processor decides


class ImagePart(pydantic.BaseModel):
    """An OpenAI image part: read by a vision-language model's proxy, refused elsewhere."""

    model_config = pydantic.ConfigDict(extra="allow")
    type: Literal["image_url"]
    image_url: ImageURL


class ToolCallFunction(pydantic.BaseModel):
    name: str
    arguments: str | dict[str, Any]  # OpenAI sends a JSON string; some clients an object


class ToolCall(pydantic.BaseModel):
    """A tool call of an earlier assistant message, as the client sends it back."""

    model_config = pydantic.ConfigDict(extra="allow")
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(pydantic.BaseModel):
    # Messages pass through to the chat template; extra fields (refusal, ...) are kept as given.
    model_config = pydantic.ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart | ImagePart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDef(ClosedModel):
    name: str = pydantic.Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; the chat template renders it
    strict: bool | None = None


class ChatTool(ClosedModel):
    type: Literal["function"]
    function: FunctionDef


# tool_choice values this server can honour. It never forces a tool call ("required", a named
# function); "none" holds because tool calls only come from parsing what the model chose to write.
TOOL_CHOICES = ("auto", "none")


class ChatCompletionBody(OpenAISampling):
    messages: list[ChatMessage] = pydantic.Field(min_length=1)
    max_tokens: int | None = pydantic.Field(None, ge=1)
    max_completion_tokens: int | None = pydantic.Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = pydantic.Field(None, ge=0, le=20)
    tools: list[ChatTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    # A hint only: nothing limits how many tool calls the model writes in one turn.
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    # Accepted and ignored: none of these changes what is generated. Nothing is stored (`store`;
    # `metadata` tags stored completions), and cache hints only concern cost and latency.
    store: bool | None = None
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: dict[str, Any] | None = None
    safety_identifier: str | None = None
    # vLLM's extension: chat template variables (Qwen3's enable_thinking) for this request,
    # laid over the server's configured ones
    chat_template_kwargs: dict[str, Any] | None = None

    @pydantic.model_validator(mode="after")
    def _supported(self) -> ChatCompletionBody:
        _neutral("top_logprobs", self.top_logprobs, 0)
        kind = (self.response_format or {}).get("type", "text")
        if kind != "text":
            raise ValueError(f"response_format.type={kind!r} is not supported by this server "
                             "(no constrained decoding); allowed: 'text'")
        if self.tool_choice is not None and self.tool_choice not in TOOL_CHOICES:
            allowed = ", ".join(map(repr, TOOL_CHOICES))
            raise ValueError(f"tool_choice={self.tool_choice!r} is not supported by this server "
                             f"(it cannot force a tool call); allowed: {allowed} or null")
        # The model has no reasoning-effort or verbosity control; only "unset" is honest.
        _neutral("reasoning_effort", self.reasoning_effort, None)
        _neutral("verbosity", self.verbosity, "medium")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def message_dicts(self) -> list[dict[str, Any]]:
        """The messages as the chat template takes them (unset fields left out)."""
        return [m.model_dump(exclude_none=True) for m in self.messages]

    def has_images(self) -> bool:
        return any(isinstance(m.content, list) and any(isinstance(p, ImagePart)
                                                       for p in m.content)
                   for m in self.messages)

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template takes them, or None."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None


class AbortBody(StrictBody):
    rid: str | None = None  # None aborts every in-flight request


class DiskWeightsBody(StrictBody):
    path: str
    version: int = pydantic.Field(ge=0)


class JoinGroupBody(StrictBody):
    """Join the trainer's weight-broadcast group (inference/weight_group.py) as `rank_offset`
    (the fields of SGLang's /init_weights_update_group: one trainer client serves both)."""

    master_address: str
    master_port: int = pydantic.Field(ge=1, le=65535)
    world_size: int = pydantic.Field(ge=2)
    rank_offset: int = pydantic.Field(ge=1)  # this server's rank; 0 is the trainer
    group_name: str = "asyncrl_weight_sync"
    backend: Literal["nccl", "gloo"] = "nccl"
    timeout_s: float = pydantic.Field(300.0, gt=0)  # forming the group, and each later update

    @pydantic.model_validator(mode="after")
    def _rank_in_world(self) -> JoinGroupBody:
        if self.rank_offset >= self.world_size:
            raise ValueError(f"rank_offset={self.rank_offset} is out of range; allowed [1, "
                             f"{self.world_size - 1}] for world_size={self.world_size}")
        return self


class DistributedUpdateBody(StrictBody):
    version: int = pydantic.Field(ge=0)  # must equal the version the trainer broadcasts
