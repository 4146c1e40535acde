"""Llama 3.x JSON tool calls (vLLM's `llama3_json`).

Llama 3.1-3.3 chat templates ask for `{"name": function name, "parameters": {...}}`, optionally
after `<|python_tag|>`; several calls are separated by `;`. Some fine-tunes write `arguments` for
`parameters`; both are read. The calls start at the tag, or else at the first `{` that opens an
object with a name and arguments (so a `{` in prose before them is not mistaken for a call), and
run as long as `;`/whitespace-separated objects follow; text before and after is the content.
`<|python_tag|>` is a special token in Llama's vocabulary: decoding without special tokens drops
it, which leaves the bare JSON this parser reads just the same.
"""

from __future__ import annotations

import json
from typing import Any

from asyncrl.models.tool_parsers.base import ToolCalls, openai_call, skip_space

PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


class Llama3JsonParser:
    name = "llama3_json"
    markers: tuple[str, ...] = ()

    def attempted(self, text: str) -> bool:
        return PYTHON_TAG in text or text.lstrip().startswith("{")

    def parse(self, text: str) -> tuple[str | None, ToolCalls | None]:
        tag = text.find(PYTHON_TAG)
        start = tag + len(PYTHON_TAG) if tag >= 0 else _first_call(text)
        if start is None:
            return text, None
        calls, pos = [], start
        while True:
            pos = skip_space(text, pos)
            if pos >= len(text) or text[pos] != "{":
                break
            try:
                obj, pos = _DECODER.raw_decode(text, pos)
            except json.JSONDecodeError:
                return text, None
            call = _call(obj)
            if call is None:
                return text, None
            calls.append(call)
            pos = skip_space(text, pos)
            if text.startswith(";", pos):
                pos += 1
        if not calls:
            return text, None
        before = text[:tag] if tag >= 0 else text[:start]
        return (before + text[pos:]).strip() or None, calls


def _call(obj: Any) -> dict | None:
    if not isinstance(obj, dict) or ("parameters" in obj) == ("arguments" in obj):
        return None  # neither, or both (ambiguous)
    return openai_call(obj.get("name"), obj.get("parameters", obj.get("arguments")))


def _first_call(text: str) -> int | None:
    """Position of the first `{` that opens a well-formed call object, else None."""
    pos = text.find("{")
    while pos >= 0:
        try:
            obj, _ = _DECODER.raw_decode(text, pos)
        except json.JSONDecodeError:
            obj = None
        if _call(obj) is not None:
            return pos
        pos = text.find("{", pos + 1)
    return None
