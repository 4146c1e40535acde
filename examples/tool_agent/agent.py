"""A calculator agent through OpenAI tool calls: call `calc`, read the result, answer.

The model sees `37*45=?` and the tool list; a well-formed call comes back from the proxy as
`tool_calls`, the agent runs the calculator and sends the result as a `tool` message, and the
final answer is scored. A reply without a (well-formed) call is taken as the final answer, so a
malformed call or a guess scores 0 unless it happens to be right. `tool_credit` is partial credit
for an episode whose call computed the asked product but whose final answer is wrong (a process
reward: the tiny warm start calls the tool far more reliably than it copies the result back).
    python -m examples.tool_agent.make_data                       # data files
    asyncrl sft examples/tool_agent/sft.yaml                      # warm start (cached)
    asyncrl train examples/tool_agent/train.yaml                  # RL through the proxy
"""

from __future__ import annotations

import json

from examples.openai_client import openai_client
from examples.tool_agent.task import TOOLS, calc, check_answer


class CalculatorAgent:
    def __init__(self, max_tokens: int = 80, max_tool_rounds: int = 1,
                 tool_credit: float = 0.0) -> None:
        self.max_tokens, self.max_tool_rounds = max_tokens, max_tool_rounds
        self.tool_credit = tool_credit

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
                result = calc(expr) if call.function.name == "calc" else "error: unknown tool"
                right_call = right_call or result == str(data["answer"])
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        return 0.0  # still calling tools after max_tool_rounds
