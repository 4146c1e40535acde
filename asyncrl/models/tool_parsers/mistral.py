"""Mistral tool calls (vLLM's `mistral`).

Mistral models open their calls with the control token `[TOOL_CALLS]`, then, by tokenizer
version:
- before v11 (Mistral-7B-Instruct-v0.3, Mixtral-8x22B-Instruct): a JSON array of
  `{"name": ..., "arguments": {...}}` objects;
- v11 and later (Mistral Small 3.x, Magistral, Devstral): `name[ARGS]{...}` per call, each after
  its own `[TOOL_CALLS]` (`name{...}` without `[ARGS]` also occurs; `[CALL_ID]id` may precede
  `[ARGS]`).
The markers are special tokens, which a plain decode drops: a server that parses tools decodes
the reply keeping the parser's `markers` (`ChatOptions.marker_ids`). Without them the array form
still parses when the reply begins with it; the v11 form without its markers is prose.
"""

from __future__ import annotations

import json
import re
from typing import Any

from asyncrl.models.tool_parsers.base import ToolCalls, openai_call, skip_space

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
# a v11 call's head: its name, maybe its id, maybe [ARGS], then the arguments' `{`
NAMED = re.compile(r"\s*([A-Za-z_][\w.\-]*)(?:" + re.escape(CALL_ID) + r"\w+)?(?:"
                   + re.escape(ARGS) + r")?\s*(?=\{)")
_DECODER = json.JSONDecoder()


class MistralParser:
    name = "mistral"
    markers = (TOOL_CALLS, ARGS, CALL_ID)

    def attempted(self, text: str) -> bool:
        return TOOL_CALLS in text or text.lstrip().startswith("[{")

    def parse(self, text: str) -> tuple[str | None, ToolCalls | None]:
        tag = text.find(TOOL_CALLS)
        if tag >= 0:
            before, start = text[:tag], tag + len(TOOL_CALLS)
            parsed = (_array(text, start) if text[skip_space(text, start):].startswith("[")
                      else _named(text, start))
        elif text.lstrip().startswith("[{"):  # the array form, its marker dropped by a decode
            before, parsed = "", _array(text, 0)
        else:
            return text, None
        if parsed is None:
            return text, None
        calls, end = parsed
        return (before + text[end:]).strip() or None, calls


def _decode(text: str, pos: int) -> tuple[Any, int] | None:
    try:
        return _DECODER.raw_decode(text, pos)
    except json.JSONDecodeError:
        return None


def _array(text: str, pos: int) -> tuple[ToolCalls, int] | None:
    """`[{"name": ..., "arguments": ...}, ...]` at `pos`: every element a well-formed call."""
    decoded = _decode(text, skip_space(text, pos))
    if decoded is None or not isinstance(decoded[0], list) or not decoded[0]:
        return None
    calls = [openai_call(o.get("name"), o.get("arguments")) if isinstance(o, dict) else None
             for o in decoded[0]]
    return None if None in calls else (calls, decoded[1])


def _named(text: str, pos: int) -> tuple[ToolCalls, int] | None:
    """`name[ARGS]{...}` at `pos`, then more after further `[TOOL_CALLS]` markers."""
    calls: ToolCalls = []
    while True:
        head = NAMED.match(text, pos)
        decoded = _decode(text, head.end()) if head else None
        call = openai_call(head.group(1), decoded[0]) if head and decoded else None
        if call is None:
            return None
        calls.append(call)
        end = decoded[1]
        nxt = skip_space(text, end)
        if not text.startswith(TOOL_CALLS, nxt):
            return calls, end
        pos = nxt + len(TOOL_CALLS)
