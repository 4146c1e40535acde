"""Tool calls in model text -> OpenAI `tool_calls`, Hermes/Qwen style.

The model writes `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (any number of them,
with text around). Only a reply whose every call parses is a tool-call reply; anything malformed
(bad JSON, a missing tag, no name) comes back as plain content, exactly as the model wrote it, so
the agent sees what happened and the server never fails on model output.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]] | None]:
    """(content, tool_calls); tool_calls is None unless every call in `text` is well formed."""
    if OPEN not in text:
        return text, None
    calls = []
    for match in CALL.finditer(text):
        call = _parse_one(match.group(1))
        if call is None:
            return text, None
        calls.append(call)
    rest = CALL.sub("", text)
    if not calls or OPEN in rest or CLOSE in rest:  # an unclosed or stray tag
        return text, None
    return (rest.strip() or None), calls


def _parse_one(body: str) -> dict[str, Any] | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models emit the arguments already JSON-encoded
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"],
                         "arguments": json.dumps(args, separators=(",", ":"))}}
