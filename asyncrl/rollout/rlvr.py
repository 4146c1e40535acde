"""Single-turn RL with verifiable rewards: a chat prompt, a group of sampled answers, a reward each.

The group's samples are separate engine requests issued together, so the engine batches them and a
remote client may spread them over servers; they share `group_id` for GRPO-style baselines.
Its evaluation (`aevaluate`) is answer accuracy: greedy, and pass@k when `eval_cfg` asks for it.

`chat` (the model's ChatOptions) renders prompts with its template variables; with a reasoning
parser the reward reads the answer after `</think>` unless `reward_sees_reasoning`, while the
sample always holds every sampled token (the trainer learns from what was generated).
"""

from __future__ import annotations

import asyncio
from typing import Any

from asyncrl.api import (EvalReport, GenerationConfig, InferenceEngine, ModelRequest, Sample,
                         Trajectory)
from asyncrl.models.chat import stop_at_eos
from asyncrl.models.chat_options import ChatOptions
from asyncrl.models.vision import VisionPromptEncoder, row_prompt
from asyncrl.reward.call import RewardFn, call_rewards
from asyncrl.rollout.answer_eval import EvalConfig, evaluate


class RLVRWorkflow:
    def __init__(self, reward_fn: RewardFn, gconfig: GenerationConfig, tokenizer: Any,
                 eval_cfg: EvalConfig | None = None, chat: ChatOptions | None = None,
                 reward_sees_reasoning: bool = False,
                 vision: VisionPromptEncoder | None = None) -> None:
        """`vision`: a vision-language model's prompt encoder (rows with images)."""
        self.reward_fn, self.tokenizer, self.vision = reward_fn, tokenizer, vision
        self.gconfig = stop_at_eos(gconfig, tokenizer)
        self.eval_cfg = eval_cfg or EvalConfig()
        self.chat, self.reward_sees_reasoning = chat or ChatOptions(), reward_sees_reasoning

    async def aevaluate(self, engine: InferenceEngine, rows: list[dict[str, Any]]) -> EvalReport:
        result = await evaluate(engine, self.tokenizer, rows, self.reward_fn, self.eval_cfg,
                                chat=self.chat, reward_sees_reasoning=self.reward_sees_reasoning,
                                vision=self.vision)
        return result.report()

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> Trajectory:
        kwargs = self.chat.template_kwargs()
        prompt, images = row_prompt(self.tokenizer, self.vision, data, kwargs)
        one = self.gconfig.replace(n_samples=1)
        seeds = [None if one.seed is None else one.seed + i for i in range(self.gconfig.n_samples)]
        responses = await asyncio.gather(*(
            engine.agenerate(ModelRequest(input_ids=prompt, gconfig=one.replace(seed=s),
                                          images=images))
            for s in seeds))
        texts = [self.tokenizer.decode(r.output_tokens, skip_special_tokens=True)
                 for r in responses]
        answers = [self.chat.reward_text(t, self.reward_sees_reasoning, kwargs) for t in texts]
        # the group's rewards together: a batched reward (TRL adapter) sees the whole group,
        # slow off-loop ones overlap
        rewards = await call_rewards(self.reward_fn, answers, data,
                                     [r.output_tokens for r in responses])
        samples = []
        for resp, text, reward in zip(responses, texts, rewards):
            samples.append(Sample.from_prompt_and_completion(
                prompt, resp.output_tokens, resp.output_logprobs, resp.output_versions,
                reward=reward, stop_reason=resp.stop_reason,
                metadata={"completion_text": text}, routes=resp.routes))
            samples[-1].images = images
        return Trajectory(samples, group_id=str(data.get("id", "")))
