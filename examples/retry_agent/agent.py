"""A multi-turn agent that retries after feedback: answer, hear "Wrong, try again.", answer again.

Each turn is scored on its own and returned as a dict keyed by completion id, so a right answer
after a retry rewards that turn, and with `turn_discount` g the earlier turns get r_i + g * G_i+1.
    asyncrl train examples/retry_agent/train.yaml
"""

from __future__ import annotations

from asyncrl.reward.exact import exact_answer_reward
from examples.openai_client import openai_client


class RetryAgent:
    def __init__(self, max_turns: int = 3, max_tokens: int = 8) -> None:
        self.max_turns, self.max_tokens = max_turns, max_tokens

    async def run(self, data, **extra_kwargs) -> dict[str, float]:
        client = openai_client(extra_kwargs)
        messages, rewards = list(data["messages"]), {}
        for _ in range(self.max_turns):
            reply = await client.chat.completions.create(
                model="default", messages=messages, max_tokens=self.max_tokens)
            message = reply.choices[0].message
            score = exact_answer_reward(message.content or "", str(data["answer"]))
            rewards[reply.id] = score
            if score == 1.0:
                break
            messages += [{"role": "assistant", "content": message.content},
                         {"role": "user", "content": "Wrong, try again."}]
        return rewards
