"""An OpenAI Agents SDK agent as an asyncrl agent program (`async def run(data, **kw) -> float`).

The agent code is plain Agents SDK; only the client is pointed at the `base_url` / `api_key` that
asyncrl injects (its recording proxy during RL, or any OpenAI-compatible server such as
`asyncrl serve` at http://HOST:PORT/v1). Install the SDK with `pip install -e ".[agents]"`.

The agent uses the SDK's default model class (the Responses API, /v1/responses), which the
proxy and `asyncrl serve` speak; the run's provider is given the client. The SDK's tracing
exports to api.openai.com by default, so every run disables it (RunConfig(tracing_disabled=True)).

The instance holds only plain settings (no client, no SDK objects), so it pickles for the
`subproc` runner; a client is built per call, which also keeps sessions apart.
"""

from __future__ import annotations

import os
from typing import Any

from agents import Agent, ModelSettings, OpenAIProvider, RunConfig, Runner, function_tool
from agents.exceptions import ModelBehaviorError
from openai import AsyncOpenAI

from asyncrl.rollout import calculator

@function_tool
def calc(expr: str) -> str:
    """Evaluate an integer arithmetic expression such as "12+34*2" and return the result."""
    return calculator.calc(expr)


def run_config(client: AsyncOpenAI) -> RunConfig:
    """The SDK's default provider (its Responses model) on `client`; no tracing upload."""
    return RunConfig(model_provider=OpenAIProvider(openai_client=client), tracing_disabled=True)


class AgentsSDKMathAgent:
    """Answers a math prompt with one Agents SDK agent; reward 1.0 for the exact answer, else 0.0.

    `max_tokens`/`temperature` go out as the only sampling fields of the request (ModelSettings
    leaves everything else unset); `use_calculator` gives the agent the `calc` function tool.
    """

    def __init__(self, instructions: str | None = None, max_tokens: int = 8,
                 temperature: float = 1.0, use_calculator: bool = False,
                 model: str = "default", max_turns: int = 4) -> None:
        self.instructions = instructions
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.use_calculator = use_calculator
        self.model = model
        self.max_turns = max_turns

    def build_agent(self) -> Agent:
        return Agent(
            name="math",
            instructions=self.instructions,
            model=self.model,
            model_settings=ModelSettings(max_tokens=self.max_tokens, temperature=self.temperature),
            tools=[calc] if self.use_calculator else [],
        )

    async def solve(self, data: dict[str, Any], **extra_kwargs: Any) -> str:
        """The agent's final output for `data["messages"]` (the chat prompt, system turn included)."""
        http_client = extra_kwargs.get("http_client")
        # subproc runners may pass the endpoint only through the environment
        client = AsyncOpenAI(
            base_url=extra_kwargs.get("base_url") or os.environ["OPENAI_BASE_URL"],
            api_key=extra_kwargs.get("api_key") or os.environ["OPENAI_API_KEY"],
            http_client=http_client,
            max_retries=0,  # a retried completion would be recorded twice
        )
        try:
            result = await Runner.run(self.build_agent(), list(data["messages"]),
                                      max_turns=self.max_turns, run_config=run_config(client))
        finally:
            if http_client is None:  # a shared, injected client belongs to the caller
                await client.close()
        return str(result.final_output)

    async def run(self, data: dict[str, Any], **extra_kwargs: Any) -> float:
        try:
            output = await self.solve(data, **extra_kwargs)
        except ModelBehaviorError:
            # The SDK raises when a reply ends at max_tokens (status "incomplete", as OpenAI
            # reports it) or is malformed: the reply is recorded all the same, and earns 0.
            return 0.0
        return 1.0 if output.strip() == str(data["answer"]).strip() else 0.0
