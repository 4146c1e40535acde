"""Pythonic tool calls (vLLM's `pythonic`): Llama 3.2 / Llama 4 and ToolACE-style models.

The model writes a Python list of calls with keyword arguments, `[get_weather(city="Paris"),
add(a=1, b=2)]`, at the end of its reply (text before it is the content). Llama 4 wraps it in
`<|python_start|>`/`<|python_end|>`, special tokens that decoding drops. The list is parsed
with `ast` and each value with `ast.literal_eval`: the reply is read, never executed.
"""

from __future__ import annotations

import ast
import re

from asyncrl.models.tool_parsers.base import ToolCalls, openai_call

LIST_OF_CALLS = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")


class PythonicParser:
    name = "pythonic"
    markers: tuple[str, ...] = ()

    def attempted(self, text: str) -> bool:
        return LIST_OF_CALLS.search(text) is not None

    def parse(self, text: str) -> tuple[str | None, ToolCalls | None]:
        for match in LIST_OF_CALLS.finditer(text):
            calls = _parse_list(text[match.start():].strip())
            if calls is not None:
                return text[:match.start()].strip() or None, calls
        return text, None


def _parse_list(source: str) -> ToolCalls | None:
    try:
        tree = ast.parse(source, mode="eval").body
    except (SyntaxError, ValueError):  # ValueError: a NUL byte in the text
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        call = _parse_call(node)
        if call is None:
            return None
        calls.append(call)
    return calls


def _parse_call(node: ast.expr) -> dict | None:
    if not isinstance(node, ast.Call) or node.args:  # positional values have no parameter name
        return None
    try:
        name = ast.unparse(node.func)  # `f` or a dotted `ns.f`
        args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
    except (ValueError, TypeError, SyntaxError, RecursionError):  # not a literal value
        return None
    if None in args or not all(part.isidentifier() for part in name.split(".")):
        return None  # `**kwargs`, or a callee that is not a plain name
    return openai_call(name, args)
