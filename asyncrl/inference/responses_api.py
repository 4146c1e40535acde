"""OpenAI's Responses API (`POST /v1/responses`) over the chat path, on the proxy and on
`asyncrl serve`: what the OpenAI Agents SDK's default model class speaks.

The request's `instructions` and `input` items (messages with input_text / input_image /
output_text parts, function_call and function_call_output items) become chat messages, generated
and recorded by the server's chat path; the reply becomes output items (a `reasoning` item for the
model's reasoning, a `message` with output_text, a `function_call` per parsed tool call, whose
`call_id` is the id the chat reply gave it, so the next turn matches the recorded completion).
`previous_response_id` continues an earlier response's conversation (its `instructions` are not
carried over, as OpenAI documents): on the proxy from the session's recorded completions, on
`asyncrl serve` from the last `RESPONSE_MEMORY` responses. Streaming replays the finished response
as the Responses event sequence (response.created ... response.completed).

Refused with a 400 naming the field: non-function tools (web search, file search, computer use,
MCP), `tool_choice` required or a named tool, `text.format` other than text, `reasoning.effort`,
`background`, `conversation`, `prompt`, `truncation: auto`, `top_logprobs` > 0, and fields this
module does not list. Reasoning input items are dropped (the chat template drops earlier
reasoning too). `store`, `include`, `metadata`, `user`, `parallel_tool_calls` and cache hints are
accepted and change nothing.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any, Literal

import pydantic

from asyncrl.inference.http_schema import BadField, ChatCompletionBody, StrictBody

PATH = "/v1/responses"
RESPONSE_MEMORY = 1024  # responses `asyncrl serve` keeps for previous_response_id
STREAM_PIECE = 16


class ResponsesBody(StrictBody):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    temperature: float | None = pydantic.Field(None, ge=0.0, le=2.0)
    top_p: float | None = pydantic.Field(None, gt=0.0, le=1.0)
    max_output_tokens: int | None = pydantic.Field(None, ge=1)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    previous_response_id: str | None = None
    # accepted, change nothing
    store: bool | None = None
    include: list[str] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    parallel_tool_calls: bool | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    service_tier: str | None = None
    # accepted at their neutral value only
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    truncation: Literal["disabled"] | None = None
    top_logprobs: int | None = pydantic.Field(None, ge=0, le=0)
    background: Literal[False] | None = None
    max_tool_calls: None = None

    @pydantic.model_validator(mode="after")
    def _supported(self) -> ResponsesBody:
        if self.tool_choice not in (None, "auto", "none"):
            raise BadField("tool_choice", f"{self.tool_choice!r} is not supported by this "
                                          "server (it cannot force a tool call); allowed: "
                                          "'auto', 'none'")
        for i, tool in enumerate(self.tools or []):
            if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
                raise BadField(f"tools[{i}]", f"tool type {tool.get('type')!r} is not available"
                                              " here; allowed: function tools with a name")
        kind = ((self.text or {}).get("format") or {}).get("type", "text")
        if kind != "text":
            raise BadField("text.format.type", f"{kind!r} is not supported (no constrained "
                                               "decoding); allowed: 'text'")
        if (self.reasoning or {}).get("effort") is not None:
            raise BadField("reasoning.effort", "the model has no reasoning-effort control; "
                                               "allowed: null")
        if isinstance(self.input, list) and not self.input:
            raise BadField("input", "an empty list; allowed: a string or a list of items")
        return self


def input_messages(body: ResponsesBody) -> list[dict[str, Any]]:
    """The chat messages of `body.input` (without the instructions)."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(body.input):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise BadField(where, "an input item must be an object")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            out.append(_message(item, where))
        elif kind == "function_call":
            call = {"id": _text_field(item, "call_id", where), "type": "function",
                    "function": {"name": _text_field(item, "name", where),
                                 "arguments": _text_field(item, "arguments", where)}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if isinstance(output, list):
                output = "".join(p.get("text", "") for p in output if isinstance(p, dict))
            if not isinstance(output, str):
                raise BadField(f"{where}.output", "allowed: a string or a list of text parts")
            out.append({"role": "tool", "tool_call_id": _text_field(item, "call_id", where),
                        "content": output})
        elif kind == "reasoning":
            continue
        else:
            raise BadField(f"{where}.type", f"{kind!r}; allowed: message, function_call, "
                                            "function_call_output, reasoning")
    return out


def _text_field(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise BadField(f"{where}.{key}", "a string is required")
    return value


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise BadField(f"{where}.role", f"{role!r}; allowed: user, system, developer, "
                                        "assistant")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": "system" if role == "developer" else role, "content": content}
    if not isinstance(content, list):
        raise BadField(f"{where}.content", "allowed: a string or a list of content parts")
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "input_image" and role == "user" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        elif kind == "refusal":
            parts.append({"type": "text", "text": part.get("refusal", "")})
        else:
            raise BadField(f"{where}.content[{j}]", f"part type {kind!r}; allowed: input_text, "
                                                    "output_text, input_image (with an "
                                                    "image_url), refusal")
    role = "system" if role == "developer" else role
    if all(p["type"] == "text" for p in parts):
        return {"role": role, "content": "".join(p["text"] for p in parts)}
    return {"role": role, "content": parts}


def to_chat(body: ResponsesBody, history: list[dict[str, Any]]) -> ChatCompletionBody:
    """The chat request: instructions, the earlier conversation (previous_response_id), input."""
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions
                else []) + history + input_messages(body)
    tools = [{"type": "function", "function": {
        k: v for k, v in (("name", t["name"]), ("description", t.get("description")),
                          ("parameters", t.get("parameters")), ("strict", t.get("strict")))
        if v is not None}} for t in body.tools or []] or None
    return ChatCompletionBody(messages=messages, tools=tools,
                              tool_choice=body.tool_choice if tools else None,
                              max_tokens=body.max_output_tokens, temperature=body.temperature,
                              top_p=body.top_p, model=body.model)


def conversation(chat: ChatCompletionBody, reply: dict[str, Any], instructions: bool
                 ) -> list[dict[str, Any]]:
    """What a later previous_response_id continues: the messages without the instructions,
    then the reply."""
    messages = chat.message_dicts()[1 if instructions else 0:]
    return messages + [{"role": "assistant", **reply["choices"][0]["message"]}]


def from_chat(reply: dict[str, Any], resp_id: str, body: ResponsesBody) -> dict[str, Any]:
    """The Response object for a chat reply (its one choice)."""
    choice = reply["choices"][0]
    msg = choice["message"]
    suffix = resp_id.removeprefix("resp_")
    output: list[dict[str, Any]] = []
    if msg.get("reasoning_content"):
        output.append({"type": "reasoning", "id": f"rs_{suffix}", "status": "completed",
                       "summary": [{"type": "summary_text", "text": msg["reasoning_content"]}]})
    if msg.get("content") or not msg.get("tool_calls"):
        output.append({"type": "message", "id": f"msg_{suffix}", "status": "completed",
                       "role": "assistant",
                       "content": [{"type": "output_text", "text": msg.get("content") or "",
                                    "annotations": [], "logprobs": []}]})
    for j, call in enumerate(msg.get("tool_calls") or []):
        output.append({"type": "function_call", "id": f"fc_{suffix}_{j}",
                       "call_id": call["id"], "name": call["function"]["name"],
                       "arguments": call["function"]["arguments"], "status": "completed"})
    incomplete = choice["finish_reason"] in ("length", "abort")
    u = reply["usage"]
    return {
        "id": resp_id, "object": "response", "created_at": int(time.time()),
        "status": "incomplete" if incomplete else "completed", "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "model": body.model or reply["model"], "output": output, "parallel_tool_calls": True,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": None, "summary": None}, "store": True,
        "temperature": body.temperature, "text": {"format": {"type": "text"}},
        "tool_choice": body.tool_choice or "auto", "tools": body.tools or [],
        "top_p": body.top_p, "truncation": "disabled", "user": body.user,
        "metadata": body.metadata or {},
        "usage": {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
                  "total_tokens": u["total_tokens"],
                  "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens_details": {"reasoning_tokens": 0}},
    }


def stream_events(response: dict[str, Any]) -> Iterator[str]:
    """A finished Response as the Responses API's server-sent events."""
    seq = iter(range(1 << 30))

    def event(kind: str, **data: Any) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': next(seq), **data})}\n\n"

    pending = {**response, "status": "in_progress", "output": [], "usage": None}
    yield event("response.created", response=pending)
    yield event("response.in_progress", response=pending)
    for i, item in enumerate(response["output"]):
        if item["type"] == "message":
            yield event("response.output_item.added", output_index=i,
                        item={**item, "status": "in_progress", "content": []})
            part = item["content"][0]
            yield event("response.content_part.added", item_id=item["id"], output_index=i,
                        content_index=0, part={**part, "text": ""})
            text = part["text"]
            for at in range(0, len(text), STREAM_PIECE):
                yield event("response.output_text.delta", item_id=item["id"], output_index=i,
                            content_index=0, delta=text[at:at + STREAM_PIECE], logprobs=[])
            yield event("response.output_text.done", item_id=item["id"], output_index=i,
                        content_index=0, text=text, logprobs=[])
            yield event("response.content_part.done", item_id=item["id"], output_index=i,
                        content_index=0, part=part)
        elif item["type"] == "function_call":
            yield event("response.output_item.added", output_index=i,
                        item={**item, "status": "in_progress", "arguments": ""})
            args = item["arguments"]
            for at in range(0, len(args), STREAM_PIECE):
                yield event("response.function_call_arguments.delta", item_id=item["id"],
                            output_index=i, delta=args[at:at + STREAM_PIECE])
            yield event("response.function_call_arguments.done", item_id=item["id"],
                        output_index=i, name=item["name"], arguments=args)
        else:
            yield event("response.output_item.added", output_index=i, item=item)
        yield event("response.output_item.done", output_index=i, item=item)
    final = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
    yield event(final, response=response)


class ResponseMemory:
    """The conversations of the last `capacity` responses, for previous_response_id (`asyncrl
    serve`; the proxy reads its session's recorded completions instead)."""

    def __init__(self, capacity: int = RESPONSE_MEMORY) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()

    def get(self, resp_id: str) -> list[dict[str, Any]]:
        if resp_id not in self._items:
            raise KeyError(resp_id)
        return list(self._items[resp_id])

    def put(self, resp_id: str, messages: list[dict[str, Any]]) -> None:
        self._items[resp_id] = messages
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)
