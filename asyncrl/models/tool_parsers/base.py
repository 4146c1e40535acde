"""What every tool-call parser is and returns: `(content, calls)`, calls in OpenAI's shape.

A parser reads one decoded reply. Only a reply whose every call is well formed is a tool-call
reply; anything malformed comes back unchanged as plain content (calls None), so the agent sees
what the model wrote and the server never fails on model output.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Protocol, runtime_checkable

ToolCalls = list[dict[str, Any]]


@runtime_checkable
class ToolParser(Protocol):
    name: str
    markers: tuple[str, ...]  # special tokens the format writes: decoded as text, not dropped

    def parse(self, text: str) -> tuple[str | None, ToolCalls | None]:
        """(content, tool_calls): tool_calls is None unless every call in `text` parses;
        content is the text around the calls (None when empty), or `text` itself."""
        ...

    def attempted(self, text: str) -> bool:
        """Whether `text` starts a call in this format (counts malformed calls in stats)."""
        ...


def openai_call(name: Any, arguments: Any) -> dict[str, Any] | None:
    """A call as OpenAI returns it, or None when the name or the arguments are unusable.

    Arguments may arrive as an object or as a JSON-encoded object (some models write them
    pre-encoded); they go out as compact JSON text, as OpenAI sends them.
    """
    if not isinstance(name, str) or not name:
        return None
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name,
                         "arguments": json.dumps(arguments, separators=(",", ":"))}}


def skip_space(text: str, pos: int) -> int:
    """The first position at or after `pos` that is not whitespace."""
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos
