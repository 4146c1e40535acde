"""Arithmetic answered through a checking tool: guess, have the guess checked, answer.

The episode the `tool_calls` workflow runs on these rows: the policy sees `37+45=`, calls the
`check` tool with its guess (`<tool_call>{"name":"check","arguments":{"answer":"83"}}</tool_call>`
in the hermes format), reads `correct` or `wrong`, and answers. The tool stands for a remote
verifier or judge: it is served by the tool service (asyncrl/rollout/tool_service.py) with a
configured service time, and knows the problem from the episode's `tool_context` (the harness's
per-episode state, as a sandbox or an environment id would be), not from the policy.

Rows hold `messages` and `answer` (RL prompts), `tools` and `tool_context`, and a demonstration
`conversation` that SFT trains on instead. The demonstrations are deliberately imperfect, like the
main job's: `guess_habit` of the first guesses are one too many (the rest right), and after
`wrong` the demonstrated answer is the right sum only `revise_right` of the time (else the wrong
guess again). So a warm start calls the tool every time but answers with the habits, and RL has
room to move both the guesses and the answers after `wrong`.
"""

from __future__ import annotations

import json
import random
from typing import Any, Literal

import pydantic

from asyncrl.config import Config
from asyncrl.data.arithmetic import ArithmeticTask, ArithmeticTaskConfig
from asyncrl.data.split import Row

CORRECT, WRONG = "correct", "wrong"
# the checker as the model sees it in its prompt (an OpenAI tool definition)
CHECK_TOOLS = [{"type": "function", "function": {
    "name": "check",
    "description": "Check an answer to the problem",
    "parameters": {"type": "object", "properties": {"answer": {"type": "string"}},
                   "required": ["answer"]},
}}]


def check(answer: str, context: dict[str, Any] | None = None) -> str:
    """The tool: `correct` when `answer` is the episode's answer (`context["answer"]`), else
    `wrong`; an episode without a context gets an error the model reads."""
    if not context or "answer" not in context:
        return "error: this episode has no problem to check against"
    return CORRECT if str(answer).strip() == str(context["answer"]) else WRONG


class ArithmeticCheckTaskConfig(Config):
    # arithmetic answered through the `check` tool (the workflow: kind tool_calls with
    # schemas asyncrl.data.arithmetic_check:CHECK_TOOLS)
    # the dataset (DATASETS: arithmetic | arithmetic_check | chain | counting | gsm8k | jsonl | parquet | hf)
    kind: Literal["arithmetic_check"] = "arithmetic_check"
    digits: int = pydantic.Field(2, ge=1, le=6, description="max digits per operand")
    num_train: int = pydantic.Field(9000, ge=0)
    num_eval: int = pydantic.Field(500, ge=0)  # held-out problems, never trained on
    seed: int = 0  # the problems drawn (train and eval) and the demonstrations' habits
    # share of demonstrated first guesses that are one too many (the rest are right)
    guess_habit: float = pydantic.Field(0.6, ge=0.0, le=1.0)
    # share of demonstrations where the answer after `wrong` is the right sum (else the guess)
    revise_right: float = pydantic.Field(0.4, ge=0.0, le=1.0)

    def build(self) -> ArithmeticCheckTask:
        return ArithmeticCheckTask(self)


def _call(guess: int) -> dict[str, Any]:
    return {"id": "call_0", "type": "function", "function": {
        "name": "check", "arguments": json.dumps({"answer": str(guess)}, separators=(",", ":"))}}


class ArithmeticCheckTask:
    """The arithmetic task's problems (2 operands, +) with tools, context and demonstrations."""

    def __init__(self, cfg: ArithmeticCheckTaskConfig) -> None:
        self.cfg = cfg
        base = ArithmeticTask(ArithmeticTaskConfig(digits=cfg.digits, num_train=cfg.num_train,
                                                   num_eval=cfg.num_eval, seed=cfg.seed))
        rng = random.Random(cfg.seed + 1)
        self._train = [self._row(r, rng) for r in base.train_rows()]
        self._eval = [self._row(r, rng) for r in base.eval_rows()]

    def train_rows(self) -> list[Row]:
        return list(self._train)

    def eval_rows(self) -> list[Row]:
        return list(self._eval)

    def _row(self, row: Row, rng: random.Random) -> Row:
        value = int(row["answer"])
        guess = value + 1 if rng.random() < self.cfg.guess_habit else value
        verdict = CORRECT if guess == value else WRONG
        final = value if verdict == CORRECT or rng.random() < self.cfg.revise_right else guess
        conversation = [*row["messages"],
                        {"role": "assistant", "content": None, "tool_calls": [_call(guess)]},
                        {"role": "tool", "tool_call_id": "call_0", "content": verdict},
                        {"role": "assistant", "content": str(final)}]
        return {**row, "id": row["id"].replace("arith", "check", 1), "tools": CHECK_TOOLS,
                "tool_context": {"answer": row["answer"]}, "conversation": conversation}
