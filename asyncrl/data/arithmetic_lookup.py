"""Arithmetic whose problem sits behind a tool: look the problem up, then answer it.

The episode the `tool_calls` workflow runs on these rows: the policy is asked to solve "the
problem", calls the `get_problem` tool (`<tool_call>{"name":"get_problem","arguments":{}}
</tool_call>` in the hermes format), reads `37+45=` and answers. The tool stands for what an
agent fetches from a remote environment before it can act (a file, a page, an observation): the
tool service (asyncrl/rollout/tool_service.py) answers it after a configured service time, and
knows the episode's problem from its `tool_context` (the harness's per-episode state, as a
sandbox id would be).

Rows hold `messages` and `answer` (RL prompts), `tools` and `tool_context`, and a demonstration
`conversation` that SFT trains on instead. As in the main job the demonstrations are biased:
`label_noise` of the demonstrated answers are one too many, so a warm start calls the tool every
time and answers with the habit, and RL has room to move the answers.
"""

from __future__ import annotations

import random
from typing import Any, Literal

import pydantic

from asyncrl.config import Config
from asyncrl.data.arithmetic import ArithmeticTask, ArithmeticTaskConfig
from asyncrl.data.split import Row

ASK = "Solve the problem."
# the tool as the model sees it in its prompt (an OpenAI tool definition)
LOOKUP_TOOLS = [{"type": "function", "function": {
    "name": "get_problem",
    "description": "Fetch the problem to solve",
    "parameters": {"type": "object", "properties": {}},
}}]
CALL = {"id": "call_0", "type": "function",
        "function": {"name": "get_problem", "arguments": "{}"}}


def get_problem(context: dict[str, Any] | None = None) -> str:
    """The tool: the episode's problem (`context["problem"]`); an episode without one gets an
    error the model reads."""
    if not context or "problem" not in context:
        return "error: this episode has no problem"
    return str(context["problem"])


class ArithmeticLookupTaskConfig(Config):
    # sums whose problem the policy fetches through the `get_problem` tool (the workflow: kind
    # tool_calls with schemas asyncrl.data.arithmetic_lookup:LOOKUP_TOOLS)
    # the dataset (DATASETS: arithmetic | arithmetic_lookup | chain | counting | gsm8k | jsonl | parquet | hf)
    kind: Literal["arithmetic_lookup"] = "arithmetic_lookup"
    digits: int = pydantic.Field(2, ge=1, le=6, description="max digits per operand")
    num_train: int = pydantic.Field(9000, ge=0)
    num_eval: int = pydantic.Field(500, ge=0)  # held-out problems, never trained on
    seed: int = 0  # the problems drawn (train and eval) and the demonstrations' noise
    # share of demonstrated answers that are one too many (the main job's habit)
    label_noise: float = pydantic.Field(0.6, ge=0.0, le=1.0)

    def build(self) -> ArithmeticLookupTask:
        return ArithmeticLookupTask(self)


class ArithmeticLookupTask:
    """The arithmetic task's problems behind the lookup tool, with demonstrations."""

    def __init__(self, cfg: ArithmeticLookupTaskConfig) -> None:
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
        shown = value + 1 if rng.random() < self.cfg.label_noise else value
        problem = row["messages"][0]["content"]
        ask = [{"role": "user", "content": ASK}]
        conversation = [*ask, {"role": "assistant", "content": None, "tool_calls": [CALL]},
                        {"role": "tool", "tool_call_id": "call_0", "content": problem},
                        {"role": "assistant", "content": str(shown)}]
        return {**row, "id": row["id"].replace("arith", "lookup", 1), "messages": ask,
                "tools": LOOKUP_TOOLS, "tool_context": {"problem": problem},
                "conversation": conversation}
