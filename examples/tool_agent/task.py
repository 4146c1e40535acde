"""The calculator tool task: 2-digit x 2-digit products the tiny model cannot compute by itself.

The agent sees `37*45=?` and one tool, `calc(expr)`. Succeeding means calling the tool with the
right expression and copying its result into the final answer; guessing almost never works. The
calculator is asyncrl.rollout.calculator's: integer literals and + - * only.
"""

from __future__ import annotations

import json
import random
import re

from asyncrl.rollout.calculator import TOOLS, calc  # noqa: F401 (the task's tool)

CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
INTEGER = re.compile(r"-?\d+")


def arguments_json(expr: str) -> str:
    """The call's arguments as compact JSON: what the proxy returns and the template renders."""
    return json.dumps({"expr": expr}, separators=(",", ":"))


def tool_call_text(expr: str) -> str:
    """A well-formed call exactly as the chat template renders it (and the model should write)."""
    return f'<tool_call>{{"name":"calc","arguments":{arguments_json(expr)}}}</tool_call>'


def parse_call(text: str) -> str | None:
    """The `expr` of a reply that is exactly one well-formed calc call (content around it allowed,
    as the proxy allows it), else None. Mirrors what the proxy turns into `tool_calls`."""
    bodies = CALL.findall(text)
    rest = CALL.sub("", text)
    if len(bodies) != 1 or "<tool_call>" in rest or "</tool_call>" in rest:
        return None
    try:
        obj = json.loads(bodies[0])
    except json.JSONDecodeError:
        return None
    args = obj.get("arguments") if isinstance(obj, dict) else None
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if obj.get("name") != "calc" or not isinstance(args, dict):
        return None
    expr = args.get("expr")
    return expr if isinstance(expr, str) else None


def make_problem(rng: random.Random) -> tuple[int, int]:
    return rng.randint(10, 99), rng.randint(10, 99)


def all_problems() -> list[tuple[int, int]]:
    return [(a, b) for a in range(10, 100) for b in range(10, 100)]


def user_message(a: int, b: int) -> str:
    return f"{a}*{b}=?"


def check_answer(text: str, answer: int | str) -> float:
    """1.0 when the last integer in a final (non-tool-call) reply equals the answer."""
    if "<tool_call>" in text:
        return 0.0
    numbers = INTEGER.findall(text)
    return 1.0 if numbers and numbers[-1] == str(answer).strip() else 0.0


TOOL_CREDIT = 0.5  # an episode whose tool call returned the answer but whose reply is wrong


def episode_reward(text: str, data: dict) -> float:
    """The reward of a `tool_calls` episode: 1 for the right final answer, TOOL_CREDIT when a
    tool returned the answer but the reply did not copy it (a process reward: the warm start
    calls the tool more reliably than it copies the result), else 0."""
    if check_answer(text, data["answer"]):
        return 1.0
    return TOOL_CREDIT if str(data["answer"]) in data.get("tool_results", ()) else 0.0
