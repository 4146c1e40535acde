"""Multi-turn answering with feedback: answer, get checked, read feedback, try again (k turns).

One training sequence holds every turn: generated tokens are trained on (loss_mask 1, their
versions), feedback tokens are not (mask 0, version -1). The feedback is rendered with the chat
template right after the model's own end-of-turn token, so the sequence is token-for-token what
the template would produce for the whole conversation (no retokenisation drift).

Per-turn reward r_t = ((success_t - 0.5) * 2 - bias) * scale; earlier turns get the discounted
return G_t = r_t + discount * G_(t+1). The sample's reward is G_0 and `token_rewards` carries r_t
on the last generated token of turn t, for critics that want turn-level credit.
"""

from __future__ import annotations

from typing import Any

import pydantic

from asyncrl.api import (EvalReport, GenerationConfig, InferenceEngine, ModelRequest, Sample,
                         Trajectory)
from asyncrl.api.trajectory import PROMPT_VERSION
from asyncrl.config import Config
from asyncrl.models.chat import render_chat, stop_at_eos
from asyncrl.models import routes
from asyncrl.models.chat_options import ChatOptions
from asyncrl.reward.call import RewardFn, call_reward
from asyncrl.reward.returns import discounted_returns
from asyncrl.rollout.answer_eval import EvalConfig, evaluate


class MultiTurnConfig(Config):
    max_turns: int = pydantic.Field(3, ge=1)  # answers per episode (retries after wrong feedback)
    # each turn's return is its reward plus this times the next turn's return
    turn_discount: float = pydantic.Field(0.9, ge=0.0, le=1.0)
    # a turn's reward is ((success - 0.5) * 2 - reward_bias) * reward_scaling
    reward_scaling: float = pydantic.Field(1.0, gt=0.0)
    reward_bias: float = 0.0  # see reward_scaling
    correct_feedback: str = "Correct."  # the user turn after a right answer
    wrong_feedback: str = "Wrong, try again."  # the user turn after a wrong answer
    # with model.reasoning_parser set, the reward reads only the answer after the reasoning;
    # true: the whole reply (a reward on the reasoning's form or length)
    reward_sees_reasoning: bool = False


class MultiTurnWorkflow:
    """Multi-turn answering with feedback (`workflow: multi_turn`): the model answers, a wrong
    answer gets `cfg.wrong_feedback` as the next user turn, and it tries again, up to
    `cfg.max_turns` answers. One training sequence holds every turn.

    Args:
        reward_fn: `reward(completion_text, row) -> float`, sync or async; a score >= 1.0
            is a right answer and ends the episode.
        gconfig: the sampling settings of each turn (`n_samples` is set to 1 and the
            tokenizer's EOS is added to the stop tokens).
        tokenizer: the model's tokenizer (chat template, decoding).
        cfg: turns, discount, reward shaping and feedback texts (None: the defaults).
        eval_cfg: how `aevaluate` scores held-out rows (None: the defaults).
        chat: the model's chat options: template variables and reasoning parser.
        context_length: the longest sequence the engines take; None: no limit known.
    """

    def __init__(self, reward_fn: RewardFn, gconfig: GenerationConfig, tokenizer: Any,
                 cfg: MultiTurnConfig | None = None, eval_cfg: EvalConfig | None = None,
                 chat: ChatOptions | None = None, context_length: int | None = None) -> None:
        """`context_length`: the longest sequence the engines take (None: no limit known); an
        episode stops retrying before its next turn could overflow it."""
        self.reward_fn, self.tokenizer = reward_fn, tokenizer
        self.cfg = cfg or MultiTurnConfig()
        self.chat = chat or ChatOptions()  # the model's template variables and parsers
        self.gconfig = stop_at_eos(gconfig.replace(n_samples=1), tokenizer)
        self.eval_cfg = eval_cfg or EvalConfig()
        self.context_length = context_length

    async def aevaluate(self, engine: InferenceEngine, rows: list[dict[str, Any]]) -> EvalReport:
        """First-answer accuracy (greedy, pass@k): what the retries are trained to raise."""
        result = await evaluate(engine, self.tokenizer, rows, self.reward_fn, self.eval_cfg,
                                chat=self.chat,
                                reward_sees_reasoning=self.cfg.reward_sees_reasoning)
        return result.report()

    def feedback_ids(self, text: str) -> list[int]:
        """Returns the token ids that follow the model's end-of-turn token to give it feedback:
        a newline, then the chat template's rendering of a user message `text` followed by the
        assistant generation prompt.

        Args:
            text: the feedback, e.g. `cfg.wrong_feedback`.
        """
        rendered = "\n" + render_chat(self.tokenizer, [{"role": "user", "content": text}],
                                      template_kwargs=self.chat.template_kwargs())
        return self.tokenizer.encode(rendered, add_special_tokens=False)

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> Trajectory:
        """Runs one conversation: answer, check, feedback, answer again.

        It ends at a right answer, after `cfg.max_turns` answers, or when the next turn could
        overflow `context_length`. Generated tokens are trained on; prompt and feedback tokens
        are not. Turn t's reward is ((success - 0.5) * 2 - reward_bias) * reward_scaling, and
        the sample's reward is the discounted return of the first turn.

        Args:
            engine: the engine to generate with.
            data: the data row: `messages` (the chat prompt), `id`, and the fields the reward
                reads (e.g. `answer`).

        Returns:
            One trajectory with one sample: the whole conversation, with `token_rewards`
            holding each turn's reward on its last generated token, and `metadata` holding
            `turns`, `turn_rewards`, `turn_returns` and the last `completion_text`.

        Raises:
            ValueError: the engine refuses a request (e.g. the prompt is too long).
            RewardError: the reward function raised or returned a value that is not a finite
                float.
        """
        kwargs = self.chat.template_kwargs()
        from asyncrl.models.vision import row_prompt  # (torch: not when the config loads)

        ids = row_prompt(self.tokenizer, None, data, kwargs)[0]  # (a row with images: refused)
        mask, logps, vers = [0] * len(ids), [0.0] * len(ids), [PROMPT_VERSION] * len(ids)
        turn_rewards, turn_ends, texts, resp = [], [], [], None
        for turn in range(self.cfg.max_turns):
            resp = await engine.agenerate(ModelRequest(input_ids=list(ids), gconfig=self.gconfig))
            ids += resp.output_tokens
            mask += [1] * resp.output_len
            logps += resp.output_logprobs
            vers += resp.output_versions
            turn_ends.append(len(ids) - 1)
            text = self.tokenizer.decode(resp.output_tokens, skip_special_tokens=True)
            texts.append(text)
            answer = self.chat.reward_text(text, self.cfg.reward_sees_reasoning, kwargs)
            success = await call_reward(self.reward_fn, answer, data)
            turn_rewards.append(((success - 0.5) * 2 - self.cfg.reward_bias)
                                * self.cfg.reward_scaling)
            if success >= 1.0 or turn == self.cfg.max_turns - 1:
                break
            fb = self.feedback_ids(self.cfg.wrong_feedback)
            limit = self.context_length
            if limit is not None and len(ids) + len(fb) + self.gconfig.max_new_tokens > limit:
                break
            ids += fb
            mask += [0] * len(fb)
            logps += [0.0] * len(fb)
            vers += [PROMPT_VERSION] * len(fb)
        returns = discounted_returns(turn_rewards, self.cfg.turn_discount)
        token_rewards = [0.0] * len(ids)
        for end, r in zip(turn_ends, turn_rewards):
            token_rewards[end] = r
        sample = Sample(ids, mask, logps, vers, reward=returns[0], token_rewards=token_rewards,
                        stop_reason=resp.stop_reason, routes=routes.fit(resp.routes, len(ids)),
                        metadata={"turns": len(turn_rewards), "turn_rewards": turn_rewards,
                                  "turn_returns": returns, "completion_text": texts[-1]})
        return Trajectory([sample], group_id=str(data.get("id", "")))
