"""A math agent written with nothing but the `openai` SDK: ask once, score the answer.

Train it on the embedded arithmetic task (from the repository root):
    asyncrl train examples/math_agent/train.yaml
The same class runs unchanged against any OpenAI-compatible endpoint.
"""

from __future__ import annotations

from asyncrl.reward.exact import exact_answer_reward
from examples.openai_client import openai_client


class MathAgent:
    def __init__(self, max_tokens: int = 8) -> None:
        self.max_tokens = max_tokens

    async def run(self, data, **extra_kwargs) -> float:
        client = openai_client(extra_kwargs)
        reply = await client.chat.completions.create(
            model="default", messages=data["messages"], max_tokens=self.max_tokens)
        return exact_answer_reward(reply.choices[0].message.content or "", str(data["answer"]))
