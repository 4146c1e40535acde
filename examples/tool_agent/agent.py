"""A calculator agent through OpenAI tool calls: call `calc`, read the result, answer.

The model sees `37*45=?` and the tool list; a well-formed call comes back from the proxy as
`tool_calls`, the agent runs the calculator and sends the result as a `tool` message, and the
final answer is scored. A reply without a (well-formed) call is taken as the final answer, so a
malformed call or a guess scores 0 unless it happens to be right. `tool_credit` is partial credit
for an episode whose call computed the asked product but whose final answer is wrong (a process
reward: the tiny warm start calls the tool far more reliably than it copies the result back).
`tool_url`: call the calculator on a tool service over HTTP (asyncrl/rollout/tool_service.py, with
its configured service time) instead of in process; its failures are results the model reads.
    python -m examples.tool_agent.make_data                       # data files
    asyncrl sft examples/tool_agent/sft.yaml                      # warm start (cached)
    asyncrl train examples/tool_agent/train.yaml                  # RL through the proxy
"""

from __future__ import annotations

import json

from asyncrl.rollout.tool_service import ToolClient
from examples.openai_client import openai_client
from examples.tool_agent.task import TOOLS, calc, check_answer


class CalculatorAgent:
    def __init__(self, max_tokens: int = 80, max_tool_rounds: int = 1,
                 tool_credit: float = 0.0, tool_url: str | None = None,
                 tool_timeout_s: float = 30.0) -> None:
        self.max_tokens, self.max_tool_rounds = max_tokens, max_tool_rounds
        self.tool_credit = tool_credit
        self.tool_url, self.tool_timeout_s, self._tools = tool_url, tool_timeout_s, None

    async def calc(self, expr: str) -> str:
        if self.tool_url is None:
            return calc(expr)
        if self._tools is None:  # made on the event loop the agent runs on
            self._tools = ToolClient(self.tool_url, self.tool_timeout_s)
        return (await self._tools.call("calc", {"expr": expr})).text

    async def aclose(self) -> None:
        if self._tools is not None:
            await self._tools.aclose()

    async def run(self, data, **extra_kwargs) -> float:
        client = openai_client(extra_kwargs)
        messages, right_call = list(data["messages"]), False
        for _ in range(self.max_tool_rounds + 1):
            reply = await client.chat.completions.create(
                model="default", messages=messages, tools=TOOLS, max_tokens=self.max_tokens)
            message = reply.choices[0].message
            if not message.tool_calls:
                correct = check_answer(message.content or "", data["answer"])
                return correct if correct or not right_call else self.tool_credit
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls:
                try:
                    expr = json.loads(call.function.arguments).get("expr", "")
                except (json.JSONDecodeError, AttributeError):
                    expr = ""
                result = await self.calc(expr) if call.function.name == "calc" else \
                    "error: unknown tool"
                right_call = right_call or result == str(data["answer"])
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        return 0.0  # still calling tools after max_tool_rounds
