"""Tool-call parsers by name (vLLM's `--tool-call-parser` names), chosen per model.

`model.tool_parser` (training, the proxy) and `asyncrl serve --tool-parser` pick one; a new
format is one module with a `ToolParser` and one line in `TOOL_PARSERS`.
"""

from __future__ import annotations

from asyncrl.models.tool_parsers.base import ToolCalls, ToolParser, openai_call
from asyncrl.models.tool_parsers.hermes import HermesParser
from asyncrl.models.tool_parsers.llama3_json import Llama3JsonParser
from asyncrl.models.tool_parsers.mistral import MistralParser
from asyncrl.models.tool_parsers.pythonic import PythonicParser

TOOL_PARSERS: dict[str, ToolParser] = {
    p.name: p for p in (HermesParser(), Llama3JsonParser(), MistralParser(), PythonicParser())}


def tool_parser(name: str) -> ToolParser:
    """The parser registered as `name`; ValueError listing the allowed names otherwise."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"tool_parser={name!r} is unknown; allowed: {', '.join(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]


__all__ = ["TOOL_PARSERS", "ToolCalls", "ToolParser", "openai_call", "tool_parser"]
