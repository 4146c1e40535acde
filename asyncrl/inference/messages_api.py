"""Anthropic's Messages API (`POST /v1/messages`) over the chat path, on the proxy and on
`asyncrl serve`.

A request is translated into a chat completion request (system prompt, text / image / tool_use /
tool_result / thinking blocks, tools, stop sequences, sampling), generated and recorded by the
server's chat path, and its reply translated back into a Message: a `thinking` block for the
model's reasoning, `text`, and a `tool_use` block per parsed tool call. Tool ids round-trip (a
tool_use block carries the id the chat reply gave its call), so an agent's next turn matches the
recorded completion and reuses its sampled ids. Streaming replays the finished message as
Anthropic's event sequence (message_start, content_block_start/delta/stop, message_delta,
message_stop). Errors on these routes take Anthropic's shape (`AnthropicErrors`).

Refused with a 400 naming the field: `tool_choice` any/tool (this server cannot force a tool
call), server tools (a tool without an `input_schema`), images in a tool_result, URL image
sources other than file:// (the proxy reads those under its image_dir), document blocks,
`output_config.effort` / `.format`, `container`, and every field this module does not list
(`StrictBody`). `metadata`, `service_tier`, `cache_control`, `diagnostics`, `inference_geo`,
`speed`, `user_profile_id` and `workspace_id` are accepted and change nothing;
`thinking.budget_tokens` is not enforced on its own (`max_tokens` bounds thinking and text
together). `temperature`, `top_p` and `top_k`, which the current SDK no longer sends, are honoured
when a client sends them (`extra_body`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal

import pydantic
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from asyncrl.inference.http_errors import ErrorResponse
from asyncrl.inference.http_schema import BadField, ChatCompletionBody, StrictBody

PATH = "/v1/messages"
STREAM_PIECE = 16  # characters per replayed delta


class _Block(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="allow")  # cache_control, citations: hints


class TextBlock(_Block):
    type: Literal["text"]
    text: str


class ImageSource(pydantic.BaseModel):
    type: Literal["base64", "url"]
    media_type: str | None = None
    data: str | None = None
    url: str | None = None


class ImageBlock(_Block):
    type: Literal["image"]
    source: ImageSource


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock | ImageBlock] | None = None
    is_error: bool | None = None


class ThinkingBlock(_Block):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


Block = TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock


class AnthropicMessage(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    role: Literal["user", "assistant"]
    content: str | list[Block]


class AnthropicTool(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="allow")  # cache_control
    name: str = pydantic.Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None  # "custom" or absent; server tools are refused


class MessagesBody(StrictBody):
    model: str
    max_tokens: int = pydantic.Field(ge=1)
    messages: list[AnthropicMessage] = pydantic.Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = pydantic.Field(None, ge=0.0, le=1.0)
    top_p: float | None = pydantic.Field(None, gt=0.0, le=1.0)
    top_k: int | None = pydantic.Field(None, ge=0)
    stream: bool = False
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # effort and format: null only
    # accepted, change nothing: tags, routing and cache hints
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    cache_control: dict[str, Any] | None = None
    diagnostics: dict[str, Any] | None = None
    inference_geo: str | None = None
    speed: Literal["standard", "fast"] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None

    @pydantic.model_validator(mode="after")
    def _supported(self) -> MessagesBody:
        kind = (self.tool_choice or {}).get("type", "auto")
        if kind not in ("auto", "none"):
            raise BadField("tool_choice.type", f"{kind!r} is not supported by this server (it "
                                               "cannot force a tool call); allowed: 'auto', "
                                               "'none'")
        for i, tool in enumerate(self.tools or []):
            if tool.input_schema is None or tool.type not in (None, "custom"):
                raise BadField(f"tools[{i}]", f"server tool {tool.type or tool.name!r} is not "
                                              "available here; allowed: client tools with an "
                                              "input_schema")
        for key in ("effort", "format"):
            if (self.output_config or {}).get(key) is not None:
                raise BadField(f"output_config.{key}", "not supported by this server (no effort "
                                                       "control, no constrained decoding); "
                                                       "allowed: null")
        thinking = (self.thinking or {}).get("type", "disabled")
        if thinking not in ("enabled", "disabled", "adaptive"):
            raise BadField("thinking.type", f"{thinking!r}; allowed: 'enabled', 'disabled', "
                                            "'adaptive'")
        return self


def to_chat(body: MessagesBody) -> ChatCompletionBody:
    """The chat completion request `body` asks for (n = 1, no streaming: replayed here)."""
    messages: list[dict[str, Any]] = []
    if body.system:
        messages.append({"role": "system", "content": _joined(body.system)})
    for i, m in enumerate(body.messages):
        messages.extend(_user(m, i) if m.role == "user" else [_assistant(m)])
    tools = [{"type": "function", "function": {
        "name": t.name, **({"description": t.description} if t.description else {}),
        "parameters": t.input_schema}} for t in body.tools or []] or None
    return ChatCompletionBody(
        messages=messages, tools=tools, max_tokens=body.max_tokens,
        tool_choice=None if tools is None else (body.tool_choice or {}).get("type", "auto"),
        temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
        stop=list(body.stop_sequences or []) or None, model=body.model)


def _joined(blocks: str | list[TextBlock]) -> str:
    return blocks if isinstance(blocks, str) else "\n".join(b.text for b in blocks)


def _user(m: AnthropicMessage, i: int) -> list[dict[str, Any]]:
    """Tool results first (each a `tool` message, in order), then the user's own content."""
    if isinstance(m.content, str):
        return [{"role": "user", "content": m.content}]
    out, parts = [], []
    for j, b in enumerate(m.content):
        where = f"messages[{i}].content[{j}]"
        if isinstance(b, ToolResultBlock):
            content = b.content or ""
            if not isinstance(content, str):
                if any(isinstance(c, ImageBlock) for c in content):
                    raise BadField(where, "images inside a tool_result are not supported; "
                                          "send them as image blocks of the user message")
                content = "\n".join(c.text for c in content)
            out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": content})
        elif isinstance(b, TextBlock):
            parts.append({"type": "text", "text": b.text})
        elif isinstance(b, ImageBlock):
            parts.append({"type": "image_url", "image_url": {"url": _image_url(b, where)}})
        else:
            raise BadField(where, f"a {b.type} block in a user message; allowed: text, image, "
                                  "tool_result")
    if parts:
        text_only = all(p["type"] == "text" for p in parts)
        out.append({"role": "user", "content": "\n".join(p["text"] for p in parts)
                    if text_only else parts})
    return out


def _image_url(b: ImageBlock, where: str) -> str:
    s = b.source
    if s.type == "base64":
        if not s.data or not s.media_type:
            raise BadField(f"{where}.source", "a base64 source needs media_type and data")
        return f"data:{s.media_type};base64,{s.data}"
    if not (s.url or "").startswith("file://"):
        raise BadField(f"{where}.source.url", "nothing is fetched; allowed: a base64 source, "
                                              "or a file:// URL under the proxy's image_dir")
    return s.url


def _assistant(m: AnthropicMessage) -> dict[str, Any]:
    """An earlier reply as the chat path recorded it: text, reasoning and tool calls."""
    if isinstance(m.content, str):
        return {"role": "assistant", "content": m.content}
    texts = [b.text for b in m.content if isinstance(b, TextBlock)]
    thinking = [b.thinking for b in m.content if isinstance(b, ThinkingBlock)]
    calls = [{"id": b.id, "type": "function",
              "function": {"name": b.name, "arguments": json.dumps(b.input)}}
             for b in m.content if isinstance(b, ToolUseBlock)]
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if thinking:
        msg["reasoning_content"] = "".join(thinking)
    if calls:
        msg["tool_calls"] = calls
    return msg


STOP_REASON = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use",
               "abort": "pause_turn"}


def from_chat(reply: dict[str, Any], msg_id: str, model: str, raw_text: str,
              stops: list[str]) -> dict[str, Any]:
    """The Message for a chat reply (its one choice). `raw_text`: the sampled text before any
    stop-string cut, to name the stop sequence that ended it."""
    choice = reply["choices"][0]
    msg = choice["message"]
    content: list[dict[str, Any]] = []
    if msg.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": msg["reasoning_content"],
                        "signature": ""})
    if msg.get("content"):
        content.append({"type": "text", "text": msg["content"]})
    for call in msg.get("tool_calls") or []:
        fn = call["function"]
        content.append({"type": "tool_use", "id": call["id"], "name": fn["name"],
                        "input": json.loads(fn["arguments"])})
    stop_reason = STOP_REASON.get(choice["finish_reason"], "end_turn")
    hits = [(raw_text.find(s), s) for s in stops if s and raw_text.find(s) >= 0]
    stop_sequence = min(hits)[1] if hits and stop_reason == "end_turn" else None
    if stop_sequence is not None:
        stop_reason = "stop_sequence"
    return {"id": msg_id, "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": {"input_tokens": reply["usage"]["prompt_tokens"],
                      "output_tokens": reply["usage"]["completion_tokens"]}}


def _event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


def stream_events(message: dict[str, Any]) -> Iterator[str]:
    """A finished Message as Anthropic's server-sent events."""
    start = {**message, "content": [], "stop_reason": None, "stop_sequence": None,
             "usage": {**message["usage"], "output_tokens": 0}}
    yield _event("message_start", {"message": start})
    for i, block in enumerate(message["content"]):
        kind = block["type"]
        if kind == "text":
            head, field, delta_kind, text = {"type": "text", "text": ""}, "text", "text_delta", \
                block["text"]
        elif kind == "thinking":
            head, field, delta_kind, text = ({"type": "thinking", "thinking": "",
                                              "signature": ""}, "thinking", "thinking_delta",
                                             block["thinking"])
        else:
            head, field, delta_kind, text = ({**block, "input": {}}, "partial_json",
                                             "input_json_delta", json.dumps(block["input"]))
        yield _event("content_block_start", {"index": i, "content_block": head})
        for at in range(0, len(text), STREAM_PIECE):
            yield _event("content_block_delta", {"index": i, "delta": {
                "type": delta_kind, field: text[at:at + STREAM_PIECE]}})
        yield _event("content_block_stop", {"index": i})
    yield _event("message_delta", {
        "delta": {"stop_reason": message["stop_reason"],
                  "stop_sequence": message["stop_sequence"]},
        "usage": {"output_tokens": message["usage"]["output_tokens"]}})
    yield _event("message_stop", {})


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 529: "overloaded_error"}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


class AnthropicErrors:
    """Errors under /v1/messages in Anthropic's shape: `{"type": "error", "error": {"type",
    "message"}}`, rewritten from the OpenAI-shaped error every other handler writes.
    Outermost middleware: it also sees the body-size and internal-error answers."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(PATH):
            return await self.app(scope, receive, send)
        held: list[Message] = []

        async def rewrite(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] >= 400:
                held.append(message)
                return
            if held and message["type"] == "http.response.body":
                held.append(message)
                if message.get("more_body"):
                    return
                start, *bodies = held
                await _anthropic_error(start, b"".join(b.get("body", b"") for b in bodies),
                                       scope, receive, send)
                return
            await send(message)

        await self.app(scope, receive, rewrite)


async def _anthropic_error(start: Message, body: bytes, scope: Scope, receive: Receive,
                           send: Send) -> None:
    status = start["status"]
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body.decode(errors="replace") or f"HTTP {status}"
    headers = {k.decode(): v.decode() for k, v in start.get("headers", [])
               if k.lower() not in (b"content-length", b"content-type")}
    resp = ErrorResponse({"type": "error", "error": {"type": error_type(status),
                                                     "message": message}},
                         status_code=status, headers=headers)
    await resp(scope, receive, send)


def api_key(x_api_key: str | None, authorization: str | None) -> str | None:
    """The key an Anthropic client sends: `x-api-key`, or `Authorization: Bearer` (auth_token)."""
    if x_api_key:
        return x_api_key.strip()
    return authorization.removeprefix("Bearer ").strip() if authorization else None

