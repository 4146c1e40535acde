"""A LangChain agent as an asyncrl agent program: `ChatOpenAI` with a bound tool, unchanged but for
the endpoint asyncrl gives it (its recording proxy during RL, or `asyncrl serve`).

The loop is LangChain's own tool-calling pattern: invoke the model with the tool bound, run each
tool call it returns, send the results back as ToolMessages, and take the final reply. Install
LangChain with `pip install langchain-openai`.
"""

from __future__ import annotations

from typing import Any

from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

from asyncrl.rollout import calculator


@tool
def calc(expr: str) -> str:
    """Evaluate an integer arithmetic expression such as "12+34*2" and return the result."""
    return calculator.calc(expr)


class LangChainMathAgent:
    """Answers the row's question; reward 1.0 for the exact answer, else 0.0."""

    def __init__(self, max_tokens: int = 8, max_turns: int = 3) -> None:
        self.max_tokens, self.max_turns = max_tokens, max_turns

    async def run(self, data: dict[str, Any], base_url: str, api_key: str, **_: Any) -> float:
        model = ChatOpenAI(model="default", base_url=base_url, api_key=api_key,
                           max_tokens=self.max_tokens, max_retries=0).bind_tools([calc])
        messages = [SystemMessage(m["content"]) if m["role"] == "system"
                    else HumanMessage(m["content"]) for m in data["messages"]]
        reply = await model.ainvoke(messages)
        for _ in range(self.max_turns - 1):
            if not reply.tool_calls:
                break
            messages.append(reply)
            for call in reply.tool_calls:
                messages.append(ToolMessage(await calc.ainvoke(call["args"]),
                                            tool_call_id=call["id"]))
            reply = await model.ainvoke(messages)
        text = reply.content if isinstance(reply.content, str) else ""
        return 1.0 if text.strip() == str(data["answer"]).strip() else 0.0
