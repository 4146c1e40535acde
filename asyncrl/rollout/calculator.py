"""The calculator tool: integer + - * expressions, parsed by a small AST walker (never `eval`).

The tool of the calculator agents (examples/tool_agent, examples/agents_sdk) and the default
tool of the tool service (`tool_service.py`): `calc(expr)` returns the value, or an
"error: ..." string the model reads like any other result.
"""

from __future__ import annotations

import ast

# the calculator as the model sees it in its prompt (an OpenAI tool definition)
TOOLS = [{"type": "function", "function": {
    "name": "calc",
    "description": "Evaluate an arithmetic expression",
    "parameters": {"type": "object", "properties": {"expr": {"type": "string"}},
                   "required": ["expr"]},
}}]
MAX_EXPR_CHARS = 64  # bounds the size of any result: no powers, so digits grow linearly
OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b}


class CalcError(ValueError):
    pass


def _value(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _value(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in OPS:
        return OPS[type(node.op)](_value(node.left), _value(node.right))
    if isinstance(node, (ast.BinOp, ast.UnaryOp)):
        raise CalcError(f"unsupported operator {type(node.op).__name__}; allowed: + - *")
    if isinstance(node, ast.Constant):
        raise CalcError(f"only integers are allowed, got {node.value!r}")
    raise CalcError(f"unsupported syntax: {type(node).__name__}")


def calc(expr: str) -> str:
    """The tool: the value of an integer + - * expression, or an "error: ..." string."""
    if not isinstance(expr, str) or not expr.strip():
        return "error: expr must be a non-empty string"
    if len(expr) > MAX_EXPR_CHARS:
        return f"error: expr longer than {MAX_EXPR_CHARS} characters"
    try:
        return str(_value(ast.parse(expr.strip(), mode="eval").body))
    except (SyntaxError, CalcError) as err:
        return f"error: {err.msg if isinstance(err, SyntaxError) else err}"
