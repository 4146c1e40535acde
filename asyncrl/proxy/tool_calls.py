"""Hermes/Qwen tool calls, the proxy's original parser, kept importable under its old name.

The parsers now live in `asyncrl.models.tool_parsers` (the built-in server uses them too, and
models/ may not import proxy/); the proxy picks one per model (`model.tool_parser`).
"""

from __future__ import annotations

from asyncrl.models.tool_parsers.hermes import HermesParser

parse_tool_calls = HermesParser().parse

__all__ = ["parse_tool_calls"]
