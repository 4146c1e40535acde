"""The documents' single-step Environment: the row's prompt is the observation, the model's reply
the action, the run's reward (whatever `reward:` names: math for math-verify, code for sandboxed
tests, exact, ...) the step's reward, and the episode ends.

`asyncrl train examples/agent_env/train.yaml` pairs it with the reference chat agent
(asyncrl.rollout.arithmetic_env:ChatAgent). Each is built per episode: the env with the row
(`data`) and the run's opened reward (`reward_fn`), the agent with the tokenizer, sampling
settings and chat options, because their signatures ask for them.
"""

from __future__ import annotations

from typing import Any

from gymnasium import spaces

from asyncrl.reward.call import call_reward


class SingleStepTaskEnv:
    observation_space = spaces.Text(max_length=4096)
    action_space = spaces.Text(max_length=4096, min_length=0)

    def __init__(self, data: dict[str, Any], reward_fn: Any) -> None:
        self.data, self.reward_fn = data, reward_fn

    async def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None
                    ) -> tuple[str, dict[str, Any]]:
        return self.data["messages"][-1]["content"], {"id": self.data.get("id")}

    async def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        reward = await call_reward(self.reward_fn, action, self.data)
        return "", reward, True, False, {}
