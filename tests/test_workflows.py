"""Workflows return exact training data: ids, masks, logprobs, versions and rewards."""

import asyncio

import pytest

from asyncrl.api import GenerationConfig, ModelRequest, ModelResponse, StopReason
from asyncrl.inference.async_engine import AsyncLLMEngine
from asyncrl.inference.engine import EngineConfig
from asyncrl.models.chat import render_chat
from asyncrl.models.tiny import build_byte_tokenizer, build_tiny_model
from asyncrl.models.config import TinyModelConfig
from asyncrl.reward.call import answer_reward
from asyncrl.reward.exact import exact_answer_reward
from asyncrl.rollout.agent_env import AgentEnvConfig, AgentEnvWorkflow
from asyncrl.rollout.arithmetic_env import ArithmeticEnv, ChatAgent
from asyncrl.rollout.executor import RolloutConfig, WorkflowExecutor
from asyncrl.rollout.multi_turn import MultiTurnConfig, MultiTurnWorkflow
from asyncrl.rollout.rlvr import RLVRWorkflow
from conftest import run_episodes

TOK = build_byte_tokenizer()
REWARD = answer_reward(exact_answer_reward)
DATA = {"id": "q1", "messages": [{"role": "user", "content": "3+4="}], "answer": "7"}


class ScriptedEngine:
    """Replies with the given texts in order (+ EOS); logprobs -0.1 per token; version 5."""

    def __init__(self, replies):
        self.replies, self.requests = list(replies), []

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        self.requests.append(req)
        out = TOK.encode(self.replies.pop(0), add_special_tokens=False) + [TOK.eos_token_id]
        return ModelResponse(req.input_ids, out, [-0.1] * len(out), [5] * len(out),
                             StopReason.STOP)

    def get_version(self):
        return 5


def test_rlvr_group_rewards_and_alignment():
    wf = RLVRWorkflow(REWARD, GenerationConfig(n_samples=3, max_new_tokens=8), TOK)
    traj = asyncio.run(wf.arun_episode(ScriptedEngine(["7", "8", "The answer is 7"]), DATA))
    assert traj.rewards == [1.0, 0.0, 1.0] and traj.group_id == "q1"
    prompt = TOK.encode(render_chat(TOK, DATA["messages"]), add_special_tokens=False)
    s = traj.samples[0]
    assert s.input_ids == prompt + TOK.encode("7", add_special_tokens=False) + [TOK.eos_token_id]
    assert s.loss_mask == [0] * len(prompt) + [1, 1]
    assert s.versions == [-1] * len(prompt) + [5, 5] and s.logprobs[-2:] == [-0.1, -0.1]


def test_multi_turn_feedback_masks_and_discounted_rewards():
    cfg = MultiTurnConfig(max_turns=3, turn_discount=0.9, wrong_feedback="No.")
    wf = MultiTurnWorkflow(REWARD, GenerationConfig(max_new_tokens=8), TOK, cfg)
    engine = ScriptedEngine(["5", "7"])
    traj = asyncio.run(wf.arun_episode(engine, DATA))
    s = traj.samples[0]
    # Zero retokenisation drift: the sequence is exactly the template's rendering of the dialog.
    dialog = DATA["messages"] + [{"role": "assistant", "content": "5"},
                                 {"role": "user", "content": "No."},
                                 {"role": "assistant", "content": "7"}]
    assert TOK.decode(s.input_ids) == render_chat(TOK, dialog, add_generation_prompt=False).rstrip("\n")
    assert engine.requests[1].input_ids == s.input_ids[: len(engine.requests[1].input_ids)]
    gen = [i for i, m in enumerate(s.loss_mask) if m]
    assert [TOK.decode([s.input_ids[i]]) for i in gen] == ["5", "<|im_end|>", "7", "<|im_end|>"]
    assert all(s.versions[i] == 5 for i in gen) and s.versions.count(-1) == len(s.input_ids) - 4
    assert s.metadata["turn_rewards"] == [-1.0, 1.0]
    assert s.reward == pytest.approx(-1.0 + 0.9 * 1.0)
    assert s.token_rewards[gen[1]] == -1.0 and s.token_rewards[gen[3]] == 1.0


def test_multi_turn_stops_at_first_success_and_at_max_turns():
    wf = MultiTurnWorkflow(REWARD, GenerationConfig(max_new_tokens=8), TOK,
                           MultiTurnConfig(max_turns=2, reward_scaling=2.0, reward_bias=0.5))
    first = asyncio.run(wf.arun_episode(ScriptedEngine(["7"]), DATA)).samples[0]
    assert first.metadata["turns"] == 1 and first.reward == pytest.approx((1 - 0.5) * 2)
    never = asyncio.run(wf.arun_episode(ScriptedEngine(["1", "2", "3"]), DATA)).samples[0]
    assert never.metadata["turns"] == 2 and never.metadata["turn_rewards"] == [-3.0, -3.0]


def test_agent_env_returns_per_step_samples():
    wf = AgentEnvWorkflow(lambda d: ChatAgent(TOK, GenerationConfig(max_new_tokens=8)),
                          lambda d: ArithmeticEnv(d, feedback="No."), AgentEnvConfig(discount=0.5))
    traj = asyncio.run(wf.arun_episode(ScriptedEngine(["9", "7"]), DATA))
    assert [s.metadata["step_reward"] for s in traj.samples] == [0.0, 1.0]
    assert traj.rewards == [0.5, 1.0] and traj.metadata["steps"] == 2
    second_prompt = TOK.decode(traj.samples[1].input_ids)
    assert "No." in second_prompt and "9" in second_prompt  # the agent kept the conversation


def test_rlvr_on_the_real_engine_through_the_executor(tmp_path):
    model = build_tiny_model(TinyModelConfig(hidden_size=64, num_layers=2, num_heads=2,
                                             num_kv_heads=1, intermediate_size=128),
                             tmp_path / "m")
    engine = AsyncLLMEngine(EngineConfig(model_path=str(model), max_seq_len=128))
    wf = RLVRWorkflow(REWARD, GenerationConfig(n_samples=4, max_new_tokens=6, seed=1), TOK)
    rows = [dict(DATA, id=f"q{i}") for i in range(3)]
    try:
        with WorkflowExecutor(engine, RolloutConfig(batch_size=3), wf) as ex:
            trajs = run_episodes(ex, rows)
    finally:
        engine.shutdown()
    assert len(trajs) == 3 and all(len(t) == 4 for t in trajs)
    for t in trajs:
        for s in t.samples:
            n = s.num_generated
            assert 1 <= n <= 6 and s.versions[-n:] == [0] * n
            assert all(lp <= 0 for lp in s.logprobs[-n:])
