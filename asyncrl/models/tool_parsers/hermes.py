"""Hermes-style tool calls (Hermes 2/3, Qwen2.5, Qwen3, the tiny model's chat template).

The model writes `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number of them,
with text around; the text outside the tags is the content.
"""

from __future__ import annotations

import json
import re

from asyncrl.models.tool_parsers.base import ToolCalls, openai_call

OPEN, CLOSE = "<tool_call>", "</tool_call>"
CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


class HermesParser:
    name = "hermes"
    markers: tuple[str, ...] = ()

    def attempted(self, text: str) -> bool:
        return OPEN in text

    def parse(self, text: str) -> tuple[str | None, ToolCalls | None]:
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


def _parse_one(body: str) -> dict | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict):
        return None
    return openai_call(obj.get("name"), obj.get("arguments", {}))
