"""Single-turn RL with verifiable rewards: a chat prompt, a group of sampled answers, a reward each.

The group's samples are separate engine requests issued together, so the engine batches them and a
remote client may spread them over servers; they share `group_id` for GRPO-style baselines.
Its evaluation (`aevaluate`) is answer accuracy: greedy, and pass@k when `eval_cfg` asks for it.
"""

from __future__ import annotations

import asyncio
from typing import Any

from asyncrl.api import (EvalReport, GenerationConfig, InferenceEngine, ModelRequest, Sample,
                         Trajectory)
from asyncrl.models.chat import encode_chat_prompt, stop_at_eos
from asyncrl.reward.call import RewardFn, call_reward
from asyncrl.rollout.answer_eval import EvalConfig, evaluate


class RLVRWorkflow:
    def __init__(self, reward_fn: RewardFn, gconfig: GenerationConfig, tokenizer: Any,
                 eval_cfg: EvalConfig | None = None) -> None:
        self.reward_fn, self.tokenizer = reward_fn, tokenizer
        self.gconfig = stop_at_eos(gconfig, tokenizer)
        self.eval_cfg = eval_cfg or EvalConfig()

    async def aevaluate(self, engine: InferenceEngine, rows: list[dict[str, Any]]) -> EvalReport:
        result = await evaluate(engine, self.tokenizer, rows, self.reward_fn, self.eval_cfg)
        return result.report()

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> Trajectory:
        prompt = encode_chat_prompt(self.tokenizer, data["messages"])
        one = self.gconfig.replace(n_samples=1)
        seeds = [None if one.seed is None else one.seed + i for i in range(self.gconfig.n_samples)]
        responses = await asyncio.gather(*(
            engine.agenerate(ModelRequest(input_ids=prompt, gconfig=one.replace(seed=s)))
            for s in seeds))
        samples = []
        for resp in responses:
            text = self.tokenizer.decode(resp.output_tokens, skip_special_tokens=True)
            reward = await call_reward(self.reward_fn, text, data)
            samples.append(Sample.from_prompt_and_completion(
                prompt, resp.output_tokens, resp.output_logprobs, resp.output_versions,
                reward=reward, stop_reason=resp.stop_reason,
                metadata={"completion_text": text}))
        return Trajectory(samples, group_id=str(data.get("id", "")))
