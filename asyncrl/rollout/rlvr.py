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
    """Single-turn RL with a verifiable reward: one chat prompt, a group of sampled answers, each
    scored by a reward function; the workflow `asyncrl train` runs by default (`workflow: rlvr`).

    Args:
        reward_fn: `reward(completion_text, row) -> float`, sync or async.
        gconfig: the sampling settings; `n_samples` is the group size, and the tokenizer's EOS is
            added to the stop tokens.
        tokenizer: the model's tokenizer (chat template, decoding).
        eval_cfg: how `aevaluate` scores held-out rows (None: the defaults).
        chat: the model's chat options: template variables and reasoning parser.
        reward_sees_reasoning: True passes the whole reply to the reward; False, with a
            reasoning parser, only the answer after the reasoning.
        vision: a vision-language model's prompt encoder, for rows with images.
    """

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
        """Scores answer accuracy on `rows`: one greedy answer per row, and sampled ones for
        pass@k when `eval_cfg.pass_k` asks for them.

        Args:
            engine: the engine serving the policy to evaluate.
            rows: held-out data rows with `messages` (and the fields the reward reads).

        Returns:
            The report: `score` is the greedy accuracy, `metrics` hold `eval/greedy_accuracy`,
            `eval/pass@k` and the like. A row whose prompt cannot be built is skipped and
            counted.

        Raises:
            ValueError: `rows` is empty, no row has a usable prompt, or the engine refuses a
                prompt (the message names the row).
            RewardError: the reward function raised or returned a value that is not a finite
                float.
        """
        result = await evaluate(engine, self.tokenizer, rows, self.reward_fn, self.eval_cfg,
                                chat=self.chat, reward_sees_reasoning=self.reward_sees_reasoning,
                                vision=self.vision)
        return result.report()

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> Trajectory:
        """Samples `gconfig.n_samples` answers to the row's prompt and scores each.

        The answers are separate requests issued together (with a seed set, sample i uses
        seed + i); the group's rewards are computed together.

        Args:
            engine: the engine to generate with.
            data: the data row: `messages` (the chat prompt), optional `images`, `id`, and the
                fields the reward reads (e.g. `answer`).

        Returns:
            One trajectory with a sample per answer, each with its reward and completion text;
            `group_id` is the row's `id`.

        Raises:
            ValueError: the row has images and the workflow no `vision` encoder, or the engine
                refuses the request.
            RewardError: the reward function raised or returned a value that is not a finite
                float.
        """
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
