"""Arithmetic answered, then submitted to a remote grader through a tool call.

The episode the `tool_calls` workflow runs on these rows: the policy sees `37+45=`, writes its
answer and calls the `submit` tool (`82<tool_call>{"name":"submit","arguments":{}}</tool_call>` in
the hermes format), reads the grader's verdict (`correct` or `wrong`) and closes the episode
(`Done.`). The tool stands for a remote grader or test runner that an agent submits its work to,
as a coding agent's `submit` sends the state of its workspace: it is served by the tool service
(asyncrl/rollout/tool_service.py) with a configured service time, and grades the reply that
made the call against the episode's answer (both in the call's `context`: the harness's, not the
policy's). `verdict_reward` is the episode's reward: 1 when the grader said `correct`.

The prompt shows no tool list: the tiny model's arithmetic is tied to the positions it learned
it at (a tool list before the question took its sampled accuracy from 37% to 1.5%), so the
layout before the answer is the main job's and the demonstrations teach the call. Rows hold
`messages` and `answer` (RL prompts), `tool_context`, and a demonstration `conversation` that SFT
trains on instead; as in the main job, `label_noise` of the training rows' demonstrated answers are
one too many (the held-out rows' are right).
"""

from __future__ import annotations

import random
from typing import Any, Literal

import pydantic

from asyncrl.data.arithmetic import ArithmeticTask, ArithmeticTaskConfig
from asyncrl.data.kind import DatasetKind
from asyncrl.data.split import Row

CORRECT, WRONG, DONE = "correct", "wrong", "Done."
# the grader as an OpenAI tool definition (for a prompt that lists its tools)
SUBMIT_TOOLS = [{"type": "function", "function": {
    "name": "submit",
    "description": "Submit the answer written before this call for grading",
    "parameters": {"type": "object", "properties": {}},
}}]
CALL = {"id": "call_0", "type": "function", "function": {"name": "submit", "arguments": "{}"}}


def submit(context: dict[str, Any] | None = None) -> str:
    """The tool: `correct` when the reply that made the call (`context["reply"]`) is the
    episode's answer (`context["answer"]`), else `wrong`."""
    if not context or "answer" not in context:
        return "error: this episode has nothing to grade against"
    return CORRECT if str(context.get("reply", "")).strip() == str(context["answer"]) else WRONG


def verdict_reward(text: str, data: dict[str, Any]) -> float:
    """1 when the episode's first tool result is the grader's `correct`, else 0."""
    return 1.0 if data.get("tool_results", [])[:1] == [CORRECT] else 0.0


class ArithmeticSubmitTaskConfig(DatasetKind):
    # sums answered and submitted to a remote grader with the `submit` tool (the workflow: kind
    # tool_calls, tools {submit: asyncrl.data.arithmetic_submit:submit}, schemas null)
    # the dataset (DATASETS: arithmetic | arithmetic_submit | chain | counting | gsm8k | jsonl | parquet | hf)
    kind: Literal["arithmetic_submit"] = "arithmetic_submit"
    digits: int = pydantic.Field(2, ge=1, le=6, description="max digits per operand")
    num_train: int = pydantic.Field(9000, ge=0)
    num_eval: int = pydantic.Field(500, ge=0)  # held-out problems, never trained on
    seed: int = 0  # the problems drawn (train and eval) and the demonstrations' noise
    # share of demonstrated answers that are one too many (the main job's habit)
    label_noise: float = pydantic.Field(0.6, ge=0.0, le=1.0)

    def build(self) -> ArithmeticSubmitTask:
        return ArithmeticSubmitTask(self)


class ArithmeticSubmitTask:
    """The arithmetic task's problems, submitted through the tool, with demonstrations."""

    def __init__(self, cfg: ArithmeticSubmitTaskConfig) -> None:
        self.cfg = cfg
        base = ArithmeticTask(ArithmeticTaskConfig(digits=cfg.digits, num_train=cfg.num_train,
                                                   num_eval=cfg.num_eval, seed=cfg.seed))
        rng = random.Random(cfg.seed + 1)
        self._train = [self._row(r, rng) for r in base.train_rows()]
        # held-out demonstrations are right: an SFT eval scores the reply against them
        self._eval = [self._row(r, rng, noise=0.0) for r in base.eval_rows()]

    def train_rows(self) -> list[Row]:
        return list(self._train)

    def eval_rows(self) -> list[Row]:
        return list(self._eval)

    def _row(self, row: Row, rng: random.Random, noise: float | None = None) -> Row:
        value = int(row["answer"])
        noise = self.cfg.label_noise if noise is None else noise
        shown = value + 1 if rng.random() < noise else value
        conversation = [*row["messages"],
                        {"role": "assistant", "content": str(shown), "tool_calls": [CALL]},
                        {"role": "tool", "tool_call_id": "call_0",
                         "content": CORRECT if shown == value else WRONG},
                        {"role": "assistant", "content": DONE}]
        return {**row, "id": row["id"].replace("arith", "submit", 1),
                "tool_context": {"answer": row["answer"]}, "conversation": conversation}
