"""A Gym-like arithmetic environment and a chat agent: the reference Agent + Environment pair.

The environment shows a problem, scores each answer with the exact-answer check and, when it is
wrong, shows feedback as the next observation; it terminates on a correct answer. The agent keeps
the conversation and asks the engine for the next reply each step.
"""

from __future__ import annotations

from typing import Any, SupportsFloat

from gymnasium import spaces

from asyncrl.api import AgentAction, GenerationConfig, InferenceEngine, ModelRequest
from asyncrl.models.chat import encode_chat_prompt, stop_at_eos
from asyncrl.models.chat_options import ChatOptions
from asyncrl.reward.exact import exact_answer_reward

CHARSET = "".join(chr(c) for c in range(32, 127)) + "\n"


class ArithmeticEnv:
    observation_space = spaces.Text(max_length=512, charset=CHARSET)
    action_space = spaces.Text(max_length=512, min_length=0, charset=CHARSET)

    def __init__(self, data: dict[str, Any], feedback: str = "Wrong, try again.") -> None:
        self.data, self.feedback = data, feedback

    async def reset(self, *, seed: int | None = None,
                    options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        return self.data["messages"][-1]["content"], {"id": self.data.get("id")}

    async def step(self, action: str) -> tuple[str, SupportsFloat, bool, bool, dict[str, Any]]:
        reward = exact_answer_reward(action, str(self.data["answer"]))
        correct = reward >= 1.0
        return ("" if correct else self.feedback), reward, correct, False, {"correct": correct}


class ChatAgent:
    def __init__(self, tokenizer: Any, gconfig: GenerationConfig,
                 chat: ChatOptions | None = None) -> None:
        """`chat`: the model's chat options; its reasoning parser keeps `<think>` text out of
        the action the environment scores (the response keeps every sampled token)."""
        self.tokenizer = tokenizer
        self.chat = chat or ChatOptions()
        self.gconfig = stop_at_eos(gconfig.replace(n_samples=1), tokenizer)
        self.messages: list[dict[str, str]] = []

    async def reset(self) -> None:
        self.messages = []

    async def act(self, engine: InferenceEngine, observation: str) -> AgentAction:
        self.messages.append({"role": "user", "content": observation})
        kwargs = self.chat.template_kwargs()
        prompt = encode_chat_prompt(self.tokenizer, self.messages, template_kwargs=kwargs)
        resp = await engine.agenerate(ModelRequest(input_ids=prompt, gconfig=self.gconfig))
        text = self.tokenizer.decode(resp.output_tokens, skip_special_tokens=True)
        answer = self.chat.reward_text(text, False, kwargs)
        self.messages.append({"role": "assistant", "content": answer})
        return AgentAction(action=answer, response=resp)
